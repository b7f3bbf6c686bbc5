"""Property tests for the DFlash block rules (docs/background.md#dflash): mask, labels, anchors, weights."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trainer.model import masks  # noqa: E402


@st.composite
def anchor_sets(draw):
    """A batch of sequences with random lengths, loss masks and sampled anchors."""
    block = draw(st.integers(2, 8))
    batch = draw(st.integers(1, 3))
    S = draw(st.integers(block, 40))
    n = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (batch, S), generator=g)
    lm = (torch.rand(batch, S, generator=g) < draw(st.floats(0.1, 1.0))).float()
    lengths = [draw(st.integers(block, S)) for _ in range(batch)]
    anchors = torch.zeros(batch, n, dtype=torch.long)
    valid = torch.zeros(batch, n, dtype=torch.bool)
    for b in range(batch):
        lm[b, lengths[b]:] = 0
        anchors[b], valid[b] = masks.sample_anchors(lm[b], lengths[b], block, n, g)
    return block, ids, lm, lengths, anchors, valid


@settings(max_examples=150, deadline=None)
@given(anchor_sets())
def test_mask_sees_only_strictly_earlier_context_and_its_own_block(case):
    block, ids, lm, lengths, anchors, valid = case
    B, S = ids.shape
    N = anchors.shape[1]
    m = masks.attention_mask(anchors, S, block)
    assert m.shape == (B, N * block, S + N * block)
    for b in range(B):
        for q in range(N * block):
            a = int(anchors[b, q // block])
            ctx = m[b, q, :S]
            # context strictly before the anchor: kv < anchor, never kv >= anchor
            assert ctx[:a].all() and not ctx[a:].any()
            blk = m[b, q, S:].view(N, block)
            own = q // block
            assert blk[own].all()  # bidirectional inside its own block
            others = torch.cat([blk[:own], blk[own + 1:]])
            assert not others.any()  # blind to every other block


@settings(max_examples=150, deadline=None)
@given(anchor_sets())
def test_anchors_are_loss_masked_fit_a_block_and_are_distinct(case):
    block, ids, lm, lengths, anchors, valid = case
    for b in range(ids.shape[0]):
        chosen = anchors[b][valid[b]].tolist()
        assert chosen == sorted(set(chosen))
        for a in chosen:
            assert lm[b, a] == 1 and a <= lengths[b] - block
        cand = masks.anchor_candidates(lm[b], lengths[b], block).tolist()
        assert len(chosen) == min(len(cand), anchors.shape[1])


@settings(max_examples=150, deadline=None)
@given(anchor_sets(), st.floats(0.5, 10))
def test_labels_are_the_token_at_anchor_plus_k_and_position_zero_has_no_loss(case, gamma):
    block, ids, lm, lengths, anchors, valid = case
    w = masks.position_weights(block, gamma)
    labels, weights = masks.block_labels(ids, lm, anchors, valid, w)
    inputs = masks.block_inputs(ids, anchors, block, mask_token_id=99)
    pos = masks.block_positions(anchors, block)
    N = anchors.shape[1]
    for b in range(ids.shape[0]):
        for n in range(N):
            a = int(anchors[b, n])
            for k in range(block):
                t = n * block + k
                assert int(pos[b, t]) == a + k
                assert int(inputs[b, t]) == (int(ids[b, a]) if k == 0 else 99)
                if not valid[b, n]:
                    assert weights[b, t] == 0
                    continue
                assert int(labels[b, t]) == int(ids[b, a + k])
                want = 0.0 if k == 0 else math.exp(-(k - 1) / gamma) * float(lm[b, a + k])
                assert float(weights[b, t]) == pytest.approx(want, rel=1e-6)


def test_gamma_follows_the_recipe():
    assert masks.default_gamma(16) == 7 and masks.default_gamma(10) == 5 and masks.default_gamma(8) == 4
    w = masks.position_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and w[2] == pytest.approx(math.exp(-1 / 7))
    assert masks.default_gamma(4) >= 1


def test_block_loss_counts_only_weighted_positions():
    block, V = 4, 5
    logits = torch.full((1, 2 * block, V), -10.0)
    labels = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    logits[0, torch.arange(8), labels[0]] = 10.0  # all right ...
    logits[0, 5, :] = 0.0
    logits[0, 5, 4] = 10.0  # ... except block 1, position 1
    weights = torch.tensor([[0, 1, 0.5, 0.25, 0, 1, 0.5, 0.0]])
    loss_sum, correct, count = masks.block_loss(logits, labels, weights, block)
    assert count.tolist() == [0, 2, 2, 1] and correct.tolist() == [0, 1, 2, 1]
    assert float(loss_sum) == pytest.approx(10.0, rel=1e-3)  # only the miss costs: ~10 nats, weight 1
