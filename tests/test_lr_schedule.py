"""trainer/train/lr_schedule.py: the learning rate the loop sets at each step."""
import math

import pytest

from trainer.train.lr_schedule import lr_at


def test_warmup_rises_linearly_to_lr_then_the_cosine_falls_towards_min_lr():
    kw = dict(steps=100, lr=1e-3, min_lr=1e-4, warmup=0.04)      # 4 warmup steps
    assert [lr_at(s, **kw) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lr_at(4, **kw) == pytest.approx(1e-3)                   # the cosine starts at the peak
    assert lr_at(4 + 48, **kw) == pytest.approx(0.55e-3)           # half way: the mean of lr and min_lr
    assert lr_at(100, **kw) == pytest.approx(1e-4)                 # reached one past the last step
    lrs = [lr_at(s, **kw) for s in range(4, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:])) and lrs[-1] > 1e-4


def test_no_warmup_starts_at_lr_and_a_tiny_fraction_still_warms_one_step():
    assert lr_at(0, steps=10, lr=2.0, min_lr=0.0, warmup=0.0) == 2.0
    assert lr_at(0, steps=10, lr=2.0, min_lr=0.0, warmup=0.001) == 2.0   # round() gives 0: one step, full lr
    assert lr_at(5, steps=10, lr=2.0, min_lr=0.0, warmup=0.0) == pytest.approx(1.0)


def test_past_the_end_stays_at_min_lr_and_one_step_runs_are_finite():
    assert lr_at(500, steps=100, lr=1.0, min_lr=0.1, warmup=0.1) == pytest.approx(0.1)
    assert math.isfinite(lr_at(0, steps=1, lr=1.0, min_lr=0.0, warmup=0.5))
