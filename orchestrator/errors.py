"""Errors that carry data and render themselves.

Library code raises these; only `cli.py` turns them into a one-line message and an exit code.
Anything else that escapes is a bug and shows a traceback only under `--debug`.
"""
from __future__ import annotations

import contextlib
import queue
import signal
import threading
from typing import Iterator

# Exit codes in one place (README "Exit codes").
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_RUN_FAILED = 100
EXIT_RUN_RUNNING = 101
EXIT_NOT_FOUND = 102
EXIT_RUN_STOPPED = 103
EXIT_RUN_LOST = 104     # the run ended with its container (stopped or restarted under it): `lost`


class OpsError(Exception):
    """Base of every expected failure. `str(err)` is the one line a user sees."""

    exit_code = EXIT_FAILED

    def render(self) -> str:
        return str(self)


class UsageError(OpsError):
    """Bad input from the user: options, files, names."""

    exit_code = EXIT_USAGE


class FileError(UsageError):
    """A mistake in a file the user wrote (hosts.yaml, a playbook): `FILE:LINE: KEY: message`."""

    def __init__(self, file: str, line: int | None, key: str | None, message: str):
        self.file, self.line, self.key, self.message = file, line, key, message
        where = file if line is None else f"{file}:{line}"
        super().__init__(f"{where}: {key + ': ' if key else ''}{message}")


# hosts.yaml's errors are FileErrors; the name stays for the code and tests that use it.
InventoryError = FileError


class NotFound(OpsError):
    exit_code = EXIT_NOT_FOUND


class ConnectError(OpsError):
    """Could not reach a host (DNS, refused, timeout, auth). `where` (`user@address:port` and the
    jump hosts crossed, `via ...`) goes into the message; `reason` is kept for the callers that
    judge it (a failed authentication is not retried)."""

    def __init__(self, host: str, reason: str, where: str | None = None):
        self.host, self.reason = host, reason
        super().__init__(f"{host}: cannot connect{' to ' + where if where else ''}: {reason}")


class HostKeyError(ConnectError):
    """The host's key is unknown or changed: we never accept it silently."""

    def __init__(self, host: str, reason: str):
        ConnectError.__init__(self, host, reason)
        self.args = (f"{host}: {reason}",)


class Interrupted(OpsError):
    """The controller got SIGINT or SIGTERM and ended what it had started: exit 128 + the signal's
    number (130, 143), as a shell reports a command killed by it, with one line saying what was ended."""

    def __init__(self, signum: int, message: str):
        self.signum, self.exit_code = int(signum), 128 + int(signum)
        super().__init__(message)


class ConnectionLost(OpsError):
    def __init__(self, host: str, detail: str = "connection dropped"):
        self.host = host
        super().__init__(f"{host}: {detail}")


class ContainerError(OpsError):
    """pct refused: the container is stopped, unknown, or pct itself is missing."""

    def __init__(self, target: str, vmid: int, message: str, state: str | None = None, under: int | None = None):
        self.target, self.vmid, self.message = target, vmid, message
        self.state = state      # pct status's word (stopped, ...) when pct answered one
        self.under = under      # the exit (137, 143) of a command the container went down under
        super().__init__(f"{target}: container {vmid}: {message}")


class StepFailed(OpsError):
    def __init__(self, target: str, command: str, exit_code: int, stderr_tail: str = ""):
        self.target, self.command, self.exit_code_remote = target, command, exit_code
        self.stderr_tail = stderr_tail
        tail = stderr_tail.strip().splitlines()[-1:] if stderr_tail else []
        detail = f": {tail[0]}" if tail else ""
        super().__init__(f"{target}: {command} exited {exit_code}{detail}")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is (terminated_on_sigterm), so that
    a command ended by `timeout` or `kill` runs the same finally blocks and hang-up (hold.Hold)."""


@contextlib.contextmanager
def terminated_on_sigterm() -> Iterator[None]:
    """While the body runs, SIGTERM raises Terminated in the main thread (by default it would end the
    controller where it stands); called from another thread, where no handler can be set, nothing
    changes. ui.sigterm_raises turns it into the command's one line; exec says more itself."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise Terminated()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)


SIGNAL_POLL_S = 0.2


def wait_for_event(event: threading.Event) -> None:
    """event.wait() for the main thread, in slices of SIGNAL_POLL_S, so that Ctrl-C and SIGTERM still
    reach it. The kernel hands a process's signal to any of its threads that does not block it; the
    interpreter then runs the Python handler in the main thread the next time that thread runs Python
    code. A main thread in one unbounded wait runs none until the event is set: an interrupted exec sat
    out its command (seen under load, the signal taken by a thread reading the command's output)."""
    while not event.wait(SIGNAL_POLL_S):
        pass


def get_from(items: queue.Queue):
    """items.get() in slices, for the reason wait_for_event gives (a follow's main thread waits on its
    nodes' lines)."""
    while True:
        try:
            return items.get(timeout=SIGNAL_POLL_S)
        except queue.Empty:
            pass


def join_thread(thread: threading.Thread) -> None:
    """thread.join() in slices, for the reason wait_for_event gives (a transport's run() may be called
    from the main thread: bench-decode)."""
    while thread.is_alive():
        thread.join(SIGNAL_POLL_S)


class TargetsFailed(OpsError):
    """A fan-out where some targets failed; results are still reported."""

    def __init__(self, failures: dict[str, str]):
        self.failures = failures
        names = ", ".join(sorted(failures))
        super().__init__(f"failed on {len(failures)} target(s): {names}")
