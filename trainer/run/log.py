"""The run log: readable lines plus one JSON object per line for metrics, flushed line by line.

Every JSON line goes to stdout (the run's log, what `dflash-ops logs` follows) and is appended to
OUT/metrics.jsonl (what `dflash-ops report` plots), and to the run's trackers (TensorBoard, W&B:
trainer/run/trackers.py) when it has them. Readable lines start with `[trainer]` so they
never parse as JSON. Standard library only: the controller reads TWINNED and tau_text from here
(through trainer/controller_view.py).
"""
from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

# The JSON events the trainer also writes as a line of text (a [trainer] line, or its error's
# line): `dflash-ops logs` on a terminal shows each of them once, by its text (the controller
# imports this name; this module stays free of torch).
TWINNED = ("eval", "done", "resume", "worker_ready", "compile_guard", "worker_hung", "worker_failed", "diverged")


class RunLog:
    """[trainer] lines and JSON metrics on stdout (and appended to metrics_path). On a terminal (a
    trainer run by hand) the stream is for a person: each record once, as text; a record with a text
    twin (a step's line, TWINNED events) is not printed again as JSON, and any other is written as a
    line of text. The run's metrics.jsonl always has every record, and `trackers` (an object with
    record(dict) and close(), trainer/run/trackers.Trackers) gets each as metrics.jsonl has it."""

    def __init__(self, metrics_path: Path | None = None, stream: TextIO | None = None, trackers=None):
        self.stream = stream or sys.stdout
        self.metrics_path = metrics_path
        self.trackers = trackers
        isatty = getattr(self.stream, "isatty", None)
        self.human = bool(isatty and isatty())

    def info(self, text: str) -> None:
        print(f"[trainer] {text}", file=self.stream, flush=True)

    def metrics(self, record: dict) -> None:
        clean = {k: _clean(v) for k, v in record.items()}
        line = json.dumps(clean, allow_nan=False)
        if not self.human:
            print(line, file=self.stream, flush=True)
        elif "event" in record and record["event"] not in TWINNED:
            self.info(f"{record['event']}: " + ", ".join(f"{k} {_shown(v)}" for k, v in record.items() if k != "event"))
        if self.metrics_path is not None:
            with self.metrics_path.open("a") as f:
                f.write(line + "\n")
        if self.trackers is not None:
            self.trackers.record(clean)

    def close(self) -> None:
        """Close the trackers (their last events written); the log itself needs no closing."""
        trackers, self.trackers = self.trackers, None
        if trackers is not None:
            trackers.close()


def _shown(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


class QuietLog(RunLog):
    """Logs nothing of its own (a rank other than 0, a probe case); errors still reach stderr."""

    def info(self, text: str) -> None:
        pass

    def metrics(self, record: dict) -> None:
        pass


HEARTBEAT_S = float(os.environ.get("DFLASH_HEARTBEAT_S", "20"))   # the env var is for tests


class heartbeat:
    """Says a long silent phase is still going: while the `with` block runs, one line every
    `every` seconds (`[trainer] still compiling worker 0 (45 s)`), so a 70 s compile or minutes of
    data generation never look like a hang. Nothing is printed for a phase shorter than `every`."""

    def __init__(self, log: RunLog, what: str, every: float | None = None):
        self.log, self.what = log, what
        self.every = HEARTBEAT_S if every is None else every
        self._done = threading.Event()

    def __enter__(self) -> "heartbeat":
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._done.wait(self.every):
            self.log.info(f"still {self.what} ({time.monotonic() - self._start:.0f} s)")

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def _clean(v):
    """JSON has no NaN/inf: write them as null (a diverged loss is visible as null plus an error)."""
    if isinstance(v, float):
        return round(v, 6) if math.isfinite(v) else None
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def step_line(m: dict, steps: int) -> str:
    """The readable twin of a step's JSON line."""
    acc = m["accuracy"]
    k1 = m["acc_per_position"][0] if m["acc_per_position"] else float("nan")
    parts = [f"step {m['step']}/{steps}", f"loss {m['loss']:.4f}", f"acc {acc:.3f} (k=1 {k1:.3f})",
             f"lr {m['lr']:.2e}", f"gnorm {m['grad_norm']:.3f}", f"{m['tokens_per_s']:.0f} tok/s",
             f"{m['samples_per_s']:.2f} samples/s"]
    if m.get("mfu") is not None:
        parts.append(f"mfu {100 * m['mfu']:.1f}%")
    if m.get("steps_per_s"):
        parts.append(f"{clock(m['elapsed_s'])} elapsed, {m['steps_per_s']:.3g} steps/s, eta {clock(m['eta_s'])}")
    return " | ".join(parts)


def clock(seconds: float) -> str:
    """Seconds as a person reads a duration: 45s, 12:05, 3:02:10, 2d 04:10:00."""
    s = max(0, int(round(seconds)))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d {h:02d}:{m:02d}:{s:02d}"
    if h:
        return f"{h}:{m:02d}:{s:02d}"
    return f"{m}:{s:02d}" if m else f"{s}s"


def tau_text(tau: float, ci=None, rounds: int | None = None, *more: str, digits: int = 3) -> str:
    """tau (the acceptance length) and what it rests on, as every program here writes it:
    `2.345 (95% 2.201-2.489, 812 rounds)`. The interval is left out where there is none (fewer than
    two rounds); `more` (`8 held-out prompts`) goes inside the parentheses after the rounds."""
    parts = [f"95% {ci[0]:.{digits}f}-{ci[1]:.{digits}f}"] if ci else []
    if rounds is not None:
        parts.append(f"{rounds} round{'' if rounds == 1 else 's'}")
    parts += more
    return f"{tau:.{digits}f}" + (f" ({', '.join(parts)})" if parts else "")


def eval_line(res: dict, overlap: int = 0) -> str:
    """An eval's readable summary: tau, its 95% interval and rounds, the prompts (held out, or how
    many are training rows' prompts), the acceptance rate per block position."""
    rates = res.get("accept_rate_by_position") or []
    prompts = (f"{res['prompts']} prompts, {overlap} of them training rows' prompts" if overlap
               else f"{res['prompts']} held-out prompts")
    by_pos = " ".join("-" if r is None else f"{r:.2f}" for r in rates)
    return (f"tau {tau_text(res['acceptance_length'], res.get('tau_ci95'), res['rounds'], prompts)}; "
            f"acceptance by block position 1..{len(rates)}: {by_pos}")
