"""The remote-call layer's pure parts: fan_out's per-target results, session ownership, typed
replies (the wire itself is tested against the real sshd by every command's tests)."""
import threading

import pytest

from orchestrator.ssh import agent
from orchestrator.errors import OpsError, TargetsFailed
from orchestrator.inventory import Target


def targets(*names):
    return [Target(name=n) for n in names]


def test_fan_out_keeps_a_result_per_target_in_order_and_fails_once_naming_each():
    seen = set()

    def fn(t):
        seen.add(threading.get_ident())
        if t.name.startswith("bad"):
            raise OpsError(f"{t.name}: cannot connect")
        return t.name.upper()

    group = agent.fan_out(targets("a", "bad1", "b", "bad2"), fn)
    assert list(group) == ["a", "bad1", "b", "bad2"]
    assert [o.ok for o in group.values()] == [True, False, True, False]
    assert group["a"].value == "A" and group["bad1"].value is None
    assert group.failures == {"bad1": "bad1: cannot connect", "bad2": "bad2: cannot connect"}
    with pytest.raises(TargetsFailed) as e:
        group.raise_failures()
    assert str(e.value) == "failed on 2 target(s): bad1, bad2"
    assert agent.fan_out([], fn) == {}
    agent.fan_out(targets("x", "y"), lambda t: None).raise_failures()   # nothing failed: no error


def test_fan_out_lets_a_bug_through():
    with pytest.raises(ZeroDivisionError):
        agent.fan_out(targets("a"), lambda t: 1 / 0)


def test_session_closes_only_the_one_it_opened(monkeypatch):
    closed = []

    class Fake:
        def __init__(self, inv):
            self.inv = inv

        def close(self):
            closed.append(self)

    monkeypatch.setattr(agent, "Session", Fake)
    given = Fake("inv")
    with agent.session("inv", given) as s:
        assert s is given
    assert closed == []
    with pytest.raises(RuntimeError):
        with agent.session("inv") as s:
            assert isinstance(s, Fake) and s is not given
            raise RuntimeError("the caller failed")
    assert closed == [s]                    # closed on the way out, error or not


def test_a_refusal_is_a_typed_error_and_anything_else_the_document():
    t = Target(name="ct200")
    with pytest.raises(agent.Refused) as e:
        agent.reply(t, {"ok": False, "reason": "no_release", "message": "no release deployed in /w"})
    assert e.value.reason == "no_release" and str(e.value) == "ct200: no release deployed in /w"
    assert e.value.doc["message"] == "no release deployed in /w"
    assert agent.reply(t, {"ok": True, "run": "r"}) == {"ok": True, "run": "r"}
    assert agent.reply(t, {"runs": []}) == {"runs": []}


def test_each_program_is_its_entry_after_what_it_imports():
    assert agent.parts(agent.RELEASE) == ("common", "release.store", "release.agent")
    runs = agent.parts(agent.RUNS)
    assert runs[0] == "common" and runs[-1] == "runs.agent"
    assert runs.index("runs.common") < runs.index("runs.locks") < runs.index("runs.supervisor")
    assert "release.store" in runs                 # the live release: one helper, both programs
    assert agent.argv(Target(name="t", python="/py"), agent.RUNS, ["status", "/w"])[:2] == ["/py", "-c"]


def test_two_threads_building_the_agent_source_do_not_break_each_others_parse(monkeypatch):
    """CPython 3.11's ast.parse raises "SystemError: AST constructor recursion depth mismatch" when
    another thread parses while it builds its tree (a garbage collection inside the build can run a
    finalizer, and a finalizer can hand the GIL over). It broke a two-target deploy's fan-out. Here
    the first thread's first collection inside its parse deterministically lets a second thread build
    the source: that thread must wait its turn instead."""
    import ast
    import gc

    errors, first = [], threading.current_thread()
    second = threading.Thread(target=lambda: _build(errors))

    class HandOver:
        def __del__(self):
            if threading.current_thread() is first and not second.is_alive() and second.ident is None:
                second.start()
                second.join(0.5)                   # a second thread free to parse finishes well within

    real_parse, thresholds = ast.parse, gc.get_threshold()

    def parse(text, *a, **k):                      # garbage that the next collection, in the tree's
        if threading.current_thread() is first and second.ident is None:  # build, finalizes
            h = HandOver()
            h.cycle = h
            del h
            gc.set_threshold(1)
        try:
            return real_parse(text, *a, **k)
        finally:
            gc.set_threshold(*thresholds)

    monkeypatch.setattr(agent.ast, "parse", parse)
    agent._joined.cache_clear(), agent.parts.cache_clear()
    try:
        _build(errors)
        second.join(30)
    finally:
        gc.set_threshold(*thresholds)
        agent._joined.cache_clear(), agent.parts.cache_clear()
    assert second.ident is not None, "the hand-over never ran: the test no longer exercises the race"
    assert errors == []


def _build(errors: list) -> None:
    try:
        agent.source(agent.RUNS)
    except Exception as e:  # noqa: BLE001 - the assertion shows it
        errors.append(repr(e))
