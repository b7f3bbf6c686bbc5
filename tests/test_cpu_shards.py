"""The small target's CPU step in shards (trainer/run/cpu_shards.py): its gradient is the whole batch's,
and its bits do not depend on how many worker threads ran the shards.

The reference is the plain step in float64 on identical weights and rows; the tolerance is the plain
float32 step's own distance from it (its rounding noise), with room for a different summation order.
A sharded step that dropped a shard or forgot to weigh the shards' means lands ~50% away.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainer.run import small_target as small_lm  # noqa: E402
from trainer.run.cpu_shards import ShardedGrads  # noqa: E402


def _model(dtype=torch.float32):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(small_lm.model_config(small_lm.RECIPES["smoke"], 384)).to(dtype)


def _loss_of(model):
    def loss_of(rows):
        logits = model(input_ids=rows[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
    return loss_of


def _rows():
    return torch.randint(0, 384, (8, 33), generator=torch.Generator().manual_seed(1))


def _plain(model, rows):
    model.zero_grad(set_to_none=True)
    loss = _loss_of(model)(rows.to(torch.long))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _sharded(model, rows, **kw):
    with ShardedGrads(list(model.parameters()), **kw) as grads:
        loss = grads(rows, _loss_of(model))
    return loss, [p.grad.clone() for p in model.parameters()]


def _error(got, ref):
    """The largest elementwise error over all gradients, relative to each gradient's largest entry."""
    return max(float((g.double() - r).abs().max() / r.abs().max()) for g, r in zip(got, ref))


def test_sharded_gradient_is_the_batch_gradient():
    rows = _rows()
    _, ref = _plain(_model(torch.float64), rows)
    _, plain = _plain(_model(), rows)
    loss, sharded = _sharded(_model(), rows, shards=2)
    noise = _error(plain, ref)
    assert 0 < noise < 1e-4                   # float32's own rounding, measured here
    assert _error(sharded, ref) < 8 * noise   # another summation order, the same sum
    assert float(loss) == pytest.approx(float(_plain(_model(), rows)[0]), rel=1e-6)

    one = _model()                            # one shard of two, unweighed: what the test must catch
    one.zero_grad(set_to_none=True)
    _loss_of(one)(rows[:4]).backward()
    assert _error([p.grad for p in one.parameters()], ref) > 100 * noise


def test_the_bits_do_not_follow_the_worker_count():
    rows = _rows()
    threads = torch.get_num_threads()
    loss1, one = _sharded(_model(), rows, shards=4, workers=1)
    loss4, four = _sharded(_model(), rows, shards=4, workers=4)
    assert torch.equal(loss1, loss4)
    assert all(torch.equal(a, b) for a, b in zip(one, four))
    assert torch.get_num_threads() == threads      # the intra-op threads given back on close


def test_a_batch_that_does_not_cut_evenly_is_refused():
    model = _model()
    with ShardedGrads(list(model.parameters()), shards=3) as grads:
        with pytest.raises(ValueError, match="8 rows does not cut into 3 equal shards"):
            grads(_rows(), _loss_of(model))
