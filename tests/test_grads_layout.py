"""Where a replica's gradients live (ThreadEngine.grads): FlatGrads buffers or each parameter's own.

Own gradients save two passes a step (zeroing the flat buffers, and backward's in-place add into
them); they must give exactly the update the flat buffers give. One worker: bit-identical weights
after several steps either way, and different from the start (a frozen model would pass the
equality alone). Two CPU workers share the CPU, so their sum is the copy-based one, which needs
the flat buffers: the engine gives them whatever `grads` says."""
from __future__ import annotations

import pytest
import torch

from tiny_engine import tiny_engine
from trainer.engine.step import FlatGrads

STEPS = 3


def _train(grads: str, workers: int = 1):
    tiny = tiny_engine(workers)
    engine = tiny.engine
    engine.grads = grads  # "flat" or "auto" (each parameter's own gradient unless the copy-sum needs flat)
    layouts = []
    try:
        for step, batch in enumerate(tiny.batches(STEPS)):
            engine.step(batch, step, 1e-3, 1.0)
            layouts.append([r.grads for r in engine.replicas])
        engine.check_replicas(STEPS)
        return tiny.start, tiny.weights(), engine.primary, layouts
    finally:
        engine.close()


def test_own_gradients_give_the_flat_buffers_update_bit_for_bit():
    start, flat, r_flat, lay_flat = _train("flat")
    _, own, r_own, lay_own = _train("auto")
    assert all(isinstance(x[0], FlatGrads) for x in lay_flat)
    assert all(x == [None] for x in lay_own)
    flat_ptrs = {v.data_ptr() for _, v in r_flat.grads.views}
    assert all(p.grad.data_ptr() in flat_ptrs for p in r_flat.params)
    assert all(p.grad._base is None for p in r_own.params)  # backward's own tensors, no views of a buffer
    assert len(flat) == len(own) and all(torch.equal(a, b) for a, b in zip(flat, own))
    moved = [float((a - s).abs().max()) for a, s in zip(own, start)]
    assert min(moved) > 0, "a parameter did not train: the equality above would prove nothing"


@pytest.mark.parametrize("grads", ["auto", "flat"])
def test_the_copy_sum_gets_flat_buffers_whatever_grads_says(grads):
    _, _, _, layouts = _train(grads, workers=2)
    assert all(all(isinstance(g, FlatGrads) for g in step) for step in layouts)


def test_auto_leaves_one_replica_its_own_gradients():
    _, _, r, layouts = _train("auto")
    assert all(x == [None] for x in layouts)
    assert all(p.grad is not None for p in r.params)  # every parameter got a gradient (zeros at the least)
