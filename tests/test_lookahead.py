"""The next step's target features, made during this step (ThreadEngine.step(..., ahead=next batch)).

The frozen target does not depend on the update, so its forward for step k+1 can run while step
k's gradient sum does (on a GPU the NCCL sum runs on side streams and hides behind it). It must
change nothing: the same losses and weights, bit for bit, as steps without look-ahead; the target
runs once a step, not twice; a prefetched shard that is not the one trained next is recomputed,
never used; and the loop's checkpoints record the loader's position without the look-ahead, so a
resumed run trains on exactly the batches an uninterrupted one does.

The host runs ahead too: ThreadEngine.step returns before the devices have run the step
(PendingStep), the loop reads a step's results after queuing the next, and a non-finite gradient
norm is caught before the NEXT update is queued, so it still leaves the weights as they were.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from tiny_engine import tiny_engine
from trainer.model import masks
from trainer.train.setup import Prepared
from trainer.train.batches import Batches
from trainer.engine.adamw import CompiledUpdate
from trainer.run.config import TrainConfig
from trainer.run.data import Loader, Sample
from trainer.errors import TrainerError

STEPS = 4


def _train(lookahead: bool, workers: int = 1, swap_last: bool = False, read_late: bool = False):
    """STEPS steps; with lookahead each step is given the next batch. swap_last: the batch prefetched
    for the last step is not the one that step trains on. read_late: every step's results are read
    after the last step is queued (else each right after its own step)."""
    calls = []

    def count_forwards(target):
        features = target.features

        def counted(ids, **kw):
            calls.append(tuple(ids.shape))
            return features(ids, **kw)

        target.features = counted

    tiny = tiny_engine(workers, target_hook=count_forwards)
    engine = tiny.engine
    batches = tiny.batches(STEPS)
    decoy = tiny.batches(1, seed=99)[0]
    pending = []
    try:
        for step, batch in enumerate(batches):
            ahead = None
            if lookahead and step + 1 < STEPS:
                ahead = decoy if swap_last and step + 2 == STEPS else batches[step + 1]
            pending.append(engine.step(batch, step, 1e-3, 1.0, ahead=ahead))
            if not read_late:
                pending[-1].result()
        losses = [p.result().loss_sum for p in pending]
        engine.check_replicas(STEPS)
        return tiny.start, tiny.weights(), losses, len(calls)
    finally:
        engine.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_lookahead_trains_the_same_bits_with_one_target_forward_a_step(workers):
    start, plain, loss_plain, calls_plain = _train(False, workers)
    _, ahead, loss_ahead, calls_ahead = _train(True, workers)
    assert loss_ahead == loss_plain
    assert all(torch.equal(a, b) for a, b in zip(plain, ahead))
    assert min(float((a - s).abs().max()) for a, s in zip(ahead, start)) > 0, "nothing trained: equality proves nothing"
    assert calls_plain == calls_ahead == STEPS * workers  # prefetched features were used, not recomputed


def test_features_prefetched_for_another_batch_are_not_used():
    _, plain, loss_plain, _ = _train(False)
    _, swapped, loss_swapped, calls = _train(True, swap_last=True)
    assert loss_swapped == loss_plain and all(torch.equal(a, b) for a, b in zip(plain, swapped))
    assert calls == STEPS + 1  # the decoy's forward was made, thrown away, and the real shard's computed


def test_batches_state_has_no_lookahead():
    """The loader position a checkpoint records after step k is the one without look-ahead, and a
    loop resumed from it draws the batch an uninterrupted loop trains next."""
    samples = [Sample(tuple(range(i, i + 40)), (1,) * 40) for i in range(7)]
    cfg = TrainConfig(steps=6, batch_size=2, seed=3, block_size=16, anchors=2)
    prep = Prepared(None, None, None, samples, [], 40, masks.position_weights(16, 7.0), None, None, 0.0,
                          anchors=cfg.anchors)
    plain, batches = Loader(len(samples), 3), Batches(cfg, prep, Loader(len(samples), 3))
    seen = []
    states = []
    for step in range(cfg.steps):
        seen.append(batches.take(step).input_ids)
        nxt = batches.peek(step + 1)
        assert (nxt is None) == (step + 1 == cfg.steps)
        assert batches.peek(step + 1) is nxt  # drawn once, kept for take(step + 1)
        plain.next(cfg.batch_size)
        states.append(dict(batches.state()))
        assert states[-1] == plain.state()
    resumed_loader = Loader(len(samples), 3)
    resumed_loader.load_state(json.loads(json.dumps(states[2])))  # as a checkpoint stores it
    resumed = Batches(cfg, prep, resumed_loader)
    for step in range(3, cfg.steps):
        resumed.peek(step)
        assert torch.equal(resumed.take(step).input_ids, seen[step])


@pytest.mark.parametrize("workers", [1, 2])
def test_results_read_a_step_late_are_the_same(workers):
    start, now, loss_now, _ = _train(True, workers)
    _, late, loss_late, _ = _train(True, workers, read_late=True)
    assert loss_late == loss_now and len(set(loss_now)) == STEPS
    assert all(torch.equal(a, b) for a, b in zip(now, late))
    assert min(float((a - s).abs().max()) for a, s in zip(late, start)) > 0, "nothing trained: equality proves nothing"


def test_a_non_finite_norm_raises_before_the_next_update_and_changes_nothing():
    """The update whose norm stays on the device (the compiled update, uncompiled here) skips
    itself when the norm is not finite; the host learns of it at the next step, which raises after
    queuing its forward and backward but before its update: the weights and the optimizer's state
    are those of the last good step."""
    poison = {"on": False}

    def configure(r):
        r.update = CompiledUpdate(r.optimizer, r.params, compiled=False)
        r.params[0].register_hook(lambda g: g * float("nan") if poison["on"] else g)

    tiny = tiny_engine(configure=configure)
    engine = tiny.engine
    batches = tiny.batches(3, rows=2)
    try:
        r = engine.primary
        engine.step(batches[0], 0, 1e-3, 1.0).result()
        good = [p.detach().clone() for p in r.params]
        state = copy.deepcopy(r.optimizer.state_dict())
        poison["on"] = True
        bad = engine.step(batches[1], 1, 1e-3, 1.0)  # queued; its update skipped itself
        poison["on"] = False
        with pytest.raises(TrainerError, match="gradient norm is nan at step 1"):
            engine.step(batches[2], 2, 1e-3, 1.0)
        with pytest.raises(TrainerError, match="at step 1"):
            bad.result()  # the same error for whoever reads the step
        assert all(torch.equal(p.detach(), w) for p, w in zip(r.params, good))
        after = r.optimizer.state_dict()["state"]
        for k, v in state["state"].items():
            for name, t in v.items():
                assert torch.equal(after[k][name], t), (k, name)
    finally:
        engine.close()
