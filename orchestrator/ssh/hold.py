"""A command's stdin held open while it runs, and telling held commands to end: the line between
the controller and a command on a target that must end with it (exec's watcher, the export and
bench agents). The transports (transport.py) start a held command through Hold.begin and close it
through Hold.done; an interrupted caller tells its holds through tell_all."""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterable

Sink = Callable[[bytes], None]


class Hold:
    """A command's stdin held open while it runs (`run(argv, stdin=Hold(...))`): `data` is sent first,
    then nothing until the command ends, so that EOF there tells the command its caller is gone (the
    controller killed, timed out, its connection dropped): exec's watcher (targets/exec.py) and the
    bench agent (remote/runs/bench.py) end their work on it.

    - end(line), from another thread: writes the line (none for "") and EOF to the running command,
      once: exec's Ctrl-C sends the signal's name. The transport starts the command through `begin`
      and calls `done` once it has ended, under one lock, so a line goes to a running command only,
      and a command ended before it started is never started.
    - An exception in the thread that runs it (Ctrl-C or errors.Terminated where run() is called in
      the main thread: bench-decode) hangs up first, end(""), and waits up to grace_s for the command
      to end; `ended` then says whether it did, before the exception goes on."""

    WAITING, RUNNING, FINISHED = "waiting", "running", "finished"

    def __init__(self, data: bytes = b"", grace_s: float = 15.0) -> None:
        self.data, self.grace_s = bytes(data), grace_s
        self.ended: bool | None = None
        self.lock = threading.Lock()
        self.state = self.WAITING
        self.line: str | None = None
        self._send: Sink | None = None

    def begin(self, start: Callable[[], None], send: Sink) -> bool:
        """start() the command and keep send(bytes) (write, then EOF) for end(); False, nothing
        started, when end() came first."""
        with self.lock:
            if self.line is not None:
                return False
            start()
            self.state, self._send = self.RUNNING, send
            return True

    def done(self) -> None:
        with self.lock:
            if self.state == self.RUNNING:
                self.state = self.FINISHED
            self._send = None

    def end(self, line: str, timeout: float = 5) -> str:
        """Send `line` (and a newline; nothing for "") and EOF to the running command (once); the state
        it was in: WAITING (now it never starts), RUNNING (told) or FINISHED (it had ended on its own).
        RUNNING, untold, too when the command is still being started after `timeout` s (a connection
        gone silent meanwhile)."""
        if not self.lock.acquire(timeout=timeout):
            return self.RUNNING
        try:
            if self.line is None:
                self.line = line
                if self._send is not None:
                    try:
                        self._send(line.encode() + b"\n" if line else b"")
                    except (OSError, EOFError, ValueError):
                        pass  # the channel or pipe is gone: the command's end is on its way
                    self._send = None
            return self.state
        finally:
            self.lock.release()


def tell_all(holds: Iterable[Hold], line: str, deadline: float) -> list[str]:
    """Every hold told `line` (Hold.end) within one deadline (time.monotonic()); their states, in order.
    An interrupted command's caller calls it from its Ctrl-C handler (exec, play): a Ctrl-C pressed again
    meanwhile does not leave a command untold, that hold is told again (end() is idempotent)."""
    states = []
    for hold in holds:
        while True:
            try:
                states.append(hold.end(line, timeout=max(0.0, deadline - time.monotonic())))
                break
            except KeyboardInterrupt:
                pass
    return states
