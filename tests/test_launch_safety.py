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
    assert again.returncode == 0, again.stderr.decode()     # fakepct's teardown stops CT 200: its run with it


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
    assert ok.returncode == 0, ok.stderr.decode()     # fakepct's teardown stops CT 200: its run with it


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


def test_a_bad_state_file_on_the_target_breaks_only_its_run(inv_path, fakepct):
    """run.json 100,000 levels deep, a JSON list, cut short; exit.json with wrong types: through the
    CLI over the real sshd and pct stand-in, status lists each as unreadable with the reason (exit 0,
    one note each), every other run reads as before, `logs` of a bad one shows its log and the reason
    (exit 1, no internal error), prune keeps and names them, rm removes them (dry run first)."""
    runs = fakepct.private(200) / "dflash" / "runs"
    good, deep, listed, cut, typed = "20250101-000000-aaaaa1", "b-deep", "b-list", "b-cut", "b-exit"
    for run in (good, deep, listed, cut, typed):
        (runs / run).mkdir(parents=True)
        (runs / run / "train.log").write_text(f"the log of {run}\n")
    (runs / good / "run.json").write_text(json.dumps({"run": good, "started_ts": 1.0, "started": "then"}))
    (runs / good / "exit.json").write_text(json.dumps({"state": "succeeded", "exit_code": 0, "ended_ts": 2.0}))
    (runs / deep / "run.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    (runs / listed / "run.json").write_bytes(b"[]")
    (runs / cut / "run.json").write_bytes(b'{"run": "b-cut", "started_ts": 1')
    (runs / typed / "run.json").write_text(json.dumps({"run": typed, "started_ts": 3.0}))
    (runs / typed / "exit.json").write_text(json.dumps({"state": "failed", "exit_code": "7", "signal_name": 9}))
    bad = {deep: "run.json: nested more than 32 levels deep", listed: "run.json: a JSON list, not an object",
           cut: "run.json: not JSON (", typed: "exit.json: exit_code: expected an integer, got a string"}

    r = cli(inv_path, "status", "ct200")
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 0, err
    assert all(run in out for run in (good, *bad)) and "succeeded" in out and out.count("unreadable") == 4, out
    for run, why in bad.items():
        assert f"ct200: run {run} is unreadable: {why}" in err and f"`dflash-ops rm ct200 {run}` removes it" in err
    assert "internal error" not in err and "Traceback" not in err
    rows = {row["run"]: row for row in json.loads(cli(inv_path, "status", "ct200", "--json").stdout)["runs"]}
    assert rows[good]["state"] == "succeeded" and all(rows[run]["state"] == "unreadable" for run in bad)

    r = cli(inv_path, "logs", "ct200", good)
    assert r.returncode == 0 and r.stdout.decode() == f"the log of {good}\n", r.stderr.decode()
    for run, why in bad.items():
        r = cli(inv_path, "logs", "ct200", run)
        err = r.stderr.decode()
        assert r.returncode == 1 and r.stdout.decode() == f"the log of {run}\n", err
        assert f"run {run}: unreadable ({why}" in err and "internal error" not in err, err

    r = cli(inv_path, "prune", "ct200", "--keep", "0", "--dry-run")
    out = r.stdout.decode()
    assert r.returncode == 0 and f"would remove run {good}" in out, r.stderr.decode()
    assert all(f"kept run {run}, unreadable ({why}" in out for run, why in bad.items()), out
    r = cli(inv_path, "rm", "ct200", deep, "--dry-run")
    assert r.returncode == 0 and f"would remove run {deep} (unreadable: {bad[deep]}" in r.stdout.decode()
    assert (runs / deep).exists()
    r = cli(inv_path, "rm", "ct200", *bad)
    assert r.returncode == 0 and r.stdout.decode().count("removed run") == 4, r.stderr.decode()
    assert sorted(p.name for p in runs.iterdir()) == [good]
    assert cli(inv_path, "status", "ct200").returncode == 0
