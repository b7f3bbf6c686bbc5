"""The runs agent's launch sequence killed at each of its points, and a node of several naming its
training interface: with the stub trainer of runs_agent_stub.py."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from runs_agent_stub import SOURCE, _json, agent, ended, launch, state
from trainer_quick import gone, wait_for


# ---- the launch sequence, killed at each of its points ------------------------------------------

# Where a SIGKILL leaves nothing running (the slot free), a supervised run, or (the supervisor killed
# after the trainer started) a run that runs on unsupervised, its slot still taken.
LAUNCH_POINTS = {"launch.claimed": "none", "launch.recorded": "none", "launch.spawned": "none",
                 "launch.hello": "none", "launch.recorded_supervisor": "none", "launch.go": "supervised",
                 "launch.started": "supervised", "launch.held": "supervised", "supervisor.go": "none",
                 "supervisor.forked": "none", "supervisor.recorded": "none", "supervisor.started": "unsupervised"}


def _procs_of(run):
    """{pid: argv} of the processes started for `run` (the trainer's environment names it)."""
    found = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            env = (p / "environ").read_bytes().split(b"\0")
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"DFLASH_OPS_RUN={run}".encode() in env and argv[0] and not gone(int(p.name)):
            found[int(p.name)] = [a.decode() for a in argv if a]
    return found


def _trainers(run):
    return [pid for pid, argv in _procs_of(run).items() if argv[1:3] == ["-m", "trainer"]]


@pytest.mark.parametrize("point", list(LAUNCH_POINTS))
def test_a_launch_killed_at_any_point_leaves_a_free_slot_or_a_recorded_run(wd, point):
    run = "x-" + point.replace(".", "-").replace("_", "-")
    doc = {"run": run, "gpus": 0, "target_gpus": 0, "compile_policy": "eager", "extra": ["--steps", "50000"]}
    env = {**os.environ, "DFLASH_OPS_AGENT_FAULTS": f"kill_at={point}"}
    r = subprocess.run([sys.executable, "-c", SOURCE, "launch", str(wd)], input=json.dumps(doc).encode(),
                       capture_output=True, timeout=60, env=env)
    if point.startswith("launch."):
        assert r.returncode == -signal.SIGKILL, r.stderr.decode()
    # settled: either a trainer runs, or nothing of the run is left (a gated fork has exited)
    wait_for(lambda: _trainers(run) or not _procs_of(run), 20, "the launch to settle")
    outcome = LAUNCH_POINTS[point]
    trainers = _trainers(run)
    second = launch(wd, "y-" + run[2:], extra=["--steps", "1"])
    if outcome == "none":
        assert trainers == [] and second["ok"], second          # the slot is free, nothing runs
        ended(wd, second["run"])
        if point.startswith("launch."):     # the record is written before launch.recorded, and stays
            assert (wd / "runs" / run / "run.json").exists() == (point != "launch.claimed"), point
        if (wd / "runs" / run / "run.json").exists():
            st = state(wd, run)
            assert st["state"] == "failed" and not st.get("unsupervised"), st
        if point.startswith("supervisor."):
            reply = json.loads(r.stdout.decode().splitlines()[-1])
            assert reply["reason"] == "spawn"
        return
    # a trainer runs: recorded, its slot taken, a second launch refused naming it
    assert len(trainers) == 1 and _json(wd / "runs" / run / "run.json")["pid"] == trainers[0]
    st = state(wd, run)
    assert st["state"] == "running" and st["pid"] == trainers[0]
    assert second["reason"] == "busy" and second["holders"][0]["run"] == run, second
    assert st.get("unsupervised", False) == (outcome == "unsupervised")
    assert second["holders"][0]["unsupervised"] == (outcome == "unsupervised")
    if outcome == "unsupervised":
        reply = json.loads(r.stdout.decode().splitlines()[-1])
        assert reply["ok"] and reply["unsupervised"] and reply["pid"] == trainers[0]
    stopped = json.loads(agent("stop", wd, "--force", "--", run).stdout)
    assert stopped["state"] == "stopped"
    assert launch(wd, "z-" + run[2:], extra=["--steps", "1"])["ok"]     # the slot is free again
    ended(wd, "z-" + run[2:])


def test_a_node_of_several_names_its_training_interface_or_is_refused(wd):
    from orchestrator.remote.runs.net import _addresses

    out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    mine = [(n, a) for n, a in _addresses(out) if not a.is_loopback and a.version == 4]
    if not mine:
        pytest.skip("no non-loopback IPv4 address here")
    iface, address = mine[0]

    def node(run, addr, **env):
        return launch(wd, run, env=env,
                      nodes={"targets": ["a", "b"], "index": 1, "endpoint": f"{addr}:29400", "address": addr})

    doc = node("n-a", str(address))
    assert doc["ok"], doc
    assert _json(wd / "runs" / "n-a" / "run.json")["env"]["GLOO_SOCKET_IFNAME"] == iface
    assert _json(wd / "runs" / "n-a" / "run.json")["env"]["NCCL_SOCKET_IFNAME"] == "=" + iface
    ended(wd, "n-a")
    node("n-b", str(address), NCCL_SOCKET_IFNAME="ib0")
    assert _json(wd / "runs" / "n-b" / "run.json")["env"]["NCCL_SOCKET_IFNAME"] == "ib0"
    ended(wd, "n-b")
    refused = node("n-c", "127.0.0.1")
    assert refused["reason"] == "network" and "127.0.0.1 is a loopback address" in refused["message"]
    refused = node("n-d", str(address), GLOO_SOCKET_IFNAME="lo")
    assert refused["reason"] == "network" and "GLOO_SOCKET_IFNAME=lo names a loopback" in refused["message"]
    assert sorted(p.name for p in (wd / "runs").iterdir()) == ["n-a", "n-b"]     # nothing of a refused one
    assert not list((wd / "locks").glob("*.json"))


def test_an_upload_killed_midway_starts_nothing_and_the_next_launch_sweeps_what_it_left(wd):
    """A regen's prompts travel with its launch into runs/.upload-RUN-PID; the agent SIGKILLed while it
    reads them (or its container stopped) never reaches its `finally`: no run, and the next launch
    removes the dead agent's folder (a live one's stays: its pid runs)."""
    import hashlib

    from orchestrator.remote.runs.kinds import REGEN_PROMPTS

    prompts = b'{"prompt": "one"}\n{"prompt": "two"}\n'
    doc = {"run": "u-1", "kind": "regen", "gpus": 0, "target_gpus": 0, "compile_policy": "eager", "extra": [],
           "files": [{"name": REGEN_PROMPTS, "size": len(prompts), "sha256": hashlib.sha256(prompts).hexdigest()}]}
    r = subprocess.run([sys.executable, "-c", SOURCE, "launch", str(wd)],
                       input=json.dumps(doc).encode() + b"\n" + prompts, capture_output=True, timeout=60,
                       env={**os.environ, "DFLASH_OPS_AGENT_FAULTS": "kill_at=upload.receiving"})
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()
    runs = wd / "runs"
    (left,) = [p for p in runs.iterdir() if p.name.startswith(".upload-")]
    assert left.name.startswith(".upload-u-1-") and not (runs / "u-1").exists() and _procs_of("u-1") == {}
    live = runs / f".upload-u-9-{os.getpid()}"
    live.mkdir()
    assert launch(wd, "t-2", extra=["--steps", "1"])["ok"]
    assert sorted(p.name for p in runs.iterdir() if p.name.startswith(".")) == [live.name]
    ended(wd, "t-2")
