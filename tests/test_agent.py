"""The remote-call layer's pure parts: fan_out's per-target results, session ownership, typed
replies (the wire itself is tested against the real sshd by every command's tests)."""
import threading

import pytest
from agent_parts import top_level_names

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


def test_the_line_scan_of_relative_imports_is_asts_reading_of_every_part():
    """source() finds the parts' relative imports line by line (no ast.parse in every command's start):
    for every file of orchestrator/remote/ it must find exactly the top-level relative imports that
    ast finds, at the same lines."""
    import ast
    from pathlib import Path

    remote = Path(agent.__file__).resolve().parents[1] / "remote"
    files = sorted(p for p in remote.rglob("*.py") if p.name != "__init__.py")
    assert len(files) >= 10
    for path in files:
        part = path.relative_to(remote).with_suffix("").as_posix().replace("/", ".")
        text = path.read_text(encoding="utf-8")
        want = [(n.level, n.module, n.lineno) for n in ast.parse(text).body
                if isinstance(n, ast.ImportFrom) and n.level]
        assert all(n.end_lineno == n.lineno for n in ast.parse(text).body
                   if isinstance(n, ast.ImportFrom) and n.level), part
        assert [(n.level, n.module, n.lineno) for n in agent._local_imports(part, text)] == want, part


def test_the_program_sent_is_the_parts_code_less_docstrings_and_within_one_argument():
    """source() leaves out docstrings and comment lines, line by line (agent.lean): for every part,
    ast reads the same code as in the file, less the docstrings (an emptied block holds `pass`); and
    each program, quoted on its command line, fits one argument (128 KiB, MAX_ARG_STRLEN) with room."""
    import ast
    from pathlib import Path

    from orchestrator.ssh.transport import shell_join

    def undocumented(tree):
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        return ast.dump(tree)

    remote = Path(agent.__file__).resolve().parents[1] / "remote"
    for path in sorted(remote.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lean = "".join(agent.lean(text.splitlines(keepends=True)))
        assert undocumented(ast.parse(lean)) == undocumented(ast.parse(text)), path
        assert '"""' not in lean, path
    for program in (agent.RELEASE, agent.RUNS):
        line = shell_join(agent.argv(Target(name="t", python="/usr/bin/python3"), program, ["status", "/w"]))
        assert len(line.encode()) < agent.MAX_SOURCE_BYTES * 0.85, (program, len(line.encode()))


def test_a_relative_import_over_several_lines_is_refused_by_name():
    text = "import os\nfrom .common import (a,\n    b)\n"
    with pytest.raises(ValueError, match=r"runs/x.py:2: a relative import is one line"):
        agent._local_imports("runs.x", text)




def _bound_in(fn) -> set[str]:
    """The names a function (or lambda) binds: its parameters and every name it stores."""
    import ast

    a = fn.args
    names = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs + [v for v in (a.vararg, a.kwarg) if v]}
    return names | {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


@pytest.mark.parametrize("program", [agent.RELEASE, agent.RUNS])
def test_no_part_of_a_joined_agent_shadows_another_parts_global(program):
    """The parts of an agent run as one namespace (source() joins them; test_runs_agent checks no two
    parts define one name): a function whose local has the
    name of another part's top-level name would hide it from itself only, and a later `from .x import
    name` of that name would silently change what the function reads. None may."""
    import ast

    owner: dict[str, str] = {}      # the first part to bind a name (parts come dependencies first)
    trees = {part: ast.parse(agent._module_text(part)) for part in agent.parts(program)}
    for part, tree in trees.items():
        for name in top_level_names(tree):
            owner.setdefault(name, part)
    shadows = [f"{part}: {getattr(fn, 'name', 'lambda')} binds {name} ({owner[name]}'s)"
               for part, tree in trees.items()
               for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.Lambda))
               for name in sorted(_bound_in(fn)) if owner.get(name, part) != part]
    assert shadows == []


@pytest.mark.parametrize("stdout", [b"[" * 100_000 + b"]" * 100_000 + b"\n", b"[1, 2]\n", b"\"x\"\n", b"{\"a\": \n"])
def test_a_reply_that_is_not_a_bounded_json_object_is_one_line(stdout):
    """The agent's reply is read in one place (agent.call): nested beyond what json reads, a list, a
    string, cut short: StepFailed naming the target (exit 1), never a RecursionError or a TypeError later."""
    from orchestrator.errors import StepFailed
    from orchestrator.ssh.transport import Result

    class Replies:              # what a transport gives back; nothing is run
        def run(self, argv, **kw):
            return Result(0, stdout, b"")

    with pytest.raises(StepFailed, match=r"^t: read the runs exited 0: unreadable reply"):
        agent.call(Replies(), Target(name="t"), agent.RUNS, ["status", "/w"], what="read the runs")


def test_a_call_the_target_has_not_answered_says_so_every_note_period(monkeypatch):
    """No silent wait: a call that takes longer than waits.NOTE_S says what it waits for, from the library's
    hook (the CLI prints it); one that shows its own progress (stderr lines) is left to it."""
    import threading

    from orchestrator import waits
    from orchestrator.ssh.transport import Result

    heard, answered = [], threading.Event()

    def note(target, what, seconds):
        heard.append((target, what))
        answered.set()

    class Slow:                 # a target that answers once the first note was heard
        def run(self, argv, **kw):
            assert answered.wait(30)
            return Result(0, b'{"ok": true}\n', b"")

    monkeypatch.setattr(waits, "NOTE_S", 0.05)
    monkeypatch.setattr(waits, "note", note)
    assert agent.call(Slow(), Target(name="t"), agent.RUNS, ["status", "/w"], what="read the runs") == {"ok": True}
    assert heard[0] == ("t", "read the runs")
    heard.clear()
    answered.set()
    agent.call(Slow(), Target(name="t"), agent.RUNS, ["probe", "/w"], what="probe", stderr=lambda b: None)
    assert heard == []
