"""What a target's steps run with: `PlayOnTarget`, one target's play under way (its inventory, connection, target,
templates' context, live lines, and the step it is at), and `Ending`, the play's interrupt that all
its targets share. run.py makes them and runs the steps; actions.py's steps take their commands'
held stdin (hold.Hold) through `PlayOnTarget.ending`, so an interrupted play ends them on the target.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from orchestrator.inventory import Inventory, Target
from orchestrator.play import templating as tpl
from orchestrator.ssh.session import Session
from orchestrator.ssh.hold import Hold, tell_all

OnLine = Callable[[str, str], None]      # (target, text) -> None; text: a line, or lines joined by \n
ENDING_WAIT_S = 5.0     # how long an interrupted play waits for its steps' commands to end (exec's wait)


class Ending:
    """A play's interrupt, shared by its targets: the held stdin (hold.Hold) of every step command
    under way is told the signal's name once end() is called (exec's watcher then ends its process
    group); a hold made after that never starts its command."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holds: dict[Hold, PlayOnTarget] = {}
        self.signal: str | None = None
        self.event = threading.Event()      # set by end(): a wait-for stops waiting

    @contextlib.contextmanager
    def hold(self, run: PlayOnTarget) -> Iterator[Hold]:
        h = Hold()
        with self.lock:
            told = self.signal
            if told is None:
                self.holds[h] = run
        if told is not None:
            h.end(told)
        try:
            yield h
        finally:
            with self.lock:
                self.holds.pop(h, None)

    def end(self, name: str) -> None:
        """Tell every command under way, within ENDING_WAIT_S (a Ctrl-C pressed again meanwhile leaves
        none untold: hold.tell_all)."""
        with self.lock:
            if self.signal is None:
                self.signal = name
            held = list(self.holds.items())
        self.event.set()
        states = tell_all([h for h, _ in held], self.signal, time.monotonic() + ENDING_WAIT_S)
        for (_, run), state in zip(held, states):
            if state == Hold.RUNNING:
                run.told = True


@dataclass
class PlayOnTarget:
    """One target's play: where it runs and what its templates see."""
    inv: Inventory
    session: Session
    target: Target
    ctx: tpl.Context
    on_line: OnLine
    ending: Ending = field(default_factory=Ending)
    at: int | None = None       # the step under way or next (its index); None once the target's play ended
    busy: bool = False          # step `at` was entered (under way, or ended by the interrupt)
    told: bool = False          # its command was told to end by the interrupt

    def say(self, text: str) -> None:
        """A live line (or several, joined by newlines: each is shown led by the target's name)."""
        self.on_line(self.target.name, text)
