"""A clock for tests of code that times things (a grace, a judge, a heartbeat): time moves only when
the code under test waits, so what it decides depends on the times the test sets, never on how busy
the machine is. The code's `time` module is replaced by `clock.module()` (monotonic, sleep) and its
threading.Event by `clock.event()`; what another thread would do meanwhile (a call that starts or
ends, a stall, the ranks' agreement) is scheduled with `clock.at(t, fn)` and runs when the waiting
code's clock passes t. The code runs in the test's own thread: nothing races.

Times that the test compares exactly are sums of binary fractions (0.25, 0.5, ...), which floats add
without rounding.
"""
from __future__ import annotations

import heapq
import itertools
from types import SimpleNamespace
from typing import Callable


class FakeClock:
    def __init__(self, start: float = 100.0):
        self.now = start
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """fn() when the clock reaches t (in the order scheduled, for equal t)."""
        heapq.heappush(self._due, (t, next(self._order), fn))

    def advance(self, seconds: float, until: Callable[[], bool] = lambda: False) -> None:
        """Move the clock by `seconds`, running what falls due on the way; stop early, at the time of
        the scheduled call that made until() true. A scheduled call may move the clock itself (a stall)."""
        end = self.now + seconds
        while self._due and self._due[0][0] <= end:
            t, _, fn = heapq.heappop(self._due)
            self.now = max(self.now, t)
            fn()
            end = max(end, self.now)
            if until():
                return
        self.now = end

    def module(self) -> SimpleNamespace:
        """What the code under test calls as `time`."""
        return SimpleNamespace(monotonic=self.monotonic, sleep=self.sleep)

    def event(self) -> FakeEvent:
        return FakeEvent(self)


class FakeEvent:
    """threading.Event on the fake clock: wait(timeout) moves the clock until the event is set (by a
    scheduled call) or the timeout has passed."""

    def __init__(self, clock: FakeClock):
        self.clock, self._set = clock, False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True

    def clear(self) -> None:
        self._set = False

    def wait(self, timeout: float | None = None) -> bool:
        if not self._set:
            if timeout is None:
                raise AssertionError("an untimed wait on the fake clock would never end")
            self.clock.advance(timeout, until=self.is_set)
        return self._set
