"""`logs` over a job's nodes: one fan-in for one node or several, which always ends."""
from __future__ import annotations

import threading
import time

import pytest

from orchestrator import cli, inventory
from orchestrator.runs import follow as follow_mod, nodes

HOSTS = """
default: ct200
hosts: {pve1: {address: pve1.invalid}}
targets:
  ct200: {host: pve1, vmid: 200, gpus: 0}
  ct300: {host: pve1, vmid: 300, gpus: 0}
"""
INV = inventory.parse(HOSTS)


@pytest.fixture
def two_nodes(monkeypatch):
    """A job on ct200 and ct300 whose ct200 follower streams until told to stop and whose ct300
    follower hits a bug (KeyError); no connection is made."""
    stop = threading.Event()
    monkeypatch.setattr(nodes, "run_nodes", lambda inv, target, run, s: (
        "R", [(INV.targets["ct200"], {}), (INV.targets["ct300"], {})]))

    def fake_follow(inv, t, run, **kw):
        if t.name == "ct300":
            time.sleep(0.2)
            raise KeyError("boom")
        yield follow_mod.Line(b"step 1\n", 1)
        stop.wait(60)       # a run that goes on: this follower has not ended
        yield follow_mod.End(follow_mod.Summary(t.name, run, "running", 101))

    monkeypatch.setattr(follow_mod, "follow", fake_follow)
    yield
    stop.set()


def _within(seconds, fn):
    """fn()'s exception (or None), failing the test if fn has not returned after `seconds`."""
    out: list = []

    def run():
        try:
            fn()
            out.append(None)
        except BaseException as e:   # noqa: BLE001
            out.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    assert out, f"still blocked after {seconds} s"
    return out[0]


def test_a_follower_that_raises_ends_the_follow_at_once(two_nodes):
    seen = []
    err = _within(10, lambda: seen.extend(nodes.follow(INV, INV.targets["ct200"], "R", session=object())))
    assert isinstance(err, KeyError) and "boom" in str(err)
    assert isinstance(seen[0], nodes.Job) and seen[0].targets == ["ct200", "ct300"]


def test_logs_names_the_error_of_a_follower_that_raises(two_nodes, tmp_path, capsys):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(HOSTS)
    err = _within(10, lambda: cli.main(["-i", str(hosts), "logs", "ct200", "R"]))
    assert isinstance(err, SystemExit) and err.code == 1
    assert "internal error: KeyError: 'boom'" in capsys.readouterr().err


def test_a_run_on_one_node_goes_through_the_same_fan_in(monkeypatch):
    monkeypatch.setattr(nodes, "run_nodes", lambda inv, target, run, s: ("R", [(INV.targets["ct200"], {})]))
    summary = follow_mod.Summary("ct200", "R", "succeeded", 0)

    def fake_follow(inv, t, run, **kw):
        yield follow_mod.Line(b"hello\n", 1)
        yield follow_mod.End(summary)

    monkeypatch.setattr(follow_mod, "follow", fake_follow)
    events = list(nodes.follow(INV, INV.targets["ct200"], "R", session=object()))
    assert events[0] == nodes.Job("R", ["ct200"])
    assert events[1] == nodes.NodeEvent("ct200", follow_mod.Line(b"hello\n", 1))
    assert events[2] is summary and len(events) == 3


def test_every_node_of_a_large_job_streams_at_once(monkeypatch):
    """A follower streams until its node ends, so none may wait for another's thread: with a
    bounded pool (16 workers) the 17th node of a job would print nothing while the others run."""
    n = 20
    inv = inventory.parse("hosts: {pve1: {address: pve1.invalid}}\ntargets:\n"
                          + "".join(f"  ct{200 + i}: {{host: pve1, vmid: {200 + i}, gpus: 0}}\n" for i in range(n)))
    stop = threading.Event()
    monkeypatch.setattr(nodes, "run_nodes", lambda inv_, target, run, s: ("R", [(t, {}) for t in inv.targets.values()]))

    def streaming(inv_, t, run, **kw):
        yield follow_mod.Line(f"{t.name} step 1\n".encode(), 1)
        stop.wait(60)
        yield follow_mod.End(follow_mod.Summary(t.name, run, "running", 101))

    monkeypatch.setattr(follow_mod, "follow", streaming)
    seen: set = set()

    def until_every_node_spoke():
        for ev in nodes.follow(inv, next(iter(inv.targets.values())), "R", session=object()):
            if isinstance(ev, nodes.NodeEvent):
                seen.add(ev.target)
                if len(seen) == n:
                    return

    try:
        assert _within(10, until_every_node_spoke) is None and len(seen) == n
    finally:
        stop.set()


def test_the_first_failure_is_the_node_that_failed_not_one_its_failure_ended():
    """ct200's ranks were ended by the job's watch (exit 3) a moment before ct300's supervisor
    recorded its own rank's SIGKILL: the summary names ct300's rank, not the earlier end."""
    def failed(target, ended, exit_code, cause):
        return follow_mod.Summary(target, "R", "failed", 100, classified="killed" if exit_code == 137 else None,
                                  exit={"exit_code": exit_code, "ended_ts": ended, "root_cause": cause})

    summaries = {"ct200": failed("ct200", 100.0, 3, {"rank": 0, "exitcode": 3, "error": None}),
                 "ct300": failed("ct300", 100.4, 137, {"rank": 1, "exitcode": -9, "error": "Signal 9 (SIGKILL)"})}
    s = nodes.job_summary("R", ["ct200", "ct300"], summaries, "ct200")
    assert (s.root_cause["target"], s.root_cause["rank"], s.root_cause["signature"]) == ("ct300", 1, "killed")
    # a launcher the watch ended has no torchrun root cause; its exit status says the same
    summaries["ct200"] = failed("ct200", 100.0, 3, None)
    assert nodes.job_summary("R", ["ct200", "ct300"], summaries, "ct200").root_cause["target"] == "ct300"
    # with only such nodes, the earliest is named all the same: here the second of the list
    summaries = {"ct200": failed("ct200", 100.5, 3, None), "ct300": failed("ct300", 100.2, 3, None)}
    s = nodes.job_summary("R", ["ct200", "ct300"], summaries, "ct200")
    assert s.root_cause["target"] == "ct300"
