"""Experiment trackers: the run's metric records as TensorBoard event files (OUT/tensorboard/) and,
when asked, a W&B run, beside OUT/metrics.jsonl (docs/runs.md, "Curves: TensorBoard and W&B").

RunLog hands every record it writes to metrics.jsonl to `Trackers.record`, so the trackers see the
same numbers, rounded the same way; `scalars(record)` says which of a record's numbers become which
tag. `--report-to` picks the trackers: `auto` (TensorBoard when the `tensorboard` package is
installed), `none`, or a comma list of `tensorboard` and `wandb`. `check(report_to)` refuses a
tracker asked for whose package is missing, before torch is imported (one line, exit 2). torch and
wandb are imported only when the first record with numbers comes.
"""
from __future__ import annotations

import importlib.util
import math
import netrc
import os
import socket
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

from trainer.errors import UsageError

TRACKERS = ("tensorboard", "wandb")
TB_DIR = "tensorboard"          # OUT/tensorboard/: the event files `dflash-ops tensorboard` brings home
WANDB_DIR = "wandb"             # OUT/wandb/: W&B's own folder (its offline runs)
WANDB_HOST = "https://api.wandb.ai"


def parse(report_to: str) -> tuple[str, ...] | None:
    """The trackers `--report-to` names: None for `auto` (TensorBoard when installed), () for `none`."""
    value = report_to.strip()
    if value == "auto":
        return None
    if value == "none":
        return ()
    names = tuple(n.strip() for n in value.split(","))
    bad = [n for n in names if n not in TRACKERS]
    if bad:
        raise UsageError(f"--report-to {report_to!r}: expected auto, none, or a comma list of "
                         f"{', '.join(TRACKERS)} (e.g. tensorboard,wandb)")
    return tuple(dict.fromkeys(names))


def installed(name: str) -> bool:
    """Whether the package can be imported here, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def check(report_to: str) -> tuple[str, ...]:
    """The trackers this run writes to; UsageError (exit 2) for one asked for whose package is missing.
    Torch-free: the trainer calls it before it imports torch."""
    names = parse(report_to)
    if names is None:
        return ("tensorboard",) if installed("tensorboard") else ()
    for name in names:
        if not installed(name):
            raise UsageError(f"--report-to {name}: the {name} package is not installed in this python "
                             f"(pip install {name}); or leave {name} out of --report-to")
    return names


def scalars(record: dict) -> list[tuple[str, float]]:
    """A metric record's numbers as (tag, value): a step's under train/, an eval's (and the final
    one in `done`) under eval/; lists become one tag per block position (1-based). Other events
    (checkpoint, resume, ...) carry no curve. None (a non-finite number, as metrics.jsonl writes it)
    is left out."""
    event = record.get("event")
    skip: tuple[str, ...]
    if event is None and "loss" in record:
        prefix, skip = "train", ("step",)
    elif event in ("eval", "done") and record.get("acceptance_length") is not None:
        prefix, skip = "eval", ("step", "event", "loss", "steps_trained", "trained_s")
    else:
        return []
    out: list[tuple[str, float]] = []
    for key, value in record.items():
        if key in skip:
            continue
        if key == "tau_ci95" and isinstance(value, (list, tuple)) and len(value) == 2:
            out += [(f"{prefix}/tau_ci95_low", value[0]), (f"{prefix}/tau_ci95_high", value[1])]
        elif isinstance(value, (list, tuple)):
            out += [(f"{prefix}/{key}/{i}", v) for i, v in enumerate(value, start=1)]
        else:
            out.append((f"{prefix}/{'tau' if key == 'acceptance_length' else key}", value))
    return [(tag, float(v)) for tag, v in out
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


class Trackers:
    """Where the records go besides metrics.jsonl. Opened on the first record with numbers (or a
    resume's record, whose step TensorBoard then purges from: the curves continue from the
    checkpoint, as metrics.jsonl's readers do); `info` says a line in the run's log."""

    def __init__(self, names: tuple[str, ...], out: Path, info: Callable[[str], None]):
        self.names, self.out, self.info = names, Path(out), info
        self.tb: Any = None
        self.wandb: Any = None
        self.opened = False
        self.resumed_at: int | None = None

    def record(self, record: dict) -> None:
        if record.get("event") == "resume" and not self.opened:
            # what the interrupted run logged after its checkpoint's step is superseded, as in metrics.jsonl
            self.resumed_at = int(record["step"]) + 1
        pairs = scalars(record)
        if not pairs:
            return
        if not self.opened:
            self._open()
        step = int(record["step"])
        if self.tb is not None:
            for tag, value in pairs:
                self.tb.add_scalar(tag, value, step)
            self.tb.flush()         # a record is on disk when metrics.jsonl has it: live curves, kill -9 safe
        if self.wandb is not None:
            self.wandb.log(dict(pairs), step=step)

    def _open(self) -> None:
        self.opened = True
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(self.out / TB_DIR), purge_step=self.resumed_at)
            self.info(f"TensorBoard event files: {self.out / TB_DIR} (`dflash-ops tensorboard` brings them home)")
        if "wandb" in self.names:
            self.wandb = _wandb_run(self.out, self.out.name, self.info)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            offline = self.wandb.settings.mode == "offline"
            folder = _wandb_folder(self.wandb)
            self.wandb.finish()
            self.wandb = None
            if offline:
                self.info(f"W&B run written offline; send it with: wandb sync {folder}")


def _wandb_run(out: Path, name: str, info: Callable[[str], None]):
    """A W&B run, online only where W&B can be reached with a key; else offline, saying so with the
    `wandb sync` line to run later. WANDB_MODE, when set, decides alone (tests set offline)."""
    import wandb

    mode = os.environ.get("WANDB_MODE") or ""
    why = ""
    if not mode:
        why = _offline_reason()
        mode = "offline" if why else "online"
    (out / WANDB_DIR).mkdir(exist_ok=True)
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dflash"), name=name, dir=str(out), mode=mode)
    if mode == "offline":
        info(f"W&B offline{f' ({why})' if why else ''}: send the run later with: wandb sync {_wandb_folder(run)}")
    else:
        info(f"W&B run {getattr(run, 'url', '') or name}")
    return run


def _wandb_folder(run) -> str:
    """The folder `wandb sync` takes: the run's own (its files/ folder's parent)."""
    return str(Path(run.dir).parent)


def _offline_reason() -> str:
    """Why W&B runs offline here ('' when it can go online): no API key, or its host not reachable."""
    base = os.environ.get("WANDB_BASE_URL", WANDB_HOST)
    host = urlparse(base).hostname or "api.wandb.ai"
    if not os.environ.get("WANDB_API_KEY"):
        try:
            auth = netrc.netrc().authenticators(host)
        except (OSError, netrc.NetrcParseError):
            auth = None
        if not auth:
            return "no W&B API key: WANDB_API_KEY or `wandb login`"
    try:
        socket.create_connection((host, urlparse(base).port or 443), timeout=3).close()
    except OSError as e:
        return f"{host} not reachable: {e.strerror or e}"
    return ""
