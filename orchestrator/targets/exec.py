"""`exec`: run one command in each target's container (or on the node, for a target without
vmid), output streamed as it comes, exit status passed through.

The command travels as an argv, quoted once (transport.shell_join) for the node's shell; pct
hands it to lxc-attach as argv. It runs in the target's environment: the target's `env:`, as for
every command, and the folder of its `python:` first on PATH, as in an activated venv (a small
`sh -c` in front of the argv, which then replaces itself with the command).
"""
from __future__ import annotations

import posixpath
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from orchestrator.ssh import agent
from orchestrator.errors import OpsError, UsageError
from orchestrator.inventory import Inventory, Target
from orchestrator.ssh.session import Session
from orchestrator.ssh.transport import PctTransport

Write = Callable[[str, bytes], None]    # (target, bytes) -> None


@dataclass
class ExecResult:
    target: str
    exit_code: int | None = None        # None: the command did not run (error says why)
    error: str | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    seconds: float = 0.0
    note: str | None = None             # what a failure means (exit 127: not found, and where)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def as_json(self) -> dict:
        return {"ok": self.ok, "exit_code": self.exit_code, "error": self.error,
                "stdout": self.stdout.decode(errors="replace"),
                "stderr": self.stderr.decode(errors="replace"), "seconds": self.seconds, "note": self.note}


class LinePrefixer:
    """A sink that writes whole lines, each led by `prefix`; a partial line waits for its end
    (or for flush()), so lines of parallel targets never interleave mid-line."""

    def __init__(self, prefix: bytes, write: Callable[[bytes], None]):
        self.prefix, self.write, self.pending = prefix, write, b""

    def __call__(self, data: bytes) -> None:
        data = self.pending + data
        *lines, self.pending = data.split(b"\n")
        if lines:
            self.write(b"".join(self.prefix + line + b"\n" for line in lines))

    def flush(self) -> None:
        if self.pending:
            self.write(self.prefix + self.pending + b"\n")
            self.pending = b""


def select(inv: Inventory, names: Sequence[str], all_targets: bool) -> list[Target]:
    if all_targets:
        if names:
            raise UsageError("give target names or --all, not both")
        return [t for t in inv.targets.values() if t.name != "local" or len(inv.targets) == 1]
    return inv.select(list(names))


def check_command(argv: Sequence[str]) -> list[str]:
    if not argv:
        raise UsageError("no command: put it after `--`, e.g. `dflash-ops exec ct200 -- nvidia-smi`")
    for i, a in enumerate(argv, 1):
        if "\x00" in a:
            raise UsageError(f"command argument {i} contains a NUL byte")
        try:
            a.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError(f"command argument {i} is not UTF-8 text: {a!r}") from None
    return list(argv)


# What the `sh -c` below writes, alone, when the command is not there: exec drops it from the user's
# stderr and explains exit 127 itself (the shell's own line, `/root/venv/bin: 1: exec: nvidia-smi: not
# found`, named the python's folder as if it were the culprit).
NOT_FOUND = b"dflash-ops-exec: not found\n"
# `sh -c` script: $0 is the python's folder ("" for a python named without one), "$@" the command.
_ACTIVATE = ('if [ -n "$0" ]; then export PATH="$0:$PATH"; '
             'if [ -f "$0/../pyvenv.cfg" ]; then export VIRTUAL_ENV="${0%/*}"; fi; fi; '
             'case "$1" in */*) [ -e "$1" ] ;; *) command -v "$1" >/dev/null 2>&1 ;; esac || '
             '{ echo "dflash-ops-exec: not found" >&2; exit 127; }; '
             'exec "$@"')


def in_target_env(target: Target, argv: Sequence[str]) -> list[str]:
    """argv as it runs in the target's environment: the folder of its `python:` first on PATH (and
    VIRTUAL_ENV set when that folder is a venv's), as `source VENV/bin/activate` would (a python
    named without a folder, `python3`, is found on PATH already). A command that is not there exits
    127 with NOT_FOUND alone on stderr."""
    return ["sh", "-c", _ACTIVATE, posixpath.dirname(target.python), *argv]


class NotFoundFilter:
    """stderr as it comes, less NOT_FOUND at its start: bytes that could still be its beginning wait
    (at most its length); the first byte that differs lets them through."""

    def __init__(self, write: Callable[[bytes], None]):
        self.write, self.held, self.found, self.deciding = write, b"", False, True

    def __call__(self, data: bytes) -> None:
        if not self.deciding:
            self.write(data)
            return
        self.held += data
        if self.held.startswith(NOT_FOUND):
            self.found, self.deciding, rest = True, False, self.held[len(NOT_FOUND):]
        elif NOT_FOUND.startswith(self.held):
            return
        else:
            self.deciding, rest = False, self.held
        self.held = b""
        if rest:
            self.write(rest)

    def flush(self) -> None:
        if self.held:
            self.write(self.held)
            self.held, self.deciding = b"", False


def not_found_note(target: Target, argv: Sequence[str]) -> str:
    """What exit status 127 (command not found) means on this target, in one line."""
    where = f"CT {target.vmid}" if target.vmid is not None else target.host or "this machine"
    folder = posixpath.dirname(target.python)
    first = f" (its folder {folder} was first on PATH)" if folder else ""
    if "/" in argv[0]:
        return f"{target.name}: `{argv[0]}` not found in {where}; the target's python is {target.python}"
    return f"{target.name}: `{argv[0]}` not on {where}'s PATH; the target's python is {target.python}{first}"


def run_one(session: Session, target: Target, argv: Sequence[str], *, out: Write | None = None,
            err: Write | None = None, env: Mapping[str, str] | None = None) -> ExecResult:
    """The command on one target, in its environment (in_target_env). With out/err the output is
    streamed there, else kept. A command not found (exit 127, the shell said so) gets `note`."""
    res = ExecResult(target.name)
    start = time.monotonic()
    kept: list[bytes] = []      # all of stderr when it is kept, else its last chunks

    def keep(data: bytes) -> None:
        kept.append(data)
        if err:
            err(target.name, data)
            del kept[:-8]
    on_err = NotFoundFilter(keep)
    try:
        # The container's state first, on its own: pct's refusal must not reach the user's
        # stream as if the command had printed it.
        t = session.transport(target, env=env, check=False)
        if isinstance(t, PctTransport):
            t.check()
        r = t.run(in_target_env(target, argv), stdout=(lambda b: out(target.name, b)) if out else None, stderr=on_err)
        on_err.flush()
        res.exit_code, res.stdout = r.exit_code, r.stdout
        res.stderr = b"" if err else b"".join(kept)
        last = b"".join(kept).rstrip().splitlines()[-1:]
        if r.exit_code == 127 and (on_err.found or last and b"not found" in last[0]):
            res.note = not_found_note(target, argv)
    except OpsError as e:
        res.error = e.render()
    res.seconds = round(time.monotonic() - start, 3)
    return res


def exec_command(inv: Inventory, targets: list[Target], argv: Sequence[str], *, out: Write | None = None,
                 err: Write | None = None, env: Mapping[str, str] | None = None) -> list[ExecResult]:
    """Run argv on every target in parallel; one result per target, in the order given."""
    argv = check_command(argv)
    with agent.session(inv) as session:
        group = agent.fan_out(targets, lambda t: run_one(session, t, argv, out=out, err=err, env=env))
    return [group[t.name].value for t in targets]   # run_one keeps its own errors: every outcome has a value


def exit_status(results: list[ExecResult]) -> int:
    """One target: its command's exit status (1 when it could not run); several: 1 if any failed."""
    if len(results) == 1:
        r = results[0]
        return r.exit_code if r.exit_code is not None else 1
    return 0 if all(r.ok for r in results) else 1


class Streams:
    """The writers for exec's live output: raw bytes for one target, `[target] ` line prefixes
    (whole lines, under one lock) for several."""

    def __init__(self, names: list[str], stdout, stderr):
        self.lock = threading.Lock()
        self.several = len(names) > 1
        self.files = {"out": stdout, "err": stderr}
        self.prefixers = {(n, s): LinePrefixer(f"[{n}] ".encode(), self._writer(s))
                          for n in names for s in ("out", "err")} if self.several else {}

    def _writer(self, stream: str) -> Callable[[bytes], None]:
        f = self.files[stream]

        def write(data: bytes) -> None:
            with self.lock:
                f.write(data)
                f.flush()
        return write

    def sink(self, stream: str) -> Write:
        if not self.several:
            direct = self._writer(stream)
            return lambda _target, data: direct(data)
        return lambda target, data: self.prefixers[(target, stream)](data)

    def flush(self) -> None:
        for p in self.prefixers.values():
            p.flush()
