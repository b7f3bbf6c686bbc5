"""What command bodies share: the invocation's State, --json and emit, tables, progress bars,
colour. No library logic here."""
from __future__ import annotations

import json
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import click

from orchestrator import inventory as inv_mod
from orchestrator.errors import Interrupted, Terminated, terminated_on_sigterm

LARGE_TRANSFER = 4 << 20   # show a progress bar past 4 MiB


class State:
    def __init__(self, inventory: str | None, debug: bool, ssh_config: str | None = None):
        self.inventory_path, self.debug, self.ssh_config = inventory, debug, ssh_config
        self._inv: inv_mod.Inventory | None = None

    @property
    def inv(self) -> inv_mod.Inventory:
        if self._inv is None:
            self._inv = inv_mod.load(self.inventory_path, ssh_config=self.ssh_config)
        return self._inv


def json_option(f):
    """Every command takes --json: one JSON document on stdout, nothing else there."""
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")(f)


@contextmanager
def sigterm_raises(what: str) -> Iterator[None]:
    """While the body runs, SIGTERM (`timeout`, `kill`) raises errors.Terminated in the main thread as
    Ctrl-C raises KeyboardInterrupt, so that both run the body's finally blocks (and a held stdin's hang-up,
    hold.Hold) instead of ending the process where it stands. Either one escaping the body ends
    the command in one line, `WHAT interrupted (SIGINT)`, exit 130 (143 for SIGTERM); the body may raise its
    own errors.Interrupted that says more."""
    try:
        with terminated_on_sigterm():
            yield
    except KeyboardInterrupt as e:
        signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
        raise Interrupted(signum, f"{what} interrupted ({signum.name})") from None


def emit(as_json: bool, doc, text: str) -> None:
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))
    else:
        click.echo(text)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*headers).rstrip()]
    lines += [fmt.format(*r).rstrip() for r in cells]
    return "\n".join(lines)


def size_text(n: float) -> str:
    """A byte count as a person reads it: `512 B`, `11.8 MiB`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def colour(text: str, code: str, stream=None) -> str:
    stream = stream or sys.stdout
    if not getattr(stream, "isatty", lambda: False)():
        return text
    return f"\x1b[{code}m{text}\x1b[0m"


def progress_bars() -> Callable[[str, int], Callable[[int], None] | None]:
    """A factory the library calls per target transfer: a tqdm bar on stderr when it is large."""
    lock = threading.Lock()
    position = [0]

    def make(target: str, total: int):
        if total < LARGE_TRANSFER:
            return None
        from tqdm import tqdm
        with lock:
            pos = position[0]
            position[0] += 1
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=target, position=pos,
                   file=sys.stderr, leave=True, mininterval=0.2)

        def update(n: int) -> None:
            bar.update(n)
            if bar.n >= total:
                bar.close()
        return update

    return make
