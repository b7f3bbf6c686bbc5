"""Who hears that a call is still waiting on its target: nothing ever waits in silence.

Library code never prints (docs/architecture.md); a call to a target that takes longer than NOTE_S
calls `note(target, what, seconds)` every NOTE_S until it returns, and the CLI sets `note` to a line on
stderr (`dflash-ops: ct200: still waiting on the target to launch the run (20 s)`). Stdlib only, no
imports from the package: any layer may use it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

NOTE_S = 20.0
note: Callable[[str, str, float], None] | None = None


@contextmanager
def noted(target: str, what: str) -> Iterator[None]:
    """While the block runs: note(target, what, seconds so far) every NOTE_S, from a daemon thread."""
    hear = note
    if hear is None:
        yield
        return
    done, start = threading.Event(), time.monotonic()

    def beat() -> None:
        while not done.wait(NOTE_S):
            hear(target, what, time.monotonic() - start)

    threading.Thread(target=beat, name="dflash-waits", daemon=True).start()
    try:
        yield
    finally:
        done.set()
