"""The run log: readable lines plus one JSON object per line for metrics, flushed line by line.

Every JSON line goes to stdout (the run's log, what `dflash-ops logs` follows) and is appended to
OUT/metrics.jsonl (what `dflash-ops report` plots). Readable lines start with `[trainer]` so they
never parse as JSON.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TextIO


class RunLog:
    def __init__(self, metrics_path: Path | None = None, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self.metrics_path = metrics_path

    def info(self, text: str) -> None:
        print(f"[trainer] {text}", file=self.stream, flush=True)

    def metrics(self, record: dict) -> None:
        line = json.dumps({k: _clean(v) for k, v in record.items()}, allow_nan=False)
        print(line, file=self.stream, flush=True)
        if self.metrics_path is not None:
            with self.metrics_path.open("a") as f:
                f.write(line + "\n")


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
    return " | ".join(parts)
