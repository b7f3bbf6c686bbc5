"""The learning-rate schedule: what the loop sets the optimiser's lr to at each step (torch-free)."""
from __future__ import annotations

import math


def lr_at(step: int, *, steps: int, lr: float, min_lr: float, warmup: float) -> float:
    """The lr of 0-based `step` of `steps`: linear warmup over round(warmup * steps) steps (at
    least one when warmup > 0) up to `lr`, then cosine from `lr` towards `min_lr`, which it reaches
    at step `steps` (one past the last; the last step's lr sits just above it)."""
    n_warm = max(1, round(warmup * steps)) if warmup > 0 else 0
    if step < n_warm:
        return lr * (step + 1) / n_warm
    span = max(1, steps - n_warm)
    t = min(1.0, (step - n_warm) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * t))


__all__ = ["lr_at"]
