"""A rank ends on SIGTERM wherever it waits (topology processes).

StopGrace: the loop checkpoints at the next step boundary, as before; a rank that reaches
none within max(STOP_GRACE_S, 3 x the longest step-to-step time measured so far), blocked in a
collective or outside a step, logs why and exits 143 without a checkpoint. Python runs a signal's
handler only when the main thread returns from C++, so the signal reaches the grace thread through
the interpreter's wakeup fd, which its C handler writes at once.

A rank that works alone (writes a checkpoint, evaluates) pauses the deadline; the ranks that wait for
it in the next agreement are excused until that step boundary, as every rank knows the work is due.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

from trainer.errors import EXIT_SIGTERM
from trainer.exits import exit_process

POLL_S = 1.0          # how often a deadline that passed during a rank's own work looks again
STOP_GRACE_S = 30.0   # SIGTERM's least grace (DFLASH_STOP_GRACE_S changes it)
STOP_GRACE_MAX_S = 240.0  # below torchrun's wait before it SIGKILLs the ranks (distributed.SHUTDOWN_TIMEOUT)


class StopGrace:
    """How long a rank may take from SIGTERM to its next step boundary, measured from its own steps;
    past it the rank exits 143 (nothing to save that a step boundary would not have saved)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.least = float(os.environ.get("DFLASH_STOP_GRACE_S") or STOP_GRACE_S)
        self.longest = 0.0
        self._last: float | None = None
        self._held = threading.Event()
        self._armed = threading.Event()
        self._busy = 0
        self._excused = False

    def boundary(self) -> None:
        """A step boundary (the ranks' agreement on SIGTERM): the longest stretch between two, not
        counting one that was excused (a step and a checkpoint or eval is no step's time)."""
        now = time.monotonic()
        if self._last is not None and not self._excused:
            self.longest = max(self.longest, now - self._last)
        self._last, self._excused = now, False

    def excuse_until_boundary(self) -> None:
        """A rank works alone before the next step boundary (a checkpoint, an eval) and this one may
        wait for it there: no deadline passes until that boundary, where the ranks agree on the stop.
        Every rank calls it where such work is due (each knows the step's plan)."""
        self._excused = True

    def seconds(self) -> float:
        return min(STOP_GRACE_MAX_S, max(self.least, 3 * self.longest))

    @contextmanager
    def busy(self):
        """This rank works alone (writes a checkpoint, evaluates): a deadline that passes meanwhile
        starts again when the work ends."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1

    def hold(self) -> None:
        """The ranks agreed to stop: they checkpoint and leave together; no deadline."""
        self._held.set()

    @contextmanager
    def watching(self):
        """While the rank runs: SIGTERM (its handler installed by the caller) starts the deadline."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._wait_for_sigterm, args=(r,), name="dflash-sigterm", daemon=True).start()
        try:
            yield
        finally:
            signal.set_wakeup_fd(previous)
            os.close(w)     # the thread's read returns b"" and it ends

    def _wait_for_sigterm(self, r: int) -> None:
        try:
            while True:
                got = os.read(r, 64)
                if not got:
                    return
                if signal.SIGTERM in got and not self._armed.is_set():
                    self._armed.set()
                    threading.Thread(target=self._expire, args=(self.seconds(),), daemon=True).start()
        finally:
            os.close(r)

    def _expire(self, seconds: float) -> None:
        while not self._held.wait(seconds):
            if not (self._busy or self._excused):
                break
            while (self._busy or self._excused) and not self._held.is_set():
                time.sleep(POLL_S)
        if self._held.is_set():
            return
        print(f"[trainer] rank {self.rank}: no step boundary within {seconds:.0f} s of SIGTERM (blocked in a "
              f"collective or outside a step): exiting {EXIT_SIGTERM} without a checkpoint", file=sys.stderr,
              flush=True)
        exit_process(EXIT_SIGTERM, finalize=False)
