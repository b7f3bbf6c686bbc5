"""The one way commands reach their targets' programs: the remote agent's source, its call and stream,
and the agent's typed replies. The fan-out over targets is ssh/fanout.py; a Session the caller may
pass or not, ssh/session.owned_session.

The agent is the package `orchestrator/remote/` (standard library only, Python >= 3.8): a
program is an entry module there (`release.release_agent` for deploys, `runs.runs_agent` for runs, probe and
export) plus everything it imports, each part naming what it takes from another with a relative
import (`from .records import run_state`, `from ..agent_base import emit`); a name shared between
parts that way is public in its own module, a part's private helpers keep the underscore. `python -c`
cannot import files on the target, so `source()` follows those imports and joins the parts,
dependencies first, into one source without those lines: one round trip, one namespace.

Two wire protocols, both on stdout:
- a reply (`call`): the last line is one JSON document. `{"ok": false, "reason": R, ...}` is a
  refusal and raises `Refused` (reason `not_found`, `no_release`, `busy`, ...), which the command
  turns into its own words; a non-zero exit status is `StepFailed` with the agent's last stderr line.
- a stream (`stream`): a JSON header line, then raw bytes (`follow`'s log, `export`'s files);
  the same header refusals.

Library code: returns data or raises OpsError; never prints.
"""
from __future__ import annotations

import base64
import json
import re
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Callable, Sequence

from orchestrator import waits
from orchestrator.errors import OpsError, StepFailed
from orchestrator.inventory import Target
from orchestrator.ssh.hold import Hold
from orchestrator.ssh.transport import Result, Transport

RELEASE = "release.release_agent"     # deploy: manifest, apply, install-deps
RUNS = "runs.runs_agent"           # launch, status, follow, stop, metrics, export, bench, probe
# The target's python options per program. The release agent needs nothing that `site` sets up
# at start, and a target's .pth files can cost more than the rest of a no-change deploy's agent:
# -S skips them (remote/agent_base.py `_site` puts the installed packages on sys.path where it
# needs them: the torch version, install-deps). The runs agent starts trainers and imports
# their modules: it keeps a plain start.
OPTIONS = {RELEASE: ("-S",)}
# A part's relative import: one line, `from .X import a, b` / `from ..X import c` at the top level.
# Read line by line, not by ast.parse: parsing every part would be paid in every command that reaches
# a target, where the controller's own CPU is what a no-change deploy costs (tests/test_agent.py holds
# the scan to ast's reading of every part). A relative import over several lines is refused by name.
_RELATIVE = re.compile(r"from (\.+)([\w.]*) import [\w, ]+")


# --- the remote program -------------------------------------------------------------------------

def part_file(name: str) -> str:
    """The file of part `name` inside orchestrator/remote/: `runs.records` is `runs/records.py`."""
    return name.replace(".", "/") + ".py"


def _module_text(name: str) -> str:
    *folders, module = name.split(".")
    where = resources.files("orchestrator.remote")
    for folder in folders:
        where = where.joinpath(folder)
    return where.joinpath(f"{module}.py").read_text(encoding="utf-8")


@dataclass(frozen=True)
class LocalImport:
    level: int              # 1 for `from .X`, 2 for `from ..X`
    module: str | None      # X ("" -> None: `from . import x`)
    lineno: int             # 1-based, as ast's


def _local_imports(part: str, text: str) -> list[LocalImport]:
    """The part's relative imports, `from .X import ...` / `from ..X import ...` (top level only)."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.startswith("from ."):
            continue
        m = _RELATIVE.fullmatch(line.split("#")[0].rstrip())
        if m is None:
            raise ValueError(f"orchestrator/remote/{part_file(part)}:{lineno}: a relative import is one "
                             f"line, `from .part import a, b` (write another line for more names)")
        found.append(LocalImport(len(m.group(1)), m.group(2) or None, lineno))
    return found


def imported_part(part: str, node: LocalImport) -> str:
    """The part that a relative import of `part` names: in `runs.locks`, `.common` is
    `runs.records` and `..common` is `common`."""
    package = part.split(".")[:-1]
    up = node.level - 1
    if node.module is None or up > len(package):
        raise ValueError(f"orchestrator/remote/{part_file(part)}:{node.lineno}: a part imports names "
                         f"from another part of orchestrator/remote (`from .part import name`)")
    return ".".join(package[:len(package) - up] + node.module.split("."))


@lru_cache(maxsize=None)
def parts(entry: str) -> tuple[str, ...]:
    """The modules of program `entry`, each after every module it imports (entry last)."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise ValueError(f"orchestrator/remote: import cycle through {name}")
        visiting.add(name)
        for node in _local_imports(name, _module_text(name)):
            visit(imported_part(name, node))
        visiting.discard(name)
        order.append(name)

    visit(entry)
    return tuple(order)


def source(entry: str) -> str:
    """Program `entry` as one `python -c` source: its parts joined, their relative import lines
    removed (the names they import are defined earlier in the same source)."""
    return _joined(entry)


@lru_cache(maxsize=None)
def _joined(entry: str) -> str:
    texts = []
    for name in parts(entry):
        text = _module_text(name)
        lines = text.splitlines(keepends=True)
        for node in reversed(_local_imports(name, text)):
            del lines[node.lineno - 1]
        texts.append(f"# ---- {part_file(name)} ----\n" + "".join(lean(lines)))
    return "\n\n".join(texts)


# The program travels as one argument (`python -c SOURCE`, inside the one command line sshd gives
# the user's shell): Linux takes at most 128 KiB in one (MAX_ARG_STRLEN). What runs is the code;
# the parts' docstrings and comment lines, about a fifth of their text, stay in the files.
MAX_SOURCE_BYTES = 128 * 1024
_DOC = re.compile(r'[rRuU]?"""')


def lean(lines: list[str]) -> list[str]:
    """A part's lines less its docstrings and comment lines: line by line, as `_local_imports` reads
    (no ast.parse in every command's start). A docstring is a line opening with \"\"\" where a
    statement may start right after a `:` line or at the top; its block keeps a `pass` when it held
    nothing else. tests/test_agent.py holds the result to ast's reading: the same code, less the
    docstrings."""
    out: list[str] = []
    closing = False         # inside a docstring, until its closing quotes
    may_doc = True          # the last code line opened a block (or none yet: the module's docstring)
    pending: str | None = None      # the indentation of a dropped docstring whose block may be empty
    for line in lines:
        text = line.strip()
        if closing:
            closing = '"""' not in text
            continue
        if not text or text.startswith("#"):
            continue
        indent = line[:len(line) - len(line.lstrip())]
        if may_doc and _DOC.match(text):
            closing = text.count('"""') < 2
            pending, may_doc = indent, False
            continue
        if pending is not None and len(indent) < len(pending):
            out.append(pending + "pass\n")
        pending = None
        out.append(line)
        may_doc = text.endswith(":")
    if pending is not None:
        out.append(pending + "pass\n")
    return out


# The lean source still grows with the agents: past three quarters of the cap (MAX_SOURCE_BYTES) it
# travels compressed, unpacked by a one-line launcher in the same `-c` (a fifth of the size), so no
# addition to the agents ever meets `Argument list too long` on the target.
PLAIN_MAX = MAX_SOURCE_BYTES * 3 // 4


def argv(target: Target, program: str, args: Sequence[str]) -> list[str]:
    return [target.python, *OPTIONS.get(program, ()), "-c", command(program), *args]


@lru_cache(maxsize=None)
def command(program: str) -> str:
    """The `-c` text of `program`: its source, or where that is past PLAIN_MAX, a launcher that
    decompresses and runs it in the same namespace (`__name__` is "__main__" either way)."""
    text = source(program)
    if len(text.encode()) <= PLAIN_MAX:
        return text
    packed = base64.b85encode(zlib.compress(text.encode(), 9)).decode("ascii")
    return (f"import base64,zlib;exec(compile(zlib.decompress(base64.b85decode({packed!r})),"
            f"'<dflash-ops {program}>','exec'))")


# --- typed replies ------------------------------------------------------------------------------

class Refused(OpsError):
    """The agent said no: a reply `{"ok": false, "reason": R, ...}` (no run, no release, busy...).
    Commands catch it and say what to do in their own words; uncaught, it is one line, exit 1."""

    def __init__(self, target: str, doc: dict):
        self.target, self.doc = target, doc
        self.reason = str(doc.get("reason") or "refused")
        super().__init__(f"{target}: {doc.get('message') or self.reason.replace('_', ' ')}")


def _exec_failed(target: Target, what: str, r: Result) -> StepFailed | None:
    """The error for an agent that did not run or failed (None when it exited 0)."""
    err = r.stderr.decode(errors="replace")
    if r.exit_code == 126 or (r.exit_code == 255 and "Permission denied" in err):
        return StepFailed(target.name, what, r.exit_code, f"python {target.python!r} cannot be executed on the "
                          f"target (permission denied); check its mode, or set `python:` in hosts.yaml")
    if r.exit_code == 127 or (r.exit_code == 255 and "No such file" in err):
        return StepFailed(target.name, what, r.exit_code,
                          f"python {target.python!r} not found on the target; set `python:` in hosts.yaml")
    if r.exit_code != 0:
        return StepFailed(target.name, what, r.exit_code, err)
    return None


def reply(target: Target, doc: dict) -> dict:
    """The agent's document, or Refused when it is a refusal."""
    if isinstance(doc, dict) and doc.get("ok") is False and doc.get("reason"):
        raise Refused(target.name, doc)
    return doc


def call(t: Transport, target: Target, program: str, args: Sequence[str], *, what: str,
         stdin=None, stderr: Callable[[bytes], None] | None = None,
         timeout: float | None = None) -> dict:
    """Run `program CMD ARGS...` with the target's python; its reply (the last stdout line).
    stderr, when given, receives the agent's stderr as it comes (and StepFailed then carries
    only its last line). stdin may be a hold.Hold: held open while the agent runs."""
    tail: list[bytes] = []

    def keep(data: bytes) -> None:
        assert stderr is not None       # passed on only when it is given
        tail.append(data)
        del tail[:-64]
        stderr(data)

    # said every 20 s while the target has not answered, unless the call shows its own progress (an
    # upload on stdin, the agent's live lines on stderr)
    with waits.noted(target.name, what) if stdin is None and stderr is None else nullcontext():
        r = t.run(argv(target, program, args), stdin=stdin, stderr=keep if stderr else None, timeout=timeout)
    if stderr:
        r = Result(r.exit_code, r.stdout, b"".join(tail))
    failed = _exec_failed(target, what, r)
    if failed:
        raise failed
    lines = r.stdout.decode(errors="replace").strip().splitlines()
    try:
        doc = json.loads(lines[-1])      # the agent's own document (its records are bounded there)
    except (IndexError, ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise StepFailed(target.name, what, r.exit_code, f"unreadable reply: {r.stdout[-200:]!r}")
    return reply(target, doc)


def stream(t: Transport, target: Target, program: str, args: Sequence[str], *, what: str,
           stdout: Callable[[bytes], None], stderr: Callable[[bytes], None] | None = None,
           timeout: float | None = None, check: bool = True, stdin: Hold | bytes | None = None) -> Result:
    """Run a streaming command (header line + bytes): stdout goes to the sink as it comes.
    check: a non-zero exit is StepFailed (follow checks for itself: a cut connection is not).
    stdin: a hold.Hold the command watches (export ends at its EOF), or bytes sent before EOF
    (tensorboard's sizes of the copies held)."""
    r = t.run(argv(target, program, args), stdout=stdout, stderr=stderr, timeout=timeout, stdin=stdin)
    failed = _exec_failed(target, what, r) if check or r.exit_code in (126, 127) else None
    if failed:
        raise failed
    return r


class TransferError(OpsError):
    """A stream did not hold what its header announced, or its header could not be read (exit 1)."""


class StreamSink:
    """The stdout sink of a `stream`: buffers until the header line (one JSON document), keeps it in
    `header`, calls opened(header) when the header says ok, then hands every later byte to take(data).
    `who` names the program in the error for an unreadable header."""

    def __init__(self, who: str):
        self.who = who
        self.buf = b""
        self.header: dict | None = None

    def __call__(self, data: bytes) -> None:
        if self.header is None:
            self.buf += data
            if b"\n" not in self.buf:
                return
            line, data = self.buf.split(b"\n", 1)
            self.buf = b""
            try:
                self.header = json.loads(line.decode("utf-8", "replace"))
            except ValueError:
                raise TransferError(f"unreadable header from the {self.who}: {line[:200]!r}") from None
            if not isinstance(self.header, dict) or not self.header.get("ok"):
                return
            self.opened(self.header)
        if data:
            self.take(data)

    def opened(self, header: dict) -> None:
        """The header said ok: prepare for the bytes it announces."""

    def take(self, data: bytes) -> None:
        """Bytes after the header."""


__all__ = ["RELEASE", "RUNS", "parts", "source", "argv", "call", "stream", "reply", "Refused", "StreamSink",
           "TransferError"]
