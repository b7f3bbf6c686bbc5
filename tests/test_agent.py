"""The remote-call layer's pure parts: the agents' parts joined into one program and how it travels,
fan_out's per-target results, session ownership, typed replies (the wire itself is tested against the
real sshd by every command's tests)."""
import ast
import builtins
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from agent_parts import top_level_names
from runs_agent_stub import SOURCE

from orchestrator.ssh import agent_call
from orchestrator.ssh import fanout
from orchestrator.ssh.session import owned_session
from orchestrator.errors import OpsError, TargetsFailed
from orchestrator.inventory import Target


REMOTE = Path(__file__).resolve().parent.parent / "orchestrator" / "remote"


def targets(*names):
    return [Target(name=n) for n in names]


def test_fan_out_keeps_a_result_per_target_in_order_and_fails_once_naming_each():
    seen = set()

    def fn(t):
        seen.add(threading.get_ident())
        if t.name.startswith("bad"):
            raise OpsError(f"{t.name}: cannot connect")
        return t.name.upper()

    group = fanout.fan_out(targets("a", "bad1", "b", "bad2"), fn)
    assert list(group) == ["a", "bad1", "b", "bad2"]
    assert [o.ok for o in group.values()] == [True, False, True, False]
    assert group["a"].value == "A" and group["bad1"].value is None
    assert group.failures == {"bad1": "bad1: cannot connect", "bad2": "bad2: cannot connect"}
    with pytest.raises(TargetsFailed) as e:
        group.raise_failures()
    assert str(e.value) == "failed on 2 target(s): bad1, bad2"
    assert fanout.fan_out([], fn) == {}
    fanout.fan_out(targets("x", "y"), lambda t: None).raise_failures()   # nothing failed: no error


def test_fan_out_lets_a_bug_through():
    with pytest.raises(ZeroDivisionError):
        fanout.fan_out(targets("a"), lambda t: 1 / 0)


def test_session_closes_only_the_one_it_opened(monkeypatch):
    closed = []

    class Fake:
        def __init__(self, inv):
            self.inv = inv

        def close(self):
            closed.append(self)

    from orchestrator.ssh import session as session_mod

    monkeypatch.setattr(session_mod, "Session", Fake)
    given = Fake("inv")
    with owned_session("inv", given) as s:
        assert s is given
    assert closed == []
    with pytest.raises(RuntimeError):
        with owned_session("inv") as s:
            assert isinstance(s, Fake) and s is not given
            raise RuntimeError("the caller failed")
    assert closed == [s]                    # closed on the way out, error or not


def test_a_refusal_is_a_typed_error_and_anything_else_the_document():
    t = Target(name="ct200")
    with pytest.raises(agent_call.Refused) as e:
        agent_call.reply(t, {"ok": False, "reason": "no_release", "message": "no release deployed in /w"})
    assert e.value.reason == "no_release" and str(e.value) == "ct200: no release deployed in /w"
    assert e.value.doc["message"] == "no release deployed in /w"
    assert agent_call.reply(t, {"ok": True, "run": "r"}) == {"ok": True, "run": "r"}
    assert agent_call.reply(t, {"runs": []}) == {"runs": []}


def test_each_program_is_its_entry_after_what_it_imports():
    assert agent_call.parts(agent_call.RELEASE) == ("agent_base", "release.store", "release.release_agent")
    runs = agent_call.parts(agent_call.RUNS)
    assert runs[0] == "agent_base" and runs[-1] == "runs.runs_agent"
    assert runs.index("runs.records") < runs.index("runs.locks") < runs.index("runs.supervisor")
    assert "release.store" in runs                 # the live release: one helper, both programs
    assert agent_call.argv(Target(name="t", python="/py"), agent_call.RUNS, ["status", "/w"])[:2] == ["/py", "-c"]


def test_the_line_scan_of_relative_imports_is_asts_reading_of_every_part():
    """source() finds the parts' relative imports line by line (no ast.parse in every command's start):
    for every file of orchestrator/remote/ it must find exactly the top-level relative imports that
    ast finds, at the same lines."""
    files = sorted(p for p in REMOTE.rglob("*.py") if p.name != "__init__.py")
    assert len(files) >= 10
    for path in files:
        part = path.relative_to(REMOTE).with_suffix("").as_posix().replace("/", ".")
        text = path.read_text(encoding="utf-8")
        want = [(n.level, n.module, n.lineno) for n in ast.parse(text).body
                if isinstance(n, ast.ImportFrom) and n.level]
        assert all(n.end_lineno == n.lineno for n in ast.parse(text).body
                   if isinstance(n, ast.ImportFrom) and n.level), part
        assert [(n.level, n.module, n.lineno) for n in agent_call._local_imports(part, text)] == want, part


def test_the_program_sent_is_the_parts_code_less_docstrings_and_within_one_argument():
    """source() leaves out docstrings and comment lines, line by line (agent_call.lean): for every part,
    ast reads the same code as in the file, less the docstrings (an emptied block holds `pass`); and
    each program, quoted on its command line, fits one argument (128 KiB, MAX_ARG_STRLEN) with room."""
    from orchestrator.ssh.transport import shell_join

    def undocumented(tree):
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        return ast.dump(tree)

    for path in sorted(REMOTE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lean = "".join(agent_call.lean(text.splitlines(keepends=True)))
        assert undocumented(ast.parse(lean)) == undocumented(ast.parse(text)), path
        assert '"""' not in lean, path
    for program in (agent_call.RELEASE, agent_call.RUNS):
        line = shell_join(agent_call.argv(Target(name="t", python="/usr/bin/python3"), program, ["status", "/w"]))
        assert len(line.encode()) < agent_call.MAX_SOURCE_BYTES * 0.85, (program, len(line.encode()))


def test_a_relative_import_over_several_lines_is_refused_by_name():
    text = "import os\nfrom .common import (a,\n    b)\n"
    with pytest.raises(ValueError, match=r"runs/x.py:2: a relative import is one line"):
        agent_call._local_imports("runs.x", text)




def _bound_in(fn) -> set[str]:
    """The names a function (or lambda) binds: its parameters and every name it stores."""
    a = fn.args
    names = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs + [v for v in (a.vararg, a.kwarg) if v]}
    return names | {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


@pytest.mark.parametrize("program", [agent_call.RELEASE, agent_call.RUNS])
def test_no_part_of_a_joined_agent_shadows_another_parts_global(program):
    """The parts of an agent run as one namespace (source() joins them; test_runs_agent checks no two
    parts define one name): a function whose local has the
    name of another part's top-level name would hide it from itself only, and a later `from .x import
    name` of that name would silently change what the function reads. None may."""
    owner: dict[str, str] = {}      # the first part to bind a name (parts come dependencies first)
    trees = {part: ast.parse(agent_call._module_text(part)) for part in agent_call.parts(program)}
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
    """The agent's reply is read in one place (agent_call.call): nested beyond what json reads, a list, a
    string, cut short: StepFailed naming the target (exit 1), never a RecursionError or a TypeError later."""
    from orchestrator.errors import StepFailed
    from orchestrator.ssh.transport import Result

    class Replies:              # what a transport gives back; nothing is run
        def run(self, argv, **kw):
            return Result(0, stdout, b"")

    with pytest.raises(StepFailed, match=r"^t: read the runs exited 0: unreadable reply"):
        agent_call.call(Replies(), Target(name="t"), agent_call.RUNS, ["status", "/w"], what="read the runs")


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
    assert agent_call.call(Slow(), Target(name="t"), agent_call.RUNS, ["status", "/w"],
                           what="read the runs") == {"ok": True}
    assert heard[0] == ("t", "read the runs")
    heard.clear()
    answered.set()
    agent_call.call(Slow(), Target(name="t"), agent_call.RUNS, ["probe", "/w"], what="probe", stderr=lambda b: None)
    assert heard == []


# ---- the parts, joined ------------------------------------------------------------------------

def _bound_anywhere(tree):
    """Every name the part binds somewhere (locals, arguments, loop and except targets)."""
    names = top_level_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


@pytest.mark.parametrize("program", [agent_call.RUNS, agent_call.RELEASE])
def test_every_part_says_where_each_name_comes_from(program):
    """A part is a module of a normal package: stdlib imports, `from .PART import NAME` for what
    another part defines (NAME must be defined there), nothing used that it neither defines nor
    imports; no two parts of a program define the same name (they share one namespace)."""
    defined_by: dict = {}
    for name in agent_call.parts(program):
        text = (REMOTE / agent_call.part_file(name)).read_text()
        tree = ast.parse(text, feature_version=(3, 8))
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                part = agent_call.imported_part(name, node)
                for a in node.names:
                    assert a.asname is None, f"{name}: `as` would not survive the join"
                    assert defined_by.get(a.name) == part, f"{name}: {a.name} is not defined by {part}"
                    imported.add(a.name)
            elif isinstance(node, ast.ImportFrom):
                assert node.module != "__future__", f"{name}: `from __future__` is only legal first"
                assert node.module.split(".")[0] in sys.stdlib_module_names, f"{name}: imports {node.module}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    assert a.name.split(".")[0] in sys.stdlib_module_names, f"{name}: imports {a.name}"
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        missing = used - set(dir(builtins)) - {"__name__", "__file__"} - _bound_anywhere(tree)
        assert not missing, f"{name} uses {sorted(missing)} without importing them"
        stdlib = {(a.asname or a.name).split(".")[0] for node in tree.body
                  if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
                  for a in node.names}
        for top in top_level_names(tree) - imported - stdlib:
            assert top not in defined_by, f"{top} is defined by both {defined_by[top]} and {name}"
            defined_by[top] = name
    assert list(agent_call.parts(program))[-1] == program


def test_the_joined_source_compiles_for_python_38_and_defines_every_command():
    joined = agent_call.source(agent_call.RUNS)
    ast.parse(joined, feature_version=(3, 8))
    space = {"__name__": "not_main"}
    exec(compile(joined, "runs.runs_agent", "exec"), space)   # module-level order: no NameError
    for cmd in ("cmd_launch", "cmd_status", "cmd_follow", "cmd_stop", "cmd_metrics", "cmd_export",
                "cmd_probe", "main", "_supervise", "claim", "release_slots"):
        assert callable(space[cmd]), cmd
    assert joined.count("\n# ---- ") + joined.startswith("# ---- ") == len(agent_call.parts(agent_call.RUNS))
    assert "\nfrom ." not in joined      # the package-relative imports are gone


def test_a_source_past_one_arguments_limit_travels_compressed_and_runs_the_same(monkeypatch):
    """Linux refuses one argument over 128 KiB (`Argument list too long`): the runs agent passed it as
    plain text. Past PLAIN_MAX it goes as a launcher that unpacks the same source; small ones stay plain."""
    joined = agent_call.source(agent_call.RUNS)
    if len(joined.encode()) <= agent_call.PLAIN_MAX:
        assert SOURCE == joined
    else:
        assert len(SOURCE.encode()) < 128 * 1024 and SOURCE.startswith("import base64,zlib;exec(")
    assert agent_call.command(agent_call.RELEASE) == agent_call.source(agent_call.RELEASE)   # small: plain
    big = "x = 1\n" + "# " + "y" * (agent_call.PLAIN_MAX + 10) + "\nprint(__name__, x)\n"
    agent_call.command.cache_clear()
    monkeypatch.setattr(agent_call, "source", lambda program: big)
    packed = agent_call.command("big")
    monkeypatch.undo()
    agent_call.command.cache_clear()
    assert len(packed) < 10_000
    r = subprocess.run([sys.executable, "-c", packed], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "__main__ 1\n", r.stderr
