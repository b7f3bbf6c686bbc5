"""`exec`: run one command in each target's container (or on the node, for a target without
vmid), output streamed as it comes, exit status passed through; interrupted, the command is ended.

The command travels as an argv, quoted once (transport.shell_join) for the node's shell; pct
hands it to lxc-attach as argv. It runs in the target's environment: the target's `env:`, as for
every command, and the folder of its `python:` first on PATH, as in an activated venv (a small
`sh -c` in front of the argv). That shell leads a process group of its own (setsid) and runs the
command beside a watcher of its stdin, which the controller holds open (hold.Hold): a line
`INT` / `TERM` from an interrupted controller, or EOF when the controller or its connection is gone
(SIGKILL), makes the watcher signal the group (INT, TERM; HUP at EOF), then SIGKILL what is left of
it after ENDING_GRACE_S. The node's side (sshd, sh, pct, lxc-attach) only waits, and ends with it.
"""
from __future__ import annotations

import collections
import posixpath
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from orchestrator.ssh import fanout
from orchestrator.ssh.session import owned_session
from orchestrator.errors import (Interrupted, OpsError, Terminated, UsageError, terminated_on_sigterm,
                                 wait_for_event)
from orchestrator.inventory import Inventory, Target
from orchestrator.lines import Prefixed
from orchestrator.ssh.session import Session
from orchestrator.ssh.hold import Hold, tell_all
from orchestrator.ssh.pct import PctTransport
from orchestrator.ssh.transport import Kept

Write = Callable[[str, bytes], None]    # (target, bytes) -> None
# What `exec --json` (and a playbook's exec step) keeps of each target's stdout, and of its stderr: the
# first KEEP_BYTES; the rest is counted (stdout_bytes, stdout_truncated), not kept.
KEEP_BYTES = 1 << 20


@dataclass
class ExecResult:
    target: str
    exit_code: int | None = None        # None: the command did not run (error says why)
    error: str | None = None
    stdout: bytes = b""                 # what was kept: all, or the first `keep` bytes (run_one)
    stderr: bytes = b""
    seconds: float = 0.0
    note: str | None = None             # what a failure means (exit 127: not found, and where)
    stdout_bytes: int = 0               # all the command wrote there, kept or not
    stderr_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def as_json(self) -> dict:
        return {"ok": self.ok, "exit_code": self.exit_code, "error": self.error,
                "stdout": self.stdout.decode(errors="replace"),
                "stderr": self.stderr.decode(errors="replace"), "seconds": self.seconds, "note": self.note,
                "stdout_bytes": self.stdout_bytes, "stdout_truncated": self.stdout_bytes > len(self.stdout),
                "stderr_bytes": self.stderr_bytes, "stderr_truncated": self.stderr_bytes > len(self.stderr)}


class LinePrefixer(Prefixed):
    """A sink that writes whole lines, each led by `prefix`; a partial line waits for its end
    (or for flush()), so lines of parallel targets never interleave mid-line. A line longer than
    lines.PIECE bytes is written in pieces, each a prefixed line of its own: what waits is bounded, and
    the time is linear in the output (lines.Prefixed)."""


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
ENDING_GRACE_S = 2      # after the watcher's signal, SIGKILL for what is left of the command's group
ENDING_WAIT_S = 5       # how long an interrupted exec waits for the commands' ends before it says so

# `sh -c` script, $0 a name for the shell's own messages, "$@" the next shell: that shell leads a
# process group of its own, so the watcher's `kill 0` reaches the command's processes and nothing of
# the node's. setsid(1) (util-linux, busybox) execs in place when its caller leads no group (from a
# leader it would fork and return at once: hence the check first); lxc-attach may have made it a
# leader already. Without /proc or setsid the group stays the one the node's sshd made for this
# channel (docs/inventory.md says what that means). The shells' variables are named `_dflash_*`:
# one the command's environment exports would reach the command changed.
_GROUP = ('if read -r _dflash_x _dflash_x _dflash_x _dflash_x _dflash_g _dflash_x 2>/dev/null </proc/$$/stat '
          '&& [ "$_dflash_g" != $$ ] && command -v setsid >/dev/null 2>&1; then exec setsid "$@"; fi; exec "$@"')
# `sh -c` script: $0 is the python's folder ("" for a python named without one), "$@" the command.
# Fd 3 takes the held stdin for the watcher; the command reads /dev/null (an empty stdin, as before).
# The shell's own stderr goes to /dev/null (fd 4 keeps the command's): its words about a command a
# signal killed (`Terminated`) were never part of exec's output; dash writes them while a simple
# command's redirections are still in place, hence the subshell that execs the command with them.
# The command runs in the foreground,
# so SIGINT and SIGQUIT keep their dispositions (an asynchronous list would ignore them); the watcher
# is the asynchronous list: it ignores SIGINT, and TERM and HUP once it has read, so that its signal
# to the group leaves it there to SIGKILL the rest: as soon as this shell has exited (the command
# ended; a zombie whose parent died with the controller counts as exited), or after the grace, when
# the command ignored the signal (then this shell too: status 137).
# The shell's trap defers a signal until the command has ended; a command that ended unsignalled
# (128+N when a signal of its own killed it) has its watcher killed, and what it left running in the
# background is left running.
_ACTIVATE = ('if [ -n "$0" ]; then export PATH="$0:$PATH"; '
             'if [ -f "$0/../pyvenv.cfg" ]; then export VIRTUAL_ENV="${0%/*}"; fi; fi; '
             'case "$1" in */*) [ -e "$1" ] ;; *) command -v "$1" >/dev/null 2>&1 ;; esac || '
             '{ echo "dflash-ops-exec: not found" >&2; exit 127; }; '
             'exec 3<&0 </dev/null 4>&2 2>/dev/null; '
             '{ read -r s <&3; case "$s" in INT|TERM) ;; *) s=HUP ;; esac; trap "" TERM HUP; kill -s "$s" 0; '
             f'i=0; while [ $i -lt {ENDING_GRACE_S * 10} ] && if [ -r /proc/$$/stat ]; then '
             'read -r _ _ st _ </proc/$$/stat && [ "$st" != Z ]; else kill -0 $$; fi; '
             'do sleep 0.1; i=$((i + 1)); done; '
             'kill -s KILL 0; } >/dev/null 2>&1 4>&- & '
             '_dflash_w=$!; exec 3<&-; _dflash_end=; trap _dflash_end=1 INT TERM HUP; '
             '(exec "$@" 2>&4 4>&-); _dflash_rc=$?; [ -n "$_dflash_end" ] || kill -s KILL "$_dflash_w"; '
             'exit "$_dflash_rc"')


def in_target_env(target: Target, argv: Sequence[str]) -> list[str]:
    """argv as it runs in the target's environment: the folder of its `python:` first on PATH (and
    VIRTUAL_ENV set when that folder is a venv's), as `source VENV/bin/activate` would (a python
    named without a folder, `python3`, is found on PATH already). A command that is not there exits
    127 with NOT_FOUND alone on stderr. It runs in a process group of its own, watched: its stdin
    must be a hold.Hold (at EOF the group is ended)."""
    return ["sh", "-c", _GROUP, "dflash-ops-exec", "sh", "-c", _ACTIVATE, posixpath.dirname(target.python), *argv]


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
            err: Write | None = None, env: Mapping[str, str] | None = None, hold: Hold | None = None,
            keep: int | None = None) -> ExecResult:
    """The command on one target, in its environment (in_target_env). With out/err the output is
    streamed there, else kept: all of it, or with `keep` the first `keep` bytes of each stream (the
    rest counted: stdout_bytes, stderr_bytes). A command not found (exit 127, the shell said so) gets
    `note`. `hold.end(...)` ends the command; without one it has its own, and ends if the controller dies."""
    res = ExecResult(target.name)
    start = time.monotonic()
    kept = Kept(0 if err else keep)                     # stderr when it is kept; counted either way
    tail: collections.deque[bytes] = collections.deque(maxlen=8)    # its last chunks: the "not found" line
    seen = [0]                                          # stdout's bytes, when it is streamed

    def keep_err(data: bytes) -> None:
        kept(data)
        tail.append(data)
        if err:
            err(target.name, data)

    def stream_out(data: bytes) -> None:
        seen[0] += len(data)
        if out:
            out(target.name, data)
    on_err = NotFoundFilter(keep_err)
    try:
        # The container's state first, on its own: pct's refusal must not reach the user's
        # stream as if the command had printed it.
        t = session.transport(target, env=env, check=False)
        if isinstance(t, PctTransport):
            t.check()
        r = t.run(in_target_env(target, argv), stdin=hold or Hold(),
                  stdout=stream_out if out else None, stderr=on_err, keep=keep)
        on_err.flush()
        res.exit_code, res.stdout = r.exit_code, r.stdout
        res.stdout_bytes = seen[0] if out else r.stdout_bytes if r.stdout_bytes is not None else len(r.stdout)
        res.stderr, res.stderr_bytes = (b"" if err else kept.value()), kept.total
        last = b"".join(tail).rstrip().splitlines()[-1:]
        if r.exit_code == 127 and (on_err.found or last and b"not found" in last[0]):
            res.note = not_found_note(target, argv)
        if r.exit_code in (137, 143) and isinstance(t, PctTransport) and (hold is None or hold.line is None):
            t.check(r.exit_code)    # the container stopped under the command: said so, not as its own failure
            # (not asked when this exec ended the command itself: Ctrl-C, SIGTERM, the grace's SIGKILL)
    except OpsError as e:
        res.error = e.render()
    res.seconds = round(time.monotonic() - start, 3)
    return res


def exec_command(inv: Inventory, targets: list[Target], argv: Sequence[str], *, out: Write | None = None,
                 err: Write | None = None, env: Mapping[str, str] | None = None,
                 keep: int | None = None) -> list[ExecResult]:
    """Run argv on every target in parallel; one result per target, in the order given (output not
    streamed is kept as run_one keeps it, `keep`). SIGINT or SIGTERM ends the command on every target
    and raises Interrupted (exit 130 / 143), saying so.

    A daemon thread per target (at most fanout.MAX_WORKERS at work), not fan_out's pool, whose
    threads are joined at exit: an interrupted exec must not wait for a connect still under way."""
    argv = check_command(argv)
    holds = {t.name: Hold() for t in targets}
    finished = {t.name: threading.Event() for t in targets}
    results: dict[str, ExecResult] = {}
    bugs: list[BaseException] = []
    slots = threading.Semaphore(fanout.MAX_WORKERS)
    with owned_session(inv) as session:
        def one(t: Target) -> None:
            try:
                with slots:
                    results[t.name] = run_one(session, t, argv, out=out, err=err, env=env, hold=holds[t.name],
                                             keep=keep)
            except BaseException as e:  # noqa: BLE001 - run_one keeps OpsErrors; anything else is a bug, raised below
                bugs.append(e)
            finally:
                finished[t.name].set()

        with terminated_on_sigterm():
            try:
                for t in targets:
                    threading.Thread(target=one, args=(t,), name=f"exec {t.name}", daemon=True).start()
                for event in finished.values():
                    wait_for_event(event)
            except KeyboardInterrupt as e:      # errors.Terminated for SIGTERM
                raise ended(signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT,
                            holds, finished, results) from None
    if bugs:
        raise bugs[0]
    return [results[t.name] for t in targets]


def ended(signum: signal.Signals, holds: Mapping[str, Hold], finished: Mapping[str, threading.Event],
          results: Mapping[str, ExecResult]) -> Interrupted:
    """Every target's command told to end (the signal's name on its held stdin) and waited for, up to
    ENDING_WAIT_S for all; the one line that says what became of each."""
    deadline = time.monotonic() + ENDING_WAIT_S
    states = dict(zip(holds, tell_all(holds.values(), signum.name[3:], deadline)))
    try:
        for name, state in states.items():
            if state == Hold.RUNNING:
                finished[name].wait(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        pass    # a second signal: no more waiting; what has not answered is said so
    told = [n for n, s in states.items() if s == Hold.RUNNING]
    gone = [n for n in told if finished[n].is_set() and n in results and results[n].exit_code is not None]
    parts = [f"the command was ended on {', '.join(gone)}"] if gone else []
    if unsure := [n for n in told if n not in gone]:
        parts.append(f"not confirmed on {', '.join(unsure)} within {ENDING_WAIT_S} s (it ends there when the node "
                     "sees this connection close)")
    if done := [n for n, s in states.items() if s == Hold.FINISHED]:
        parts.append(f"it had finished on {', '.join(done)}")
    if waiting := [n for n, s in states.items() if s == Hold.WAITING]:
        parts.append(f"not started on {', '.join(waiting)}")
    return Interrupted(signum, f"interrupted ({signum.name}): {'; '.join(parts)}")


def exit_status(results: list[ExecResult]) -> int:
    """One target: its command's exit status (1 when it could not run); several: 1 if any failed."""
    if len(results) == 1:
        r = results[0]
        return r.exit_code if r.exit_code is not None else 1
    return 0 if all(r.ok for r in results) else 1


class Streams:
    """The writers for exec's live output: raw bytes for one target, `[target] ` line prefixes
    (whole lines, under one lock; a line over lines.PIECE bytes in pieces) for several."""

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
