"""The runs agent on this machine, with a stub trainer: slots and locks, run records, exit
statuses, the follow protocol (the joining of its parts into one program: test_agent.py). Fast and
deterministic; the real trainer over sshd + pct is in test_runs_lifecycle.py."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from runs_agent_stub import SOURCE, _json, agent, ended, launch, state
from trainer_quick import gone, wait_for


def test_the_joined_program_answers_usage_and_unknown_commands(tmp_path):
    usage = subprocess.run([sys.executable, "-c", SOURCE], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2
    assert "usage: runs_agent launch|status|follow|stop|metrics|export|probe|rm|prune" in usage.stderr
    bad = subprocess.run([sys.executable, "-c", SOURCE, "frobnicate", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr
    empty = subprocess.run([sys.executable, "-c", SOURCE, "status", str(tmp_path)],
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode == 0 and json.loads(empty.stdout) == {"runs": [], "missing": []}

def test_launch_returns_at_once_and_records_the_run(wd, tmp_path):
    cfg = tmp_path / "my.yaml"
    # capture_output: if the detached supervisor kept the pipes, this would hang (docs/background.md#pct)
    # (a launch held by the run's pipes would return when the run ends, after 40 s or more): launch
    # returns while the run it started is still running, before its exit.json.
    doc = launch(wd, "r-a", extra=["--steps", "2000", "--sleep", "0.02"], config_text="steps: 3\n",
                 config_name=cfg.name, target="ct200")
    run = wd / "runs" / "r-a"
    assert not (run / "exit.json").exists() and not gone(doc["pid"]), "launch waited for the run to end"
    assert doc["ok"] and doc["pid"] > 0 and doc["slots"] == ["cpu"] and doc["commit"] == "abc1234"
    rec = _json(run / "run.json")
    assert rec["pid"] == doc["pid"] == int((run / "pid").read_text())
    assert rec["release"] == "r1" and rec["commit"] == "abc1234" and rec["compile_policy"] == "eager"
    assert rec["command"][1:3] == ["-m", "trainer"] and "--steps" in rec["command"]
    assert rec["config"]["file"] == str(run / "my.yaml") and (run / "my.yaml").read_text() == "steps: 3\n"
    assert rec["started"].endswith("Z") and rec["gpus"] == 0
    assert state(wd, "r-a")["state"] == "running"
    # its own session and process group: the launching session can go away
    assert os.getsid(doc["pid"]) == doc["pid"] and os.getpgid(doc["pid"]) == doc["pid"]
    # the supervisor: double-forked into a session of its own, and not its leader (no tty ever)
    assert os.getsid(doc["supervisor_pid"]) not in (os.getsid(0), doc["supervisor_pid"])
    wait_for(lambda: b'"step": 3' in (run / "train.log").read_bytes(), what="steps")
    log = (run / "train.log").read_text()
    assert "CUDA_VISIBLE_DEVICES=''" in log and "unbuffered=1" in log and "config=" + str(run / "my.yaml") in log
    assert f"cwd={wd / 'releases' / 'r1'}" in log
    agent("stop", wd, "--force", "--", "r-a")


def test_gpu_slots_choose_free_gpus_and_refuse_when_busy(wd):
    a = launch(wd, "g-a", gpus=1, total=2, extra=["--steps", "2000"])
    b = launch(wd, "g-b", gpus=1, total=2, extra=["--steps", "2000"])
    assert (a["gpu_ids"], b["gpu_ids"]) == ([0], [1])
    refused = launch(wd, "g-c", gpus=1, total=2)
    assert not refused["ok"] and refused["reason"] == "busy"
    assert {h["run"] for h in refused["holders"]} == {"g-a", "g-b"}
    assert not (wd / "runs" / "g-c").exists()
    # a CPU run takes its own slot, not a GPU's
    assert launch(wd, "cpu-1", extra=["--steps", "1"])["ok"]
    too_many = launch(wd, "g-d", gpus=3, total=2)
    assert too_many["reason"] == "too_many_gpus"

    wait_for(lambda: b"CUDA_VISIBLE_DEVICES='1'" in (wd / "runs" / "g-b" / "train.log").read_bytes())
    stop = json.loads(agent("stop", wd, "--", "g-a").stdout)
    assert stop["state"] == "stopped" and stop["signal"] == "SIGTERM"
    assert not (wd / "locks" / "gpu0.json").exists() and (wd / "locks" / "gpu1.json").exists()
    assert launch(wd, "g-e", gpus=2, total=2)["reason"] == "busy"
    assert launch(wd, "g-f", gpus=1, total=2, extra=["--steps", "1"])["gpu_ids"] == [0]
    agent("stop", wd, "--force", "--", "g-b")


def test_a_stale_lock_of_a_killed_run_is_cleared(wd):
    a = launch(wd, "s-a", extra=["--steps", "5000"])
    assert launch(wd, "s-b")["reason"] == "busy"
    os.kill(a["supervisor_pid"], signal.SIGKILL)     # the whole run, supervisor included:
    os.killpg(a["pid"], signal.SIGKILL)              # nobody is left to release the lock
    wait_for(lambda: state(wd, "s-a")["state"] != "running", what="s-a to die")
    st = state(wd, "s-a")
    assert st["state"] == "lost" and st["exit"]["lost"] and not st["exit"]["container_restarted"]
    assert (wd / "locks" / "cpu.json").exists()      # still there: stale
    c = launch(wd, "s-c", extra=["--steps", "1"])
    assert c["ok"] and c["cleared"] == [{"slot": "cpu", "run": "s-a"}]


def test_exit_status_is_recorded_whatever_the_end(wd):
    from trainer.signatures import load_catalog

    launch(wd, "e-ok", extra=["--steps", "3"])
    ended(wd, "e-ok")
    assert _json(wd / "runs" / "e-ok" / "exit.json")["state"] == "succeeded"

    seg = launch(wd, "e-seg", extra=["--steps", "5000"])
    wait_for(lambda: b'"step": 2' in (wd / "runs" / "e-seg" / "train.log").read_bytes())
    os.kill(seg["pid"], signal.SIGSEGV)
    ended(wd, "e-seg")
    ex = _json(wd / "runs" / "e-seg" / "exit.json")
    assert (ex["state"], ex["signal"], ex["signal_name"], ex["returncode"]) == ("failed", 11, "SIGSEGV", 139)
    text = (wd / "runs" / "e-seg" / "train.log").read_text()
    assert [s.id for _, s in load_catalog().scan_text(text)] == ["segfault"]

    launch(wd, "e-bad", extra=["--no-such-flag"])
    ended(wd, "e-bad")
    assert _json(wd / "runs" / "e-bad" / "exit.json")["exit_code"] == 2
    assert state(wd, "e-bad")["state"] == "failed"
    assert not (wd / "locks" / "cpu.json").exists()


def test_stop_waits_for_the_checkpoint_and_force_kills(wd):
    launch(wd, "t-a", extra=["--steps", "5000"])
    wait_for(lambda: b'"step": 2' in (wd / "runs" / "t-a" / "train.log").read_bytes())
    doc = json.loads(agent("stop", wd, "--", "t-a").stdout)
    assert (doc["state"], doc["exit"]["exit_code"], doc["timed_out"]) == ("stopped", 143, False)
    assert (wd / "runs" / "t-a" / "checkpoint").exists()
    again = json.loads(agent("stop", wd, "--", "t-a").stdout)
    assert again["already"] and again["state"] == "stopped"
    launch(wd, "t-b", extra=["--steps", "5000"])
    doc = json.loads(agent("stop", wd, "--force", "--", "latest").stdout)
    assert (doc["run"], doc["state"], doc["exit"]["signal_name"]) == ("t-b", "stopped", "SIGKILL")
    assert json.loads(agent("stop", wd, "--", "nope").stdout)["reason"] == "not_found"


def _follow(wd, run, offset, *flags):
    r = agent("follow", wd, "--offset", offset, *flags, "--", run)
    head, _, body = r.stdout.partition(b"\n")
    controls = [json.loads(x) for x in r.stderr.decode().splitlines()]
    return json.loads(head), body, controls


def test_follow_protocol_offsets_tail_and_end(wd):
    launch(wd, "f-a", extra=["--steps", "30", "--sleep", "0.03"])
    header, body, controls = _follow(wd, "latest", 0)         # follows until the run ends
    log = (wd / "runs" / "f-a" / "train.log").read_bytes()
    assert header["run"] == "f-a" and header["offset"] == 0 and body == log
    end = controls[-1]["end"]
    assert (end["state"], end["step"], end["tau"], end["offset"]) == ("succeeded", 30, 2.5, len(log))

    header, body, _ = _follow(wd, "f-a", 100)                 # resume mid-line: byte exact
    assert header["offset"] == 100 and body == log[100:]
    header, body, _ = _follow(wd, "f-a", -1, "--tail", "3")
    assert body == b"".join(log.splitlines(keepends=True)[-3:])
    header, body, _ = _follow(wd, "f-a", -1, "--tail", "0")
    assert body == b"" and header["offset"] == len(log)

    launch(wd, "f-b", extra=["--steps", "5000"])
    header, body, controls = _follow(wd, "f-b", 0, "--no-follow")
    assert controls[-1]["end"]["state"] == "running"
    header, _, _ = _follow(wd, "missing", 0)
    assert header["reason"] == "not_found"
    agent("stop", wd, "--force", "--", "f-b")


def test_auto_goes_to_the_trainer_as_is_and_status_reads_back_what_it_chose(wd):
    """`auto` is resolved once, by the trainer when it starts (trainer/train/setup.resolve_policy); the
    agent records what was asked, and status shows what the trainer recorded it runs, once it has."""
    (wd / "probe.json").write_text(json.dumps({"policy": "inductor", "processes_policy": "reduce-overhead"}))
    doc = launch(wd, "a-t", compile_policy="auto", extra=["--steps", "2000", "--sleep", "0.02"])
    assert doc["ok"] and doc["compile_policy"] == "auto" and "probe_policy" not in doc
    rec = _json(wd / "runs" / "a-t" / "run.json")
    assert rec["compile_policy"] == "auto" and "policy" not in rec and "probe_policy" not in rec
    assert rec["command"][rec["command"].index("--compile-policy") + 1] == "auto"
    assert state(wd, "a-t")["compile_policy"] == "auto"            # nothing recorded by the trainer yet
    (wd / "runs" / "a-t" / "compile-policy.json").write_text(json.dumps(
        {"compile_policy": "inductor", "asked": "auto", "why": None}))   # as the trainer writes it
    assert state(wd, "a-t")["compile_policy"] == "inductor"
    agent("stop", wd, "--force", "--", "a-t")
    ended(wd, "a-t")


def test_launch_refusals(wd, tmp_path):
    assert launch(wd, "p-a", compile_policy="auto")["reason"] == "no_probe"
    (wd / "probe.json").write_text(json.dumps({"policy": "inductor", "torch": "0"}))
    doc = launch(wd, "p-b", compile_policy="auto", extra=["--steps", "1"])
    assert doc["ok"] and doc["compile_policy"] == "auto"
    rec = _json(wd / "runs" / "p-b" / "run.json")
    assert rec["command"][rec["command"].index("--compile-policy") + 1] == "auto"
    ended(wd, "p-b")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert launch(empty, "n-a")["reason"] == "no_release"
    # a kind whose program takes no rendezvous flags never gets them (runs/kinds.py), nor an unknown kind
    nodes = {"targets": ["a", "b"], "index": 0, "endpoint": "10.0.0.1:29400", "address": "10.0.0.1"}
    prompts = [{"name": "prompts.jsonl", "size": 0, "sha256": hashlib.sha256(b"").hexdigest()}]   # its input
    assert launch(wd, "k-a", kind="regen", nodes=nodes, files=prompts)["reason"] == "one_node"
    assert launch(wd, "k-b", kind="newer")["reason"] == "bad_kind"
    assert not (wd / "runs" / "k-a").exists() and not (wd / "runs" / "k-b").exists()
    # the spec is checked at the door (runs/spec.py): a misspelt key or a wrong type starts nothing
    bad = launch(wd, "s-a", topolgy="processes")
    assert bad["reason"] == "bad_spec" and "topolgy" in bad["message"], bad
    assert launch(wd, "s-b", gpus=True)["reason"] == "bad_spec"
    assert not (wd / "runs" / "s-a").exists() and not (wd / "runs" / "s-b").exists()


# ---- values never options, deaths after the end, no space -------------------------------------

def test_a_run_id_is_never_read_as_an_option(wd):
    launch(wd, "o-a", extra=["--steps", "5000"])
    for word in ("--force", "--no-follow", "-1", "../o-a"):
        doc = json.loads(agent("stop", wd, "--", word).stdout)
        assert {k: doc[k] for k in ("ok", "reason", "run")} == {"ok": False, "reason": "not_found", "run": word}
        header, body, _ = _follow(wd, word, 0, "--no-follow")
        assert header["reason"] == "not_found" and body == b""
    assert state(wd, "o-a")["state"] == "running"          # nothing was killed
    old_style = subprocess.run([sys.executable, "-c", SOURCE, "stop", str(wd), "o-a", "--force"],
                               capture_output=True, text=True, timeout=60)
    assert old_style.returncode == 2 and "unexpected argument 'o-a' (values go after `--`)" in old_style.stderr
    assert state(wd, "o-a")["state"] == "running"
    agent("stop", wd, "--force", "--", "o-a")


def _kill_supervisor(wd, run):
    rec = wait_for(lambda: _json(wd / "runs" / run / "run.json").get("supervisor_pid") and
                   _json(wd / "runs" / run / "run.json"), what="pids")
    os.kill(rec["supervisor_pid"], signal.SIGKILL)
    return rec


def test_a_run_outlives_its_killed_supervisor_and_is_judged_by_its_log(wd):
    rec = _kill_supervisor(wd, launch(wd, "k-a", extra=["--steps", "60", "--sleep", "0.01"])["run"])
    wait_for(lambda: gone(rec["pid"]), what="the trainer to finish")
    st = state(wd, "k-a")
    assert (st["state"], st["step"], st["exit"]["lost"], st["exit"]["exit_code"]) == ("succeeded", 60, False, 0)
    assert "`done` event" in st["exit"]["reason"]

    rec = _kill_supervisor(wd, launch(wd, "k-b", extra=["--steps", "5000"])["run"])
    wait_for(lambda: b'"step": 2' in (wd / "runs" / "k-b" / "train.log").read_bytes())
    os.killpg(rec["pid"], signal.SIGTERM)                # it checkpoints and logs `stopped`
    wait_for(lambda: gone(rec["pid"]), what="the trainer to stop")
    assert state(wd, "k-b")["state"] == "stopped"

    rec = _kill_supervisor(wd, launch(wd, "k-c", extra=["--steps", "5000"])["run"])
    os.killpg(rec["pid"], signal.SIGKILL)                # lost for real
    wait_for(lambda: gone(rec["pid"]), what="the trainer to die")
    first = state(wd, "k-c")
    assert first["state"] == "lost" and first["exit"]["lost"]
    time.sleep(1.2)
    assert state(wd, "k-c")["elapsed_s"] == first["elapsed_s"]   # a lost run's clock stops


def test_status_gives_a_running_runs_pace_and_eta_from_its_last_step_line(wd):
    run = launch(wd, "pace", extra=["--steps", "5000", "--sleep", "0.05"])["run"]
    wait_for(lambda: b'"step": 3' in (wd / "runs" / run / "train.log").read_bytes(), what="steps")
    st = state(wd, run)
    assert st["state"] == "running" and st["steps_per_s"] == 4.0
    assert st["eta_s"] == (5000 - st["step"]) / 4.0          # the step line's own, not another line's
    agent("stop", wd, "--", run)
    ended(wd, run)
    st = state(wd, run)
    assert st["state"] == "stopped" and st["steps_per_s"] is None and st["eta_s"] is None   # only while it runs


def test_unsupervised_is_one_rule_for_status_and_the_slot_locks():
    """A trainer alive whose supervisor is not, by pid and start time in run.json or a lock."""
    from orchestrator.remote.runs.records import proc_start, unsupervised

    me = {"pid": os.getpid(), "pid_start": proc_start(os.getpid())}
    dead = {"supervisor_pid": os.getpid(), "supervisor_start": -1}     # a recycled pid: not the supervisor
    assert unsupervised(me) and unsupervised(dead, me) and unsupervised({}, me)
    alive = {"supervisor_pid": os.getpid(), "supervisor_start": proc_start(os.getpid())}
    assert not unsupervised(dict(me, **alive)) and not unsupervised(me, alive) and not unsupervised({}, dead)


def test_a_run_whose_supervisor_cannot_start_is_failed_at_once(wd):
    doc = launch(wd, "u-a", extra=["--x", "\udcff"])      # not UTF-8: the supervisor's log line fails
    assert not doc["ok"] and doc["reason"] == "spawn"
    st = state(wd, "u-a")
    assert st["state"] == "failed" and "supervisor" in st["exit"]["error"]
    assert not (wd / "locks" / "cpu.json").exists()


def test_launch_on_a_full_disk_leaves_nothing_behind(wd):
    runs = wd / "runs"
    runs.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(runs)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        doc = launch(wd, "d-a", extra=["--steps", "1"])
        assert not doc["ok"] and doc["reason"] == "no_space"
        assert doc["message"] == f"{runs} has 2.1 MB free; a run needs at least 64 MB there for its log and checkpoints"
        assert os.listdir(runs) == []
    finally:
        subprocess.run(["umount", "-l", str(runs)], check=False)


# ---- names, chosen GPUs, resume in place, rm and prune ----------------------------------------

def test_gpu_ids_take_exactly_those_slots_and_a_name_is_shown(wd):
    doc = launch(wd, "g-a", gpus=0, total=4, gpu_ids=[0, 3], name="first try",
                 extra=["--steps", "5000"])
    assert doc["ok"] and doc["gpu_ids"] == [0, 3] and doc["slots"] == ["gpu0", "gpu3"] and doc["gpus"] == 2
    log = wd / "runs" / "g-a" / "train.log"
    assert "CUDA_VISIBLE_DEVICES='0,3'" in wait_for(lambda: "[stub]" in log.read_text() and log.read_text())
    st = state(wd, "g-a")
    assert st["name"] == "first try" and st["attempt"] == 1
    busy = launch(wd, "g-b", total=4, gpu_ids=[3])
    assert busy["reason"] == "busy" and sorted(busy["busy"]) == ["gpu3"]
    free = launch(wd, "g-c", total=4, gpu_ids=[1], extra=["--steps", "1"])
    assert free["ok"] and free["slots"] == ["gpu1"]
    bad = launch(wd, "g-d", total=4, gpu_ids=[4])
    assert bad["reason"] == "bad_gpu_ids" and "0..3" in bad["message"]
    agent("stop", wd, "--force", "--", "g-a")
    ended(wd, "g-c")


def test_resume_continues_a_stopped_run_in_place_as_a_new_attempt(wd):
    launch(wd, "z-a", name="long", extra=["--steps", "60", "--sleep", "0.02"])
    wait_for(lambda: b'"step": 5' in (wd / "runs" / "z-a" / "train.log").read_bytes())
    refused = launch(wd, "ignored", resume="z-a")
    assert refused["reason"] == "not_resumable" and refused["state"] == "running"
    agent("stop", wd, "--", "z-a")
    stopped_at = int((wd / "runs" / "z-a" / "checkpoint").read_text())
    doc = launch(wd, "ignored", resume="z-a")
    assert doc["ok"] and doc["run"] == "z-a" and doc["attempt"] == 2 and doc["resumed_from"] == "stopped"
    assert not (wd / "runs" / "ignored").exists()
    ended(wd, "z-a")
    rec = _json(wd / "runs" / "z-a" / "run.json")
    assert rec["command"][-3:] == ["--resume", "--steps", "60"] or "--resume" in rec["command"]
    assert rec["name"] == "long" and rec["attempt"] == 2
    assert [a["state"] for a in rec["attempts"]] == ["stopped"]
    log = (wd / "runs" / "z-a" / "train.log").read_text()
    assert '"event": "resume", "step": %d' % (stopped_at - 1) in log      # one log, appended
    st = state(wd, "z-a")
    assert (st["state"], st["step"], st["attempt"]) == ("succeeded", 60, 2)
    again = launch(wd, "ignored", resume="z-a")
    assert again["reason"] == "not_resumable" and again["state"] == "succeeded"
    assert launch(wd, "x", resume="nope")["reason"] == "not_found"


def test_rm_and_prune_never_touch_a_running_run_and_say_what_they_free(wd):
    for run in ("h-a", "h-b", "h-c"):
        launch(wd, run, extra=["--steps", "1"])
        ended(wd, run)
        time.sleep(0.02)       # distinct start times: prune keeps the newest
    launch(wd, "h-d", extra=["--steps", "5000"])
    size = sum(f.stat().st_size for f in (wd / "runs" / "h-a").rglob("*") if f.is_file())
    doc = json.loads(agent("rm", wd, "--dry-run", "--", "h-a").stdout)
    assert doc["removed"] == [{"run": "h-a", "state": "succeeded", "name": None, "bytes": size}]
    assert (wd / "runs" / "h-a").exists()
    doc = json.loads(agent("rm", wd, "--", "h-a", "h-d", "nope", "--force").stdout)
    assert [r["run"] for r in doc["removed"]] == ["h-a"] and doc["freed"] == size
    assert doc["refused"] == [{"run": "h-d", "state": "running", "name": None}]
    assert doc["missing"] == ["nope", "--force"]
    assert not (wd / "runs" / "h-a").exists() and state(wd, "h-d")["state"] == "running"
    doc = json.loads(agent("prune", wd, "--keep", "0").stdout)
    assert sorted(r["run"] for r in doc["removed"]) == ["h-b", "h-c"] and doc["kept"] == ["h-d"]
    assert doc["freed"] > 0 and state(wd, "h-d")["state"] == "running"
    assert [p.name for p in (wd / "runs").iterdir()] == ["h-d"]
    agent("stop", wd, "--force", "--", "h-d")


def test_a_pid_recorded_under_another_boot_is_never_the_runs(tmp_path):
    """A run's processes are named by pid, start time and boot (the kernel's boot id and PID 1's start):
    a live process with the recorded pid and start time is still not the run's when the record was made
    under another boot (a container restarted: its PIDs count from 1 again). The run is then `lost`,
    said as ended with its container; its slot lock is stale. tests/test_real_containers.py shows it on a
    restarted container."""
    from orchestrator.remote.runs import locks
    from orchestrator.remote.runs import records as common

    me, start = os.getpid(), common.proc_start(os.getpid())
    assert common.boot().count("/") == 1 and common.boot().split("/")[0]
    assert common.proc_alive(me, start, common.boot()) and common.proc_alive(me, start)
    assert not common.proc_alive(me, start, "another-boot/1")
    wd = tmp_path / "wd"
    rundir = wd / "runs" / "r"
    rundir.mkdir(parents=True)
    rec = {"run": "r", "pid": me, "pid_start": start, "supervisor_pid": me, "supervisor_start": start,
           "started_ts": 1, "boot": common.boot()}
    (rundir / "run.json").write_text(json.dumps(rec))
    (rundir / common.LOG).write_bytes(b'{"step": 3, "loss": 1.5}\n')
    assert common.run_state(str(rundir))[0] == "running"
    (rundir / "run.json").write_text(json.dumps(dict(rec, boot="another-boot/1")))
    state, ex = common.run_state(str(rundir))
    assert (state, ex["lost"], ex["container_restarted"]) == ("lost", True, True), ex
    assert ex["reason"].startswith("ended with its container"), ex
    (wd / "locks").mkdir()
    lock = {"run": "r", "slot": "cpu", "launcher_pid": me, "launcher_start": start, "pid": me, "pid_start": start,
            "boot": "another-boot/1"}
    (wd / "locks" / "cpu.json").write_text(json.dumps(lock))
    with locks.Guard(str(wd)) as guard:
        slots, _, busy, cleared = locks.claim(str(wd), guard, 0, 0)
    assert (slots, busy, cleared) == (["cpu"], {}, [{"slot": "cpu", "run": "r"}])


def test_a_run_that_filled_the_disk_is_named_disk_full_not_killed(tmp_path, monkeypatch):
    """Every process of the run gone, no exit.json (the supervisor could not write it either): a log
    that says ENOSPC, or a full filesystem under the run's folder, names the cause."""
    from orchestrator.remote.runs import records as common

    dead = subprocess.Popen(["true"])
    dead.wait()
    rundir = tmp_path / "r"
    rundir.mkdir()
    (rundir / "run.json").write_text(json.dumps({"pid": dead.pid, "pid_start": 1, "started_ts": 1}))
    log = rundir / common.LOG
    log.write_bytes(b'{"event": "start"}\nregen: 4/8 rows\n')
    state, ex = common.run_state(str(rundir))
    assert (state, ex["lost"], ex["disk_full"]) == ("lost", True, False) and "killed with SIGKILL" in ex["reason"]
    with log.open("ab") as f:
        f.write(b"OSError: [Errno 28] No space left on device\n")
    state, ex = common.run_state(str(rundir))
    assert (state, ex["lost"], ex["disk_full"]) == ("failed", True, True)
    assert ex["reason"].startswith("disk full: its log says No space left on device")
    assert "launch --resume" in ex["reason"]
    log.write_bytes(b"regen: 4/8 rows\n")
    monkeypatch.setattr(common.os, "statvfs", lambda p: os.statvfs_result((4096,) * 2 + (0,) * 8))
    assert common.run_state(str(rundir))[1]["reason"].startswith("disk full: the filesystem of its folder is full")


# ---- a target's own files, bounded ----------------------------------------------------------------

BAD_RECORDS = {     # run folder -> (file, its bytes, what status says of it)
    "b-deep": ("run.json", b"[" * 100_000 + b"]" * 100_000, "run.json: nested more than 32 levels deep"),
    "b-list": ("run.json", b"[]", "run.json: a JSON list, not an object"),
    "b-cut": ("run.json", b'{"run": "b-cut", "started_ts": 1', "run.json: not JSON (Expecting"),
    "b-type": ("run.json", b'{"gpus": "two", "started_ts": 1}', "run.json: gpus: expected an integer, got a string"),
    "b-nodes": ("run.json", b'{"nodes": {"targets": [{}]}}', "run.json: nodes.targets: expected a list of a string"),
    "b-big": ("run.json", b'{"x": "' + b"a" * (1 << 20) + b'"}', "run.json: larger than 1 MB"),
    "b-utf8": ("run.json", b'{"x": "\xff"}', "run.json: not UTF-8 text"),
    "b-exit": ("exit.json", b'{"state": "failed", "exit_code": "x"}', "exit.json: exit_code: expected an integer"),
    "b-state": ("exit.json", b'{"state": 5}', "exit.json: state: expected a string, got a number"),
    "b-word": ("exit.json", b'{"state": "running"}', "exit.json: state: expected one of succeeded, failed, stopped"),
    "b-fifo": ("exit.json", None, "exit.json: not a regular file"),
}


def _bad_runs(wd):
    for run, (name, data, _) in BAD_RECORDS.items():
        folder = wd / "runs" / run
        folder.mkdir(parents=True)
        (folder / "train.log").write_text("a line of the log\n")
        if name == "exit.json":
            (folder / "run.json").write_text(json.dumps({"run": run, "started_ts": 1.0}))
        if data is None:
            os.mkfifo(folder / name)
        else:
            (folder / name).write_bytes(data)


def test_a_bad_state_file_makes_its_run_unreadable_and_every_other_run_works(wd):
    """run.json / exit.json that are 100,000 levels deep, a list, cut short, of other types, too big,
    not UTF-8 or a FIFO: that run is listed `unreadable` with the reason (never dropped, never a
    traceback), every other run reads as before, prune keeps it and names it, rm removes it."""
    launch(wd, "g-a", extra=["--steps", "1"])
    ended(wd, "g-a")
    _bad_runs(wd)
    doc = json.loads(agent("status", wd).stdout)    # agent's timeout: a read of the FIFO would never end
    rows = {r["run"]: r for r in doc["runs"]}
    assert set(rows) == {"g-a", *BAD_RECORDS} and rows["g-a"]["state"] == "succeeded"
    for run, (_, _, reason) in BAD_RECORDS.items():
        assert rows[run]["state"] == "unreadable" and rows[run]["reason"].startswith(reason), (run, rows[run])
        assert rows[run]["log_bytes"] == len("a line of the log\n")
    # the one run named: status, follow (its log, then the reason), stop (nothing to stop)
    assert state(wd, "b-deep")["state"] == "unreadable"
    r = agent("follow", wd, "--offset", "0", "--no-follow", "--", "b-list")
    assert r.stdout.splitlines()[1:] == [b"a line of the log"]
    end = json.loads(r.stderr.decode().splitlines()[-1])["end"]
    assert end["state"] == "unreadable" and end["reason"] == "run.json: a JSON list, not an object"
    stop = json.loads(agent("stop", wd, "--", "b-cut").stdout)
    assert stop["already"] and stop["state"] == "unreadable"
    resumed = launch(wd, "x", resume="b-type")
    assert resumed["reason"] == "not_resumable" and "b-type is unreadable" in resumed["message"]
    # prune cannot tell whether they ended: kept, named
    doc = json.loads(agent("prune", wd, "--keep", "0", "--dry-run").stdout)
    assert [r["run"] for r in doc["removed"]] == ["g-a"]
    assert {u["run"] for u in doc["unreadable"]} == set(BAD_RECORDS) and set(BAD_RECORDS) <= set(doc["kept"])
    # rm removes each, the dry run first
    doc = json.loads(agent("rm", wd, "--dry-run", "--", "b-deep").stdout)
    assert [(r["run"], r["state"]) for r in doc["removed"]] == [("b-deep", "unreadable")]
    assert (wd / "runs" / "b-deep").exists()
    doc = json.loads(agent("rm", wd, "--", *BAD_RECORDS).stdout)
    assert sorted(r["run"] for r in doc["removed"]) == sorted(BAD_RECORDS) and not doc["missing"]
    assert doc["removed"][0]["reason"] and sorted(p.name for p in (wd / "runs").iterdir()) == ["g-a"]


def test_an_unreadable_run_whose_slot_a_live_process_holds_is_not_removed(wd):
    """A run whose records cannot be read is judged by its slot locks: one held by a live process
    is running, refused by rm like any running run."""
    launch(wd, "l-a", extra=["--steps", "5000"])
    (wd / "runs" / "l-a" / "run.json").write_bytes(b"[]")
    assert state(wd, "l-a")["state"] == "unreadable"
    doc = json.loads(agent("rm", wd, "--", "l-a").stdout)
    assert doc["removed"] == [] and doc["refused"] == [{"run": "l-a", "state": "running", "name": None}]
    lock = json.loads((wd / "locks" / "cpu.json").read_text())
    os.kill(lock["pid"], signal.SIGKILL)
    wait_for(lambda: gone(lock["pid"]), 10, "the trainer to die")
    os.kill(lock["supervisor_pid"], signal.SIGKILL)
    wait_for(lambda: gone(lock["supervisor_pid"]), 10, "the supervisor to die")
    doc = json.loads(agent("rm", wd, "--", "l-a").stdout)
    assert [r["run"] for r in doc["removed"]] == ["l-a"]


def test_state_files_are_read_in_one_place_with_bounds():
    """remote/common.load_json: a regular file, at most 1 MB of UTF-8, nested at most 32 deep (checked
    before parsing: 100,000 levels are refused, not a RecursionError), one JSON object; typed checks
    each field a reader uses; read_json is the lenient reading (None)."""
    from orchestrator.remote import agent_base as common

    ok = {"a": [[[1]]], "s": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}
    assert common.parse_json(json.dumps(ok)) == ok
    assert common.parse_json('{"a": ' + "[" * 31 + "]" * 31 + "}") == {"a": eval("[" * 31 + "]" * 31)}
    for text, why in (("[" * 32 + "]" * 32, "a JSON list"), ("[" * 33 + "]" * 33, "nested more than 32"),
                      ("{" + '"a":{' * 40 + "}" * 41, "nested more than 32"), ("[" * 100_000, "nested more than 32"),
                      ("", "not JSON"), ("5", "a JSON number"), ('"x"', "a JSON string"), ("null", "a JSON null")):
        with pytest.raises(common.BadRecord, match=why):
            common.parse_json(text)
    assert common.typed({"pid": True}, {"pid": (int,)}) == "pid: expected an integer, got a boolean"
    assert common.typed({"t": 1}, {"t": common.NUMBER}) is None and common.typed({"t": None}, {"t": (int,)}) is None
    assert common.typed({"n": {"k": [1, "x"]}}, {"n": {"k": [(int,)]}}) == "n.k: expected a list of an integer"
    # a log line is read with the same bounds: a deep one is no metric, never a RecursionError in `status`
    from orchestrator.remote.runs import records as runs_common

    deep = b'{"step": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert runs_common.metric(deep) is None
    assert runs_common.metric(b'{"step": 3, "loss": 0.5}') == {"step": 3, "loss": 0.5}
