"""The tool against real LXC containers (tests/fixtures/lxcnode.py: a Debian rootfs with the container's
own python and CPU torch; tests/realpct/pct: pct's commands over lxc-attach, lxc-start, lxc-stop) behind
the real sshd on 127.0.0.1: what the pct stand-in cannot show (PID, mount, cgroup namespaces, a hard
stop that takes every process of the container with it, PIDs counted again from 1 after a restart).

One container for the tests of the tool (CT 230, module-scoped), deployed once; they run in file order,
the container-life tests (a hard stop under a run, a shutdown, a hard stop under a regen and a
bench-decode, one under a deploy) stop and restart it, each leaving it running. CT 231 (targets
--check's warnings) and the last test's CT 232 (tests/realpct/pct itself, function-scoped fixtures) are
their own. Once the base rootfs is cached, about 1 minute on 2 cores (3 under load 5; docs/benchmarks.md)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import lxc_inventory_writer
from trainer_quick import CLI_MAIN, IDLE_RUN, copy_trainer, tiny_run_config, wait_for

from orchestrator import inventory
from orchestrator.deploy import sync as deploy

pytestmark = pytest.mark.lxc

VMID = 230
TARGET = "ct230"
WORKDIR = "/srv/ct/dflash"
PYTHON = "/root/venv/bin/python"
LONG = [*IDLE_RUN, "--", "--steps", "1000000"]


class Env:
    def __init__(self, pct, sshd, path: Path, cfg: Path, tmp: Path):
        self.pct, self.sshd, self.path, self.cfg, self.tmp = pct, sshd, path, cfg, tmp
        self.source: Path | None = None     # what the fixture deployed

    def argv(self, *args) -> list[str]:
        return [sys.executable, "-c", CLI_MAIN, "-i", str(self.path), *map(str, args)]

    def cli(self, *args, timeout=240) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), capture_output=True, timeout=timeout)

    def launch(self, *args) -> str:
        r = self.cli("launch", TARGET, "--gpus", "0", "--workers", "1", "--policy", "eager", "--config", self.cfg,
                     *args)
        assert r.returncode == 0, r.stderr.decode()
        return r.stdout.decode().strip()

    def rundir(self, run) -> Path:
        return self.pct.private(VMID) / "dflash" / "runs" / run

    def record(self, run) -> dict:
        return json.loads((self.rundir(run) / "run.json").read_text())

    def steps_logged(self, run) -> int:
        path = self.rundir(run) / "train.log"
        return path.read_bytes().count(b'{"step": ') if path.exists() else 0

    def status(self, run) -> dict:
        r = self.cli("status", TARGET, "--json")
        assert r.returncode == 0, r.stderr.decode()
        return next(x for x in json.loads(r.stdout)["runs"] if x["run"] == run)

    def in_ct(self, *argv, **kw) -> subprocess.CompletedProcess:
        """A command in the container, straight through pct (no ssh, no dflash-ops)."""
        return self.pct.run("exec", VMID, "--", *argv, **kw)


@pytest.fixture(scope="module")
def ct(sshd, lxcpct_module, tmp_path_factory):
    """CT 230 running, in a hosts.yaml as `ct230` (its python: the container's venv), the trainer deployed."""
    tmp = tmp_path_factory.mktemp("realct")
    lxcpct_module.create(VMID)
    make = lxc_inventory_writer(tmp, sshd, lxcpct_module.path)
    path = make({TARGET: {"host": "node", "vmid": VMID, "workdir": WORKDIR}})
    cfg = tmp / "tiny.yaml"
    cfg.write_text(tiny_run_config())
    env = Env(lxcpct_module, sshd, path, cfg, tmp)
    source = env.source = copy_trainer(tmp / "src")   # only the trainer package: what a run needs, quick to deploy
    res = deploy.deploy(inventory.load(str(path)), [TARGET], source=str(source))[TARGET]
    assert res.ok, res.error
    return env


def test_the_container_is_a_real_one(ct):
    """Its own PID namespace and root filesystem; pct's environment rules (keep-env 0: PATH, container=lxc)."""
    r = ct.pct.run("exec", VMID, "--keep-env", "0", "--", "env")
    assert r.returncode == 0 and sorted(r.stdout.decode().split()) == [
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "container=lxc"]
    r = ct.in_ct("cat", "/proc/1/cmdline")
    assert r.stdout.split(b"\0")[:2] == [b"/usr/bin/python3", b"/sbin/ct-init"]
    r = ct.in_ct("sh", "-c", "grep PRETTY_NAME /etc/os-release; ls /srv/ct/dflash")
    assert b"bookworm" in r.stdout and b"current" in r.stdout, r
    r = ct.pct.run("exec", VMID, "--", "sh", "-c", "kill -9 $$")
    assert r.returncode == 137
    r = ct.pct.run("exec", "231", "--", "true")
    assert r.returncode == 255 and r.stderr == b"Configuration file 'nodes/pve1/lxc/231.conf' does not exist\n"


def test_targets_check_reports_the_containers_python_and_torch(ct):
    container_python = ct.in_ct(PYTHON, "-c", "import platform; print(platform.python_version())").stdout.decode()
    r = ct.cli("targets", "--check", TARGET)
    out = r.stdout.decode() + r.stderr.decode()
    assert r.returncode == 0, out
    assert f"CT {VMID}  running    {container_python.strip()}  2.13.0+cpu" in out, out
    r = ct.cli("targets", "--check", TARGET, "--json")
    doc = json.loads(r.stdout)["targets"][TARGET]
    assert (doc["ok"], doc["container"], doc["python"], doc["torch"]) == (
        True, "running", container_python.strip(), "2.13.0+cpu"), doc


def test_targets_check_says_what_breaks_gpu_training_in_the_container(ct):
    """CT 231: no /dev/nvidia*, a 64 MB /dev/shm, memlock 64 KiB, its workdir on a 32 MB filesystem; hosts.yaml
    gives it 2 GPUs: one line each, with its remedy. CT 230 (gpus 0, room on its disk): none."""
    ct.pct.create(231, extra="\n".join([
        "lxc.mount.entry = tmpfs dev/shm tmpfs rw,nosuid,nodev,create=dir,size=64m 0 0",
        "lxc.mount.entry = tmpfs srv/small tmpfs rw,create=dir,size=32m 0 0",
        "lxc.prlimit.memlock = 65536"]))
    try:
        path = lxc_inventory_writer(ct.tmp, ct.sshd, ct.pct.path)(
            {TARGET: {"host": "node", "vmid": VMID, "workdir": WORKDIR},
             "ct231": {"host": "node", "vmid": 231, "workdir": "/srv/small/dflash", "gpus": 2}})
        r = subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", str(path), "targets", "--check", "--json"],
                           capture_output=True, timeout=120)
        assert r.returncode == 1, r.stderr.decode()     # what breaks GPU training fails the check
        docs = json.loads(r.stdout)["targets"]
        text = subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", str(path), "targets", "--check"],
                              capture_output=True, timeout=120)
    finally:
        ct.pct.destroy(231)
    assert docs[TARGET]["ok"] and docs[TARGET]["warnings"] == [], docs[TARGET]
    bad = docs["ct231"]
    assert not bad["ok"] and "3 thing(s) in this container break GPU training" in bad["error"], bad
    said = [line for line in text.stderr.decode().splitlines() if line.startswith("dflash-ops: ct231: ")]
    assert text.returncode == 1 and len(said) == 4, text.stderr.decode()     # one line each, on a terminal too
    assert not any(line.startswith(f"dflash-ops: {TARGET}: ") for line in text.stderr.decode().splitlines())
    nodes, shm, memlock, disk = bad["warnings"]
    assert nodes.startswith("no /dev/nvidia* GPU device nodes in CT 231 (hosts.yaml gives it 2 GPU(s)): pass them "
                            "through: `dev0: /dev/nvidia0`") and "/etc/pve/lxc/231.conf" in nodes, nodes
    assert shm.startswith("/dev/shm is 64 MiB: NCCL's shared-memory transport") and "size=16G" in shm, shm
    assert memlock.startswith("locked memory is limited to 64 KiB (ulimit -l)") and \
        "`lxc.prlimit.memlock: unlimited` in /etc/pve/lxc/231.conf" in memlock, memlock
    assert disk.startswith("low disk: /srv/small (where /srv/small/dflash is) has 32 MiB free of 32 MiB") and \
        "`dflash-ops prune ct231 --keep 2`" in disk and "pct resize 231 rootfs" in disk, disk


def test_exec_passes_the_exit_status_and_runs_in_the_container(ct):
    r = ct.cli("exec", TARGET, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (r.returncode, r.stdout, r.stderr) == (7, b"out\n", b"err\n")
    r = ct.cli("exec", TARGET, "--", "python", "-c",
               "import os, sys, torch; print(sys.executable, torch.__version__, os.environ['container'])")
    assert r.returncode == 0 and r.stdout.decode().split() == [PYTHON, "2.13.0+cpu", "lxc"], r
    r = ct.cli("exec", TARGET, "--", "no-such-program")
    assert r.returncode == 127 and b"not on CT 230's PATH" in r.stderr, r.stderr


def test_ctrl_c_of_exec_ends_the_command_in_the_container(ct):
    pidfile = ct.pct.private(VMID) / "exec.pid"
    pidfile.unlink(missing_ok=True)
    proc = subprocess.Popen(ct.argv("exec", TARGET, "--", "sh", "-c",
                                    "echo $$ > /srv/ct/exec.pid.tmp; mv /srv/ct/exec.pid.tmp /srv/ct/exec.pid; "
                                    "exec sleep 300"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        pid = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), what="the command"))
        wait_for(lambda: b"sleep" in ct.in_ct("cat", f"/proc/{pid}/cmdline").stdout, what="sleep to start")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.decode().splitlines() == [f"dflash-ops: interrupted (SIGINT): the command was ended on {TARGET}"]
    wait_for(lambda: ct.in_ct("kill", "-0", str(pid)).returncode != 0, timeout=10, what="the command to end")


def test_launch_follow_stop_and_export(ct):
    run = ct.launch("--", "--steps", "20")
    r = ct.cli("logs", TARGET, "--follow")
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert f"run {run}: succeeded" in err and "steps 20" in err
    st = ct.status(run)
    assert (st["state"], st["step"]) == ("succeeded", 20)
    rec = ct.record(run)
    assert rec["command"][0] == PYTHON and rec["pid"] < 10000     # a PID of the container's own namespace

    dest = ct.tmp / "drafter"
    r = ct.cli("export", TARGET, run, "-o", dest, "--json")
    assert r.returncode == 0, r.stderr.decode()
    doc = json.loads(r.stdout)
    assert doc["run"] == run and sorted(p.name for p in dest.iterdir()) == sorted(f["name"] for f in doc["files"])
    assert "model.safetensors" in {f["name"] for f in doc["files"]}

    long = ct.launch(*LONG)
    wait_for(lambda: ct.steps_logged(long) >= 3, what="training steps")
    r = ct.cli("stop", TARGET, long)
    assert r.returncode == 0 and f"run {long} stopped (SIGTERM -> exit 143".encode() in r.stdout, r
    r = ct.cli("logs", TARGET, long)
    assert r.returncode == 103 and f"run {long}: stopped".encode() in r.stderr


def test_the_train_playbook_deploys_probes_launches_follows_and_exports(ct):
    """The shipped playbooks/train.yaml, whole, on the real container: deploy, the probe's threads in the
    container's own torch, a launch on the CPU, the follow to the end, the tau check and the export home."""
    out = ct.tmp / "play-export"
    r = ct.cli("play", Path(__file__).resolve().parent.parent / "playbooks" / "train.yaml", TARGET,
               "--var", f"config={ct.cfg}", "--var", "gpus=0", "--var", "trainer_args=--steps 6",
               "--var", "probe_policies=eager", "--var", "probe_topologies=threads",
               "--var", f"source={ct.source}", "--var", f"output={out}", "--json", timeout=600)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    play = json.loads(r.stdout)["targets"][TARGET]
    steps = {s["name"]: s for s in play["steps"]}
    assert play["ok"] and {"deploy", "probe", "launch", "follow", "tau", "export"} <= set(steps), play
    assert all(s["status"] in ("ok", "changed") for s in steps.values()), play
    run = steps["launch"]["result"]["run"]
    assert ct.status(run)["state"] == "succeeded"
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def _occupy_pids(ct, pids: list[int]) -> list[int]:
    """Fork in the container until each of PIDS is a `sleep` (PIDs are handed out in order after a
    restart: the first process to reach a number gets it); returns the PIDs taken."""
    code = ("import os, sys\n"
            "want = sorted(int(a) for a in sys.argv[1:]); taken = []\n"
            "for n in want:\n"
            "    while True:\n"
            "        pid = os.fork()\n"
            "        if pid == 0:\n"
            "            if os.getpid() == n:\n"
            "                fd = os.open('/dev/null', os.O_RDWR)\n"
            "                [os.dup2(fd, i) for i in (0, 1, 2)]\n"
            "                os.setsid(); os.execvp('sleep', ['sleep', '600'])\n"
            "            os._exit(0)\n"
            "        if pid == n:\n"
            "            taken.append(n); break\n"
            "        os.waitpid(pid, 0)\n"
            "        if pid > n: break\n"
            "print(*taken)\n")
    r = ct.in_ct(PYTHON, "-c", code, *map(str, pids))
    assert r.returncode == 0, r.stderr
    return [int(x) for x in r.stdout.split()]


def _follow(ct, run):
    """`logs TARGET RUN --follow` started, once it streams the log (its stdout, a file: returned too)."""
    out = ct.tmp / f"follow-{run}.out"
    with open(out, "wb") as f:
        follow = subprocess.Popen(ct.argv("logs", TARGET, run, "--follow"), stdout=f, stderr=subprocess.PIPE)
    seen = ct.steps_logged(run)
    # streaming: the log's first bytes have arrived and a step logged since is there too
    wait_for(lambda: out.stat().st_size > 0 and out.read_bytes().count(b'{"step": ') > seen, what="the follow")
    return follow, out


def _container_line(run: str, kind: str = "run") -> str:
    """The start of the follow's last line when the container of the run it follows is found stopped."""
    return (f"dflash-ops: {TARGET}: {kind} {run}: lost (ended with its container: CT {VMID} is stopped "
            f"(`pct start {VMID}`, then `dflash-ops status {TARGET}` says how it ended and `dflash-ops launch "
            f"{TARGET} --resume {run}` continues it from "
            + ("the rows it wrote)); " if kind == "regen run" else "its last checkpoint)); "))


def _boot(ct) -> str:
    """The container's boot as the runs agent records it (remote/runs/records.py boot): BOOT_ID/PID 1's start."""
    r = ct.in_ct("sh", "-c", "cat /proc/sys/kernel/random/boot_id; cut -d' ' -f22 /proc/1/stat")
    boot_id, init = r.stdout.decode().split()
    return f"{boot_id}/{init}"


def test_a_hard_stopped_container_ends_the_follow_and_the_run_is_lost(ct):
    """`pct stop` under a training run being followed: the follow ends with the run's end, `lost` (exit 104),
    one line; after `pct start` status says `lost (ended with its container)`, the run's PIDs handed to other
    processes are not the run's (its record is of another boot), its slot is free, and `launch --resume`
    continues it from its last checkpoint."""
    run = ct.launch(*LONG, "--checkpoint-every", "2")
    wait_for(lambda: ct.steps_logged(run) >= 3 and list((ct.rundir(run) / "checkpoints").glob("step-*")),
             what="training steps and a checkpoint")
    rec = wait_for(lambda: ct.record(run).get("supervisor_pid") and ct.record(run), what="pids")
    assert rec["boot"] == _boot(ct), rec
    follow, out = _follow(ct, run)
    try:
        ct.pct.stop(VMID)
        _, err = follow.communicate(timeout=120)     # a retry loop would run into this, or say its retries
    finally:
        follow.kill()
    # The stream's agent died with the container (lxc-attach: 137); pct status says it is stopped: the run
    # ended with it. One line, exit 104 (README "Exit codes"), no retry loop, no note before it.
    lines = err.decode().strip().splitlines()
    assert follow.returncode == 104, (follow.returncode, err)
    assert len(lines) == 1 and lines[0].startswith(_container_line(run)), lines
    assert "steps " in lines[0] and "steps -" not in lines[0], lines    # where it was, from the log it streamed

    ct.pct.start(VMID)
    assert _boot(ct) != rec["boot"] and _boot(ct).split("/")[0] != rec["boot"].split("/")[0]
    st = ct.status(run)
    assert (st["state"], st["exit"]["lost"], st["exit"]["container_restarted"]) == ("lost", True, True), st
    assert st["exit"]["reason"].startswith("ended with its container"), st
    r = ct.cli("status", TARGET)
    [line] = [x for x in r.stdout.decode().splitlines() if x.startswith(run)]
    assert "lost (ended with its container)" in line, r.stdout.decode()
    # The run's PIDs given to new processes after the restart: still not the run's.
    taken = _occupy_pids(ct, [rec["pid"], rec["supervisor_pid"]])
    assert rec["pid"] in taken, (taken, rec)
    st = ct.status(run)
    assert st["state"] == "lost", st
    r = ct.cli("logs", TARGET, run)
    assert r.returncode == 104 and f"run {run}: lost (ended with its container".encode() in r.stderr, r.stderr

    # The run's slot lock is free for a new launch (its holder is gone: cleared as stale, and said)
    r = ct.cli("launch", TARGET, "--gpus", "0", "--workers", "1", "--policy", "eager", "--config", ct.cfg, *LONG)
    assert r.returncode == 0, r.stderr.decode()
    assert f"cleared a stale lock on cpu left by run {run}".encode() in r.stderr, r.stderr
    again = r.stdout.decode().strip()
    wait_for(lambda: ct.steps_logged(again) >= 1, what="training steps of the new run")
    r = ct.cli("stop", TARGET, again, "--force")
    assert r.returncode == 0 and b"stopped" in r.stdout, r

    # ... and the lost run continues from its last checkpoint
    last = max(int(p.name.split("-")[1]) for p in (ct.rundir(run) / "checkpoints").glob("step-*"))
    r = ct.cli("launch", TARGET, "--resume", run)
    assert r.returncode == 0 and f"resumed run {run} (attempt 2".encode() in r.stderr, r.stderr
    wait_for(lambda: f'{{"event": "resume", "step": {last}}}'.encode() in (ct.rundir(run) / "train.log").read_bytes(),
             what="the resumed trainer")
    assert ct.record(run)["attempts"][0]["state"] == "lost"
    r = ct.cli("stop", TARGET, run, "--force")
    assert r.returncode == 0, r


def test_a_clean_shutdown_under_a_running_job_stops_it_with_a_checkpoint(ct):
    """`pct shutdown`: the container's init sends SIGTERM to every process (as systemd's final kill does),
    so the trainer checkpoints and exits 143: the run is `stopped`, resumable. The follow's own agent got
    the SIGTERM too: it reconnects, and ends with the run's end (103) if the container still answers,
    else as a run that ended with its container (104): which one is a race with the container's last second.
    A reconnect that reaches the container while it goes down (its agent killed, or lxc-attach unable to
    enter, before any header) tries once more, so the follow never ends on `follow the log exited 137`."""
    run = ct.launch(*LONG)
    wait_for(lambda: ct.steps_logged(run) >= 3, what="training steps")
    follow, out = _follow(ct, run)
    try:
        ct.pct.shutdown(VMID)
        _, err = follow.communicate(timeout=120)
    finally:
        follow.kill()
    last = err.decode().strip().splitlines()[-1]
    assert (follow.returncode == 103 and f"run {run}: stopped (exit 143)" in last) or (
        follow.returncode == 104 and last.startswith(_container_line(run))), err
    assert b"Traceback" not in err
    ct.pct.start(VMID)
    st = ct.status(run)
    assert (st["state"], st["exit"]["exit_code"]) == ("stopped", 143), st
    assert list((ct.rundir(run) / "checkpoints").glob("step-*")), "no checkpoint written"
    r = ct.cli("launch", TARGET, "--resume", run)
    assert r.returncode == 0 and f"resumed run {run} (attempt 2".encode() in r.stderr, r.stderr
    r = ct.cli("stop", TARGET, run, "--force")
    assert r.returncode == 0, r


CHAT = [("def add(a, b):\n", "    return a + b\n"), ("import os\n", "import sys\n"), ("class P:\n", "    x = 1\n"),
        ("for i in range(3):\n", "    print(i)\n"), ("while True:\n", "    break\n"), ("x = [1]\n", "y = x\n")]


def test_a_regen_and_a_bench_decode_end_with_their_container(ct, smoke_target):
    """One `pct stop` under a regen (held before its third batch, followed) and a bench-decode (decoding for
    minutes on the slot gpu0 of `ct230g`, the same container as if it had a GPU): the follow ends as the
    regen's end, `lost` (104); the bench-decode says it ended with its container (1). After `pct start`: the
    regen is `lost` and `launch --resume` finishes it from the rows it had written; no bench-decode is listed
    and its slot is free. The regen answers with the small real target at its smoke size (the session's
    build, conftest.py), copied into the container: `tiny` has no chat template for regen."""
    model = ct.pct.private(VMID) / "smoke-target"
    if not model.exists():
        shutil.copytree(smoke_target[1], model)
    (ct.pct.private(VMID) / "chat.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n" for q, a in CHAT))
    cfg = ct.tmp / "chat.yaml"
    cfg.write_text(tiny_run_config(data="/srv/ct/chat.jsonl", block_size=4, eval_prompts=2, eval_new_tokens=8,
                                   steps=4))
    trained = ct.launch("--config", cfg)
    r = ct.cli("logs", TARGET, trained, "--follow")
    assert r.returncode == 0, r.stderr.decode()
    path = lxc_inventory_writer(ct.tmp, ct.sshd, ct.pct.path)(
        {TARGET: {"host": "node", "vmid": VMID, "workdir": WORKDIR},
         "ct230g": {"host": "node", "vmid": VMID, "workdir": WORKDIR, "gpus": 1}})

    def cli(*args, **kw):
        return subprocess.Popen([sys.executable, "-c", CLI_MAIN, "-i", str(path), *map(str, args)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)

    prompts = ct.tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q, _ in CHAT))
    r = ct.cli("regen", TARGET, "--prompts", prompts, "--model", "/srv/ct/smoke-target", "--gpus", "0",
               "--max-new-tokens", "6", "--batch-size", "2",
               "--env", "DFLASH_TRAINER_FAULTS=regen_batch=2:hang")    # hangs before its third batch
    assert r.returncode == 0, r.stderr.decode()
    regen = r.stdout.decode().strip()
    rows = ct.rundir(regen) / "regen.jsonl"
    wait_for(lambda: rows.exists() and rows.read_bytes().count(b"\n") == 4, what="two batches written")
    follow = cli("logs", TARGET, regen, "--follow")
    bench = cli("bench-decode", "ct230g", trained, "--max-new-tokens", "100000", "--limit", "1")
    try:
        # its worker, `python -c RUN_MODULE RELEASE trainer.specdec --target ...` (the agent's own source names
        # trainer.specdec too, never followed by a space and --target)
        def decoding():
            if bench.poll() is not None:
                pytest.fail(f"bench-decode ended early: {bench.returncode}: {bench.stderr.read().decode()}")
            return ct.in_ct("pgrep", "-f", " trainer[.]specdec --target ").returncode == 0
        wait_for(decoding, 180, "the bench's specdec")
        lock = json.loads((ct.pct.private(VMID) / "dflash" / "locks" / "gpu0.json").read_text())
        assert lock["run"].startswith("bench-") and lock["boot"] == _boot(ct), lock
        ct.pct.stop(VMID)
        _, err = follow.communicate(timeout=120)
        _, bench_err = bench.communicate(timeout=120)
    finally:
        follow.kill()
        bench.kill()
    lines = err.decode().strip().splitlines()
    assert follow.returncode == 104 and len(lines) == 1 and lines[0].startswith(
        _container_line(regen, "regen run")), err
    [line] = bench_err.decode().strip().splitlines()[-1:]
    assert bench.returncode == 1 and line.startswith(
        f"dflash-ops: ct230g: run {trained}: the measurement ended with its container: CT {VMID} went down under "
        f"the command (exit 137, killed by SIGKILL) and is stopped; start it with `pct start {VMID}`; nothing "
        "measured"), bench_err.decode()
    assert b"Traceback" not in bench_err

    ct.pct.start(VMID)
    r = ct.cli("status", TARGET, "--json")
    runs = json.loads(r.stdout)["runs"]
    assert [x["kind"] for x in runs if x["kind"] == "bench-decode"] == [], runs
    st = next(x for x in runs if x["run"] == regen)
    assert (st["state"], st["kind"], st["exit"]["container_restarted"]) == ("lost", "regen", True), st
    r = ct.cli("launch", TARGET, "--resume", regen)     # the fault is not set again
    assert r.returncode == 0 and f"resumed run {regen} (attempt 2".encode() in r.stderr, r.stderr
    r = ct.cli("logs", TARGET, regen, "--follow")
    assert r.returncode == 0 and b"regen: resuming after 4 of 6 rows" in r.stdout, r.stdout.decode()
    assert rows.read_bytes().count(b"\n") == 6
    # the bench's slot: its lock is of another boot, so the next claim of gpu0 takes it
    launch = cli("launch", "ct230g", "--gpus", "1", "--policy", "eager", "--config", ct.cfg, *LONG)
    out, err = launch.communicate(timeout=240)
    assert launch.returncode == 0 and f"cleared a stale lock on gpu0 left by run {lock['run']}".encode() in err, err
    assert ct.cli("stop", TARGET, out.decode().strip(), "--force").returncode == 0


def test_a_container_stopped_mid_deploy_is_repaired_by_the_next_deploy(ct):
    """`pct stop` while a deploy streams its changed files into the container: the deploy fails in one line
    that says the container went down under it, `current` still names the complete release it named, and the
    next deploy (after `pct start`) clears the partial release and flips to a complete new one."""
    src = copy_trainer(ct.tmp / "src-deploy")
    (src / "trainer" / "blob_for_deploy.py").write_text(f"BLOB = {os.urandom(2 << 20).hex()!r}\n")
    wd = ct.pct.private(VMID) / "dflash"
    before = os.readlink(wd / "current")
    inv = inventory.load(str(ct.path))
    reached, go, result = threading.Event(), threading.Event(), {}

    def progress(target, total):
        def update(n):          # the first bytes are on their way: hold the stream here
            reached.set()
            assert go.wait(120)
        return update

    def run():
        result["r"] = deploy.deploy(inv, [TARGET], source=str(src), progress=progress)[TARGET]

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert reached.wait(120), "the deploy never started streaming"
        wait_for(lambda: [p for p in (wd / "releases").iterdir() if p.name.endswith(".partial")], 60,
                 "the partial release")
        ct.pct.stop(VMID)
    finally:
        go.set()
        thread.join(120)
    res = result["r"]
    assert not res.ok and res.error.startswith(f"{TARGET}: container {VMID}: went down under the command (exit 137"), \
        res.error
    assert "\n" not in res.error and "Traceback" not in res.error
    ct.pct.start(VMID)
    assert os.readlink(wd / "current") == before
    assert [p.name for p in (wd / "releases").iterdir() if p.name.endswith(".partial")]      # its leftover
    again = deploy.deploy(inv, [TARGET], source=str(src))[TARGET]
    assert again.ok, again.error
    assert not [p for p in (wd / "releases").iterdir() if p.name.endswith(".partial")]
    live = wd / "releases" / os.path.basename(os.readlink(wd / "current"))
    assert again.release == live.name != os.path.basename(before)
    assert (live / "trainer" / "blob_for_deploy.py").read_bytes() == \
        (src / "trainer" / "blob_for_deploy.py").read_bytes()
    r = ct.in_ct(PYTHON, "-c", "import sys; sys.path.insert(0, '/srv/ct/dflash/current'); "
                                "import trainer.blob_for_deploy as b; print(len(b.BLOB))")
    assert r.returncode == 0 and r.stdout.strip() == str(4 << 20).encode(), r


def test_realpct_has_pcts_semantics(lxcpct, make_lxc_inventory, tmp_path):
    """tests/realpct/pct itself (the function-scoped fixtures, FakePct's interface): refusals exit 255 with
    pct's words; push/pull one regular file whose folder must exist; stop is hard, shutdown clean."""
    share = lxcpct.create(232, name="pctcheck")
    assert share == lxcpct.private(232) and lxcpct.status(232) == "running" and lxcpct.vmids() == [232]
    src = tmp_path / "in.txt"
    src.write_bytes(b"one file\n")
    r = lxcpct.run("push", 232, src, "/root/in.txt", "--perms", "600")
    assert r.returncode == 0, r.stderr
    r = lxcpct.run("exec", 232, "--", "stat", "-c", "%a %s", "/root/in.txt")
    assert r.stdout == b"600 9\n"
    r = lxcpct.run("push", 232, src, "/no/such/folder/in.txt")
    assert r.returncode == 0          # pct's fork_worker: the failure is said on stderr, pct exits 0
    assert r.stderr == b"failed to create file: /no/such/folder/in.txt: No such file or directory\n"
    r = lxcpct.run("pull", 232, "/etc/os-release", tmp_path / "os-release")
    assert r.returncode == 0 and b"bookworm" in (tmp_path / "os-release").read_bytes()
    r = lxcpct.run("exec", 232, "ls", "-la")           # an inner option without `--`: pct's own
    assert r.returncode == 255 and b"Unknown option: la" in r.stderr and b"400 unable to parse option" in r.stderr
    env = {"SSL_CERT_FILE": "/x", "X": "kept", "PATH": "/usr/bin:/bin"}
    r = lxcpct.run("exec", 232, "--", "sh", "-c", "echo $SSL_CERT_FILE; echo $X", env=env)
    assert r.stdout == b"\nkept\n"                       # keep-env 1 by default; SSL_CERT_FILE removed

    # `stop` is hard: no process is asked first (a trap of SIGTERM or SIGPWR never runs), all are SIGKILLed;
    # `shutdown` below, clean, sends SIGTERM first (the same trap runs there)
    r = lxcpct.run("exec", 232, "--", "sh", "-c",
                   "(trap 'echo asked > /srv/ct/stop-asked; exit 0' TERM PWR; while :; do sleep 0.1; done) "
                   ">/dev/null 2>&1 & echo started")
    assert r.stdout == b"started\n"
    lxcpct.stop(232)
    assert lxcpct.status(232) == "stopped" and not (share / "stop-asked").exists()
    r = lxcpct.run("exec", 232, "--", "true")
    assert r.returncode == 255 and r.stderr == b"container '232' not running!\n"
    r = lxcpct.run("push", 232, src, "/root/x")
    assert r.returncode == 255 and r.stderr == b"can only push files to a running CT\n"
    r = lxcpct.run("stop", 232)
    assert r.returncode == 255 and r.stderr == b"CT 232 not running\n"
    lxcpct.start(232)
    r = lxcpct.run("exec", 232, "--", "cat", "/root/in.txt")
    assert r.stdout == b"one file\n"                    # the container's own disk survives a restart
    # `shutdown` is clean: SIGTERM first (a trap sees it), then the container is down
    r = lxcpct.run("exec", 232, "--", "sh", "-c",
                   "(trap 'echo term > /srv/ct/got; exit 0' TERM; while :; do sleep 0.1; done) "
                   ">/dev/null 2>&1 & echo started")
    assert r.stdout == b"started\n"
    lxcpct.shutdown(232)
    assert lxcpct.status(232) == "stopped" and (share / "got").read_text() == "term\n"
    r = lxcpct.run("list")
    assert r.stdout.decode().split("\n")[1].split() == ["232", "stopped", "pctcheck"]

    lxcpct.start(232)
    path = make_lxc_inventory({"c": {"host": "node", "vmid": 232, "workdir": "/srv/ct/w"}})
    r = subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", str(path), "exec", "c", "--", "python", "-c",
                        "import sys; print(sys.executable)"], capture_output=True, timeout=60)
    assert r.returncode == 0 and r.stdout == f"{PYTHON}\n".encode(), r
