"""The run lifecycle for real: the real trainer (tiny settings, CPU) in a pct stand-in container
reached through a real sshd on 127.0.0.1, driven by the `dflash-ops` CLI as a user would."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_quick import CLI_MAIN, IDLE_RUN, tiny_run_config, wait_for

from orchestrator import inventory
from orchestrator.deploy import sync as deploy

REPO = Path(__file__).resolve().parent.parent
WORKDIR = "/srv/ct/dflash"
MAIN = CLI_MAIN
TINY = tiny_run_config()
LONG = [*IDLE_RUN, "--", "--steps", "1000000"]   # runs until the test stops or kills it


@pytest.fixture
def ct(sshd, fakepct, make_inventory, trainer_source, tmp_path):
    """A running CT 200 (2 GPUs in the inventory, CPU in fact) with the trainer deployed."""
    fakepct.create(200)
    path = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable,
                                     "workdir": WORKDIR, "gpus": 2}})
    inv = inventory.load(str(path))
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    env = Env(inv, path, fakepct, sshd, cfg, trainer_source)
    return env


class Env:
    def __init__(self, inv, path, pct, sshd, cfg, source):
        self.inv, self.path, self.pct, self.sshd, self.cfg, self.source = inv, path, pct, sshd, cfg, source
        self.target = inv.target("ct200")

    def deploy(self):
        res = deploy.deploy(self.inv, ["ct200"], source=str(self.source))["ct200"]
        assert res.ok, res.error

    def cli(self, *args, timeout=180):
        argv = [a if isinstance(a, bytes) else str(a) for a in args]   # bytes: not-UTF-8 arguments
        return subprocess.run([sys.executable, "-c", MAIN, "-i", str(self.path), *argv],
                              capture_output=True, timeout=timeout)

    def launch(self, *args) -> str:
        r = self.cli("launch", "ct200", "--gpus", "0", "--workers", "1", "--policy", "eager",
                     "--config", self.cfg, *args)
        assert r.returncode == 0, r.stderr.decode()
        return r.stdout.decode().strip()

    def rundir(self, run) -> Path:
        return self.pct.private(200) / "dflash" / "runs" / run

    def record(self, run) -> dict:
        return json.loads((self.rundir(run) / "run.json").read_text())

    def log(self, run) -> bytes:
        # the run folder is made a moment before its log: polling may see one without the other
        path = self.rundir(run) / "train.log"
        return path.read_bytes() if path.exists() else b""

    def steps_logged(self, run) -> int:
        return self.log(run).count(b'{"step": ')

    def status(self, run) -> dict:
        r = self.cli("status", "ct200", "--json")
        assert r.returncode == 0, r.stderr.decode()
        return next(x for x in json.loads(r.stdout)["runs"] if x["run"] == run)




def test_launch_refusals_say_what_to_do(ct):
    r = ct.cli("launch", "ct200", "--gpus", "0", "--policy", "eager")
    assert r.returncode == 1 and b"run `dflash-ops deploy ct200`" in r.stderr
    ct.deploy()
    r = ct.cli("launch", "ct200", "--gpus", "0")          # --policy auto is the default
    assert r.returncode == 1 and b"run `dflash-ops probe ct200`" in r.stderr
    r = ct.cli("launch", "ct200", "--gpus", "3", "--policy", "eager")
    assert r.returncode == 2 and b"more than the target's 2 GPU(s)" in r.stderr      # impossible: bad input
    for err in (r.stderr,):
        assert b"Traceback" not in err and len(err.decode().strip().splitlines()) == 1
    r = ct.cli("logs", "ct200")
    assert r.returncode == 102 and b"no runs yet" in r.stderr
    # unknown policy names are usage errors, refused before anything connects
    r = ct.cli("launch", "ct200", "--policy", "turbo")
    assert r.returncode == 2 and b"'turbo' is not one of 'auto', 'eager'," in r.stderr    # Click's, naming them
    r = ct.cli("probe", "ct200", "--policies", "eager,turbo")
    assert r.returncode == 2 and b"turbo: not a policy" in r.stderr and b"Traceback" not in r.stderr


def test_launch_detaches_then_logs_follow_to_success(ct, tmp_path):
    ct.deploy()
    run = ct.launch("--", "--steps", "20")
    # The SSH session that launched has ended (the CLI returned) while the run goes on.
    assert ct.status(run)["state"] == "running"
    rec = ct.record(run)
    assert rec["release"] and rec["command"][1:3] == ["-m", "trainer"] and rec["gpus"] == 0
    assert rec["config"]["file"].endswith("/tiny.yaml")

    r = ct.cli("logs", "ct200", "--follow")
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert r.stdout == ct.log(run)                   # stdout is the log, byte for byte
    assert f"run {run}: succeeded" in err and "steps 20" in err and "tau " in err
    st = ct.status(run)
    assert (st["state"], st["step"]) == ("succeeded", 20) and st["tau"] is not None

    r = ct.cli("logs", "ct200", run, "--no-follow", "--tail", "2")
    assert r.returncode == 0 and r.stdout == b"".join(ct.log(run).splitlines(keepends=True)[-2:])
    r = ct.cli("logs", "ct200", run, "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["state"] == "succeeded" and doc["step"] == 20

    png = tmp_path / "report.png"
    r = ct.cli("report", "ct200", "-o", png)
    path, each, held, tau = r.stdout.decode().strip().splitlines()
    assert r.returncode == 0 and path == str(png)
    assert each.startswith("tau at each eval: untrained ") and each.endswith(" (step 20)")   # evals on by default
    assert held.startswith("held-out loss at each eval: untrained ") and held.endswith(" (step 20)")
    assert tau.startswith("tau ") and " rounds), at step 20; acceptance by block position 1..15: " in tau
    assert png.read_bytes()[:4] == b"\x89PNG"
    r = ct.cli("stop", "ct200", run)
    assert r.returncode == 0 and b"already ended (succeeded); nothing to stop" in r.stdout
    r = ct.cli("report", "ct200", "20200101-000000-abcdef")
    assert r.returncode == 102


def test_follow_survives_dropped_connections_then_stop_checkpoints_and_logs_exits_103(ct, tmp_path):
    """A follower outlives three dropped connections, byte for byte; then `stop` (no run named: the running
    one) ends the run mid-way: SIGTERM, a checkpoint, exit 143, state stopped, and `logs` (the follower and
    a later one) exit 103. One run for both: the stop's half was a test of its own, with its own run."""
    ct.deploy()
    run = ct.launch(*LONG)
    out, errf = tmp_path / "follow.out", tmp_path / "follow.err"
    with open(out, "wb") as f, open(errf, "wb") as e:
        proc = subprocess.Popen([sys.executable, "-c", MAIN, "-i", str(ct.path), "logs", "ct200", run],
                                stdout=f, stderr=e)
    try:
        wait_for(lambda: ct.steps_logged(run) >= 3 and out.stat().st_size > 0, what="the stream")
        drops = 0
        for i in range(3):
            seen = out.stat().st_size
            # Drop only the connection the follower is using now: it has reported the previous
            # drop's reconnect, and new bytes have come since (a connection still closing from the
            # last drop would otherwise be "dropped" again and no reconnect follow).
            wait_for(lambda: errf.read_bytes().count(b"reconnected after") >= i
                     and out.stat().st_size > seen + 200 and ct.sshd.children(),
                     what="new bytes over a fresh connection")
            if ct.sshd.kill_connections():
                drops += 1
        seen = out.stat().st_size
        wait_for(lambda: errf.read_bytes().count(b"reconnected after") >= 3
                 and out.stat().st_size > seen + 200, what="the stream to resume")
        assert drops >= 3
        r = ct.cli("stop", "ct200")                      # mid-run: it trains until stopped
        assert r.returncode == 0, r.stderr
        assert f"run {run} stopped (SIGTERM -> exit 143".encode() in r.stdout
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
        stderr = errf.read_text()
    assert code == 103, stderr
    assert out.read_bytes() == ct.log(run), stderr       # nothing lost, nothing repeated
    assert stderr.count("reconnected after") >= 3, stderr
    assert f"run {run}: stopped" in stderr
    assert list((ct.rundir(run) / "checkpoints").glob("step-*")), "no checkpoint written"
    assert json.loads((ct.rundir(run) / "exit.json").read_text())["exit_code"] == 143
    assert ct.status(run)["state"] == "stopped"
    r = ct.cli("logs", "ct200", run)
    assert r.returncode == 103 and f"run {run}: stopped".encode() in r.stderr


def test_second_launch_on_busy_slot_is_refused_until_the_first_is_killed(ct):
    ct.deploy()
    first = ct.launch(*LONG)
    r = ct.cli("launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", ct.cfg)
    assert r.returncode == 1 and f"in use by run {first}".encode() in r.stderr, r.stderr
    rec = wait_for(lambda: ct.record(first).get("pid") and ct.record(first), what="pids")
    os.kill(rec["supervisor_pid"], signal.SIGKILL)   # kill -9 the whole run: nobody releases
    os.killpg(rec["pid"], signal.SIGKILL)            # the slot, its lock goes stale
    wait_for(lambda: ct.status(first)["state"] == "lost", what="the run to be seen dead")
    r = ct.cli("launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", ct.cfg, *LONG)
    assert r.returncode == 0, r.stderr
    assert f"cleared a stale lock on cpu left by run {first}".encode() in r.stderr
    again = r.stdout.decode().strip()
    r = ct.cli("stop", "ct200", again, "--force")
    assert r.returncode == 0 and b"stopped" in r.stdout


def test_sigsegv_is_a_failure_named_segfault(ct):
    ct.deploy()
    follow = subprocess.Popen([sys.executable, "-c", MAIN, "-i", str(ct.path), "launch", "ct200",
                               "--gpus", "0", "--policy", "eager", "--config", str(ct.cfg),
                               "--follow", *LONG], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        run = wait_for(lambda: [p.name for p in (ct.pct.private(200) / "dflash" / "runs").glob("*")],
                       what="the run folder")[0]
        wait_for(lambda: ct.steps_logged(run) >= 2, what="training steps")
        os.kill(ct.record(run)["pid"], signal.SIGSEGV)
        out, err = follow.communicate(timeout=180)
    finally:
        if follow.poll() is None:
            follow.kill()
    err = err.decode()
    assert follow.returncode == 100, err                # launch --follow = launch + logs --follow
    assert out == ct.log(run)
    assert "`segfault` (fatal)" in err and "cause: segfault" in err and "what to do:" in err
    st = ct.status(run)
    assert st["state"] == "failed" and st["exit"]["signal_name"] == "SIGSEGV"
    r = ct.cli("logs", "ct200", run, "--no-follow")
    assert r.returncode == 100 and b"`segfault`" in r.stderr


def test_a_stopped_container_is_a_clear_error_not_a_retry_loop(ct):
    ct.deploy()
    ct.pct.stop(200)
    for args in (("logs", "ct200"), ("status", "ct200"), ("stop", "ct200")):
        r = ct.cli(*args)      # a retry loop would run into the call's timeout, or say its retries
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and b"container 200" in lines[0], (args, r.stderr)
        # the container's line first, then (status, stop) the count of the targets that failed: nothing else
        assert lines[1:] in ([], [b"dflash-ops: failed on 1 target(s): ct200"]), (args, r.stderr)


def test_a_run_that_finishes_after_its_supervisor_was_killed_succeeded(ct):
    ct.deploy()
    run = ct.launch("--", "--steps", "40")
    rec = wait_for(lambda: ct.record(run).get("supervisor_pid") and ct.record(run), what="pids")
    os.kill(rec["supervisor_pid"], signal.SIGKILL)
    r = ct.cli("logs", "ct200", run, "--follow")
    err = r.stderr.decode()
    assert r.returncode == 0 and f"run {run}: succeeded" in err, err
    st = ct.status(run)
    assert (st["state"], st["step"]) == ("succeeded", 40) and not st["exit"]["lost"]
    assert not (ct.rundir(run) / "exit.json").exists()     # judged from the trainer's log


# ---- run housekeeping ------------------------------------------------------------------------

def _final_weights(rundir: Path):
    torch = pytest.importorskip("torch")
    from trainer.run import checkpoint
    return torch, checkpoint.load(checkpoint.find_latest(rundir)).model


def _uninterrupted(ct, run: str, out: Path) -> Path:
    """RUN again from its start, uninterrupted, in this process (no torch start-up of its own), with the
    trainer's flags the runs agent recorded for it (run.json's command, less the resumed attempt's
    --resume; its container paths seen from here): the reference is what `launch` started, not a copy."""
    from trainer.exits import run as run_program
    from trainer.train import train_entry

    command = ct.record(run)["command"]
    argv = command[command.index("-m") + 2:]         # python -m trainer ARGS
    mount = "/srv/ct"                                 # the container's view of ct.pct.private(200)
    argv = [str(ct.pct.private(200)) + a[len(mount):] if a.startswith(mount + "/") else a
            for a in argv if a != "--resume"]
    argv[argv.index("--out") + 1] = str(out)
    assert run_program(train_entry, argv) == 0
    return out


def test_resume_of_a_stopped_run_reaches_the_weights_of_an_uninterrupted_run(ct, tmp_path):
    ct.deploy()
    # IDLE_RUN: after step 4 it sleeps 0.2 s before each step, so the stop lands mid-run (35 steps of them
    # to spare) with the cores left to the test (150 steps at full speed before: the same margin, more CPU)
    split = ct.launch("--name", "split", *IDLE_RUN, "--", "--steps", "40")
    wait_for(lambda: ct.steps_logged(split) >= 5, what="training steps")
    r = ct.cli("stop", "ct200", split)
    assert r.returncode == 0 and b"stopped" in r.stdout, r.stdout + r.stderr
    r = ct.cli("launch", "ct200", "--resume", split, "--config", ct.cfg)
    assert r.returncode == 2 and b"--resume continues the run with its own config" in r.stderr
    r = ct.cli("launch", "ct200", "--resume", split)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().strip() == split                       # the same run id
    assert b"resumed run " + split.encode() + b" (attempt 2, was stopped" in r.stderr
    whole = _uninterrupted(ct, split, tmp_path / "uninterrupted")     # meanwhile
    r = ct.cli("logs", "ct200", split, "--follow")
    assert r.returncode == 0, r.stderr.decode()

    rec = ct.record(split)
    assert rec["attempt"] == 2 and [a["state"] for a in rec["attempts"]] == ["stopped"]
    assert "--resume" in rec["command"] and rec["name"] == "split"
    st = ct.status(split)
    assert (st["state"], st["step"], st["name"]) == ("succeeded", 40, "split")
    torch, wa = _final_weights(whole)
    _, wb = _final_weights(ct.rundir(split))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    r = ct.cli("status", "ct200")
    assert b"split" in r.stdout and b"NAME" in r.stdout
    r = ct.cli("launch", "ct200", "--resume", split)
    assert r.returncode == 1 and b"only a stopped, failed or lost run can be resumed" in r.stderr


def test_rm_and_prune_refuse_a_running_run_and_say_what_they_free_and_ids_after_dashes_are_no_options(ct):
    ct.deploy()
    done = ct.launch("--", "--steps", "2")
    assert ct.cli("logs", "ct200", done, "--follow").returncode == 0
    running = ct.launch(*LONG)
    wait_for(lambda: ct.steps_logged(running) >= 1, what="training steps")
    r = ct.cli("launch", "ct200", "--gpu-ids", "2", "--policy", "eager")
    assert r.returncode == 2 and b"--gpu-ids 2: ct200 has GPUs 0..1" in r.stderr
    # a run id after `--` is never an option (this was a test of its own, with a run of its own)
    for args in (("stop", "ct200", "--", "--force"), ("logs", "ct200", "--", "--no-follow"),
                 ("logs", "--", "--no-follow"), ("stop", "ct200", "--", "-9")):
        r = ct.cli(*args)
        err = r.stderr.decode()
        assert r.returncode == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (args, err)
    assert ct.status(running)["state"] == "running"        # the run was not killed
    r = ct.cli("launch", "ct200", "--gpus", "0", "--policy", "eager", "--", b"--x", b"\xff\xfe")
    assert r.returncode == 2 and b"trainer argument 2 is not UTF-8 text" in r.stderr, r.stderr

    r = ct.cli("rm", "ct200", running)
    err = r.stderr.decode()
    assert r.returncode == 1 and f"run {running} is running; not removed" in err, err
    assert ct.status(running)["state"] == "running" and ct.rundir(running).exists()
    r = ct.cli("prune", "ct200", "--keep", "0", "--dry-run")
    assert r.returncode == 0 and f"would remove run {done}".encode() in r.stdout
    assert ct.rundir(done).exists()
    size = sum(f.stat().st_size for f in ct.rundir(done).rglob("*") if f.is_file())
    r = ct.cli("prune", "ct200", "--keep", "0", "--json")
    doc = json.loads(r.stdout)["targets"]["ct200"]
    assert r.returncode == 0 and [x["run"] for x in doc["removed"]] == [done]
    assert doc["freed"] == size > 0 and doc["kept"] == [running]
    assert not ct.rundir(done).exists() and ct.status(running)["state"] == "running"
    r = ct.cli("rm", "ct200", done)
    assert r.returncode == 102 and b"no run" in r.stderr
    r = ct.cli("stop", "ct200", running, "--force")
    assert r.returncode == 0 and b"stopped" in r.stdout
    r = ct.cli("rm", "ct200", running)
    assert r.returncode == 0 and f"removed run {running}".encode() in r.stdout and b"freed " in r.stdout
    assert not ct.rundir(running).exists()
