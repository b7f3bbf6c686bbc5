"""A launch whose runs agent is killed on the target, through a real sshd into the pct stand-in,
driven by the `dflash-ops` CLI as a user would: the controller says what the target holds (the run
runs, or nothing was started and the slot is free), never only the agent's exit status. The agent
is killed at a named point of the launch sequence (DFLASH_OPS_AGENT_FAULTS, reaching it through
`launch --env`); every point on the target itself is in test_runs_agent.py."""
import json
import subprocess
import sys

import pytest

from trainer_quick import CLI_MAIN

from orchestrator import inventory
from orchestrator.deploy import sync as deploy

WORKDIR = "/srv/ct/dflash"
# A stand-in trainer that trains until it is stopped.
STUB = "import json, time\nfor i in range(1, 10**6):\n    print(json.dumps({'step': i}), flush=True); time.sleep(.05)\n"


def cli(path, *args):
    """`dflash-ops -i PATH ARGS...`"""
    return subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", str(path), *map(str, args)], capture_output=True,
                          timeout=120)


@pytest.fixture
def inv_path(sshd, fakepct, make_inventory, tmp_path):
    fakepct.create(200)
    path = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable, "workdir": WORKDIR}})
    src = tmp_path / "src"
    (src / "trainer").mkdir(parents=True)
    (src / "trainer" / "__init__.py").write_text("")
    (src / "trainer" / "__main__.py").write_text(STUB)
    assert deploy.deploy(inventory.load(str(path)), ["ct200"], source=str(src))["ct200"].ok
    return path


def launch(path, point=None):
    fault = ["--env", f"DFLASH_OPS_AGENT_FAULTS=kill_at={point}"] if point else []
    return cli(path, "launch", "ct200", "--gpus", "0", "--policy", "eager", *fault)


def status_row(path, run):
    r = cli(path, "status", "ct200", "--json")
    return next(row for row in json.loads(r.stdout)["runs"] if row["run"] == run)


def test_an_agent_killed_after_the_run_started_is_a_launch_that_ran(inv_path):
    r = launch(inv_path, "launch.go")
    err = r.stderr.decode()
    assert r.returncode == 0, err
    run = r.stdout.decode().strip()
    assert "exited" not in err and "its launch was cut off" in err and f"launched run {run}" in err
    assert status_row(inv_path, run)["state"] == "running"
    busy = launch(inv_path)
    assert busy.returncode == 1 and f"in use by run {run}" in busy.stderr.decode()
    assert cli(inv_path, "stop", "ct200", run, "--force").returncode == 0
    again = launch(inv_path)
    assert again.returncode == 0, again.stderr.decode()
    cli(inv_path, "stop", "ct200", again.stdout.decode().strip(), "--force")


def test_an_agent_killed_before_the_run_started_says_nothing_runs(inv_path):
    r = launch(inv_path, "launch.recorded")
    err = r.stderr.decode().strip()
    assert r.returncode == 1 and len(err.splitlines()) == 1, err
    assert "the launch was cut off" in err and "did not start; its slots are free" in err
    run = err.split("run ")[-1].split(" ")[0]
    row = status_row(inv_path, run)
    assert row["state"] == "failed" and row["exit"]["started"] is False
    assert "failed (never started)" in cli(inv_path, "status", "ct200").stdout.decode()
    ok = launch(inv_path)
    assert ok.returncode == 0, ok.stderr.decode()
    cli(inv_path, "stop", "ct200", ok.stdout.decode().strip(), "--force")


def test_a_trainer_without_its_supervisor_is_shown_and_keeps_its_slot(inv_path):
    r = launch(inv_path, "supervisor.started")
    assert r.returncode == 0, r.stderr.decode()
    run = r.stdout.decode().strip()
    assert "no supervisor: its slots stay taken until it ends" in r.stderr.decode()
    assert status_row(inv_path, run)["unsupervised"] is True
    assert "running (no supervisor)" in cli(inv_path, "status", "ct200").stdout.decode()
    busy = launch(inv_path)
    assert busy.returncode == 1 and "no supervisor: it holds them until it ends" in busy.stderr.decode()
    stopped = cli(inv_path, "stop", "ct200", run, "--force")
    assert stopped.returncode == 0, stopped.stderr.decode()
    assert status_row(inv_path, run)["state"] == "stopped"


def test_stop_of_an_unknown_run_is_1_as_readme_says(inv_path):
    r = cli(inv_path, "stop", "ct200")
    assert r.returncode == 1 and b"no runs yet" in r.stderr
    r = cli(inv_path, "stop", "ct200", "20990101-000000-abcdef")
    assert r.returncode == 1 and len(r.stderr.decode().strip().splitlines()) == 1
    assert "no run '20990101-000000-abcdef'" in r.stderr.decode()


def test_follow_counts_outages_not_reconnect_attempts(inv_path, sshd, make_inventory):
    """Two outages of the sshd (its listener stopped, the connection cut), each lasting several
    failed reconnect attempts: the summary says 2 outages and how many attempts they took."""
    import os
    import signal
    import threading

    from orchestrator.runs import follow as follow_mod
    from trainer_quick import wait_for

    r = launch(inv_path)
    assert r.returncode == 0, r.stderr.decode()
    run = r.stdout.decode().strip()
    quick = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable, "workdir": WORKDIR}},
                           hosts={"node": {"connect_timeout": 1}})
    inv = inventory.load(str(quick))
    events: list = []

    def consume():
        for ev in follow_mod.follow(inv, inv.target("ct200"), run, backoff=(0.1,), give_up_s=120):
            events.append(ev)
    threading.Thread(target=consume, daemon=True).start()

    def count(kind):
        return sum(isinstance(e, kind) for e in events)
    try:
        for outage in range(2):
            seen = count(follow_mod.Line)
            wait_for(lambda: count(follow_mod.Line) > seen + 3, what="lines over a working connection")
            os.kill(sshd.listener_pid, signal.SIGSTOP)       # no new connection gets its greeting
            sshd.kill_connections()
            tried = count(follow_mod.Reconnecting)
            wait_for(lambda: count(follow_mod.Reconnecting) >= tried + 3, 60, "failed reconnect attempts")
            os.kill(sshd.listener_pid, signal.SIGCONT)
            wait_for(lambda: count(follow_mod.Resumed) == outage + 1, 60, "the stream to resume")
    finally:
        os.kill(sshd.listener_pid, signal.SIGCONT)
    assert cli(inv_path, "stop", "ct200", run, "--force").returncode == 0
    wait_for(lambda: events and isinstance(events[-1], follow_mod.End), 60, "the follow to end")
    summary = events[-1].summary
    assert summary.outages == 2 and summary.reconnects == count(follow_mod.Reconnecting) >= 6, summary
