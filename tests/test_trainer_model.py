"""The drafter against the tiny target: training and decoding see the same thing; decoding is lossless."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainer.model import masks  # noqa: E402
from trainer.run.acceptance import acceptance_length, speculative_generate  # noqa: E402
from trainer.model.drafter import Drafter, DrafterConfig, flops_per_sample  # noqa: E402
from trainer.engine.step import DraftLoss  # noqa: E402
from trainer.run.target import default_layer_ids, load_target  # noqa: E402
from tolerance import assert_close, drafter_chain  # noqa: E402

BLOCK = 6


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    target = load_target("tiny", device=torch.device("cpu"), dtype=torch.float32)
    torch.manual_seed(3)
    drafter = Drafter(target.drafter_config(num_layers=2, block_size=BLOCK, mask_token_id=None))
    drafter.borrow_target_head(*target.head_weights())
    with torch.no_grad():  # a drafter that is not all zeros-ish: larger random weights
        for _, p in drafter.trainable_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return target, drafter


def test_default_layers_are_evenly_spaced_from_1_to_L_minus_3():
    assert default_layer_ids(36) == (1, 9, 17, 25, 33)  # Qwen3-8B
    assert default_layer_ids(8) == (1, 2, 3, 4, 5)
    assert default_layer_ids(2) == (0, 1)  # too shallow for 1..L-3: every layer


def test_tiny_target_is_deterministic():
    a = load_target("tiny", device=torch.device("cpu"), dtype=torch.float32)
    b = load_target("tiny", device=torch.device("cpu"), dtype=torch.float32)
    c = load_target("tiny:1", device=torch.device("cpu"), dtype=torch.float32)
    wa, wb, wc = (t.model.lm_head.weight for t in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.fingerprint == b.fingerprint != c.fingerprint


def _training_pass(tiny, S: int, anchors: torch.Tensor, g: torch.Generator):
    """Random ids (B, S) and the target's features; the drafter's arguments for a training pass over
    `anchors` (B, N): block inputs and positions, features, context positions, dense mask."""
    target, drafter = tiny
    ids = torch.randint(0, 256, (anchors.shape[0], S), generator=g)
    feats = target.features(ids)
    return ids, feats, (masks.block_inputs(ids, anchors, BLOCK, drafter.cfg.mask_token_id),
                        masks.block_positions(anchors, BLOCK), feats, torch.arange(S).expand(anchors.shape[0], S),
                        masks.attention_mask(anchors, S, BLOCK))


@pytest.mark.parametrize("masked_blocks", [False, True])
def test_training_forward_equals_one_block_at_a_time(tiny, masked_blocks):
    """Each block of a multi-anchor training pass must equal decoding it alone with context < anchor,
    also where training runs the first layer on the blocks' distinct rows (masked_blocks, DraftLoss).

    This is the train/eval coupling that, when wrong (`<=` or an off-by-one label), trains to high
    accuracy and terrible acceptance.
    """
    target, drafter = tiny
    S, anchors = 40, torch.tensor([[0, 7, 20, 34], [3, 4, 15, 30]])
    ids, feats, args = _training_pass(tiny, S, anchors, torch.Generator().manual_seed(0))
    hidden = drafter(*args, masked_blocks=masked_blocks)
    for b in range(2):
        for n, a in enumerate(anchors[b].tolist()):
            block = torch.tensor([[int(ids[b, a])] + [drafter.cfg.mask_token_id] * (BLOCK - 1)])
            one = drafter(block, torch.arange(a, a + BLOCK)[None], feats[b:b + 1, :a], torch.arange(a)[None],
                          masks.attention_mask(torch.tensor([[a]]), a, BLOCK))
            assert_close(hidden[b, n * BLOCK:(n + 1) * BLOCK], one[0], n=drafter_chain(drafter.cfg, S + BLOCK),
                         scale=float(hidden.abs().max()), msg=f"row {b} anchor {a}")


def test_features_in_decoding_match_features_in_training(tiny):
    target, _ = tiny
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    full = target.features(ids)
    _, hs, cache = target.decode(ids[:, :20], hidden=True)
    _, hs2, _ = target.decode(ids[:, 20:], cache, hidden=True)
    cat = torch.cat([torch.cat([h[i + 1] for i in target.layer_ids], -1) for h in (hs, hs2)], dim=1)
    # the tiny target (hidden 64, MLP 128, 30 keys) up to its deepest feature layer
    layers = max(target.layer_ids) + 1
    assert_close(cat, full, n=layers * (4 * 64 + 16 + 30 + 64 + 128))


def test_speculative_decoding_is_lossless(tiny):
    target, drafter = tiny
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    spec, accepted, _ = speculative_generate(target, drafter, prompt, max_new_tokens=40)
    # plain greedy decoding, one token at a time
    logits, _, cache = target.decode(torch.tensor([prompt]))
    greedy = [int(logits[0, -1].argmax())]
    while len(greedy) < 40:
        logits, _, cache = target.decode(torch.tensor([[greedy[-1]]]), cache)
        greedy.append(int(logits[0, -1].argmax()))
    assert spec == greedy
    assert all(1 <= a <= BLOCK for a in accepted)


def test_a_drafter_that_copies_the_target_is_accepted_fully(tiny, monkeypatch):
    """Acceptance counts a round as drafts accepted + 1 and reaches the block size for a perfect drafter."""
    target, drafter = tiny
    prompt = list(range(40, 52))

    def oracle(block, pos, feats, ctx_pos, mask):  # hidden states whose logits are the target's choices
        p = int(pos[0, 0])
        seq = prompt + oracle.truth[: p - len(prompt) + BLOCK]
        out = torch.zeros(1, block.shape[1], drafter.cfg.vocab_size)  # a row per block position, as the drafter
        for k in range(1, block.shape[1]):
            out[0, k, seq[p + k]] = 1.0
        return out

    logits, _, cache = target.decode(torch.tensor([prompt]))
    truth = [int(logits[0, -1].argmax())]
    while len(truth) < 60:
        logits, _, cache = target.decode(torch.tensor([[truth[-1]]]), cache)
        truth.append(int(logits[0, -1].argmax()))
    oracle.truth = truth
    monkeypatch.setattr(drafter, "forward", oracle)
    monkeypatch.setattr(drafter, "logits", lambda h: h)
    res = acceptance_length(target, drafter, [prompt], max_new_tokens=1 + 6 * BLOCK)
    assert res["acceptance_length"] == pytest.approx(BLOCK) and res["rounds"] == 6
    assert res["tau_ci95"] == pytest.approx([BLOCK, BLOCK]) and res["accept_rate_by_position"] == [1.0] * (BLOCK - 1)
    # As the reference's dflash_generate counts: the last round is cut to the tokens still wanted
    # (the first new token comes from the prompt's own forward, so 40 = 1 + 6 x 6 + 3).
    new, rounds, drafts = speculative_generate(target, drafter, prompt, max_new_tokens=40)
    assert rounds == [BLOCK] * 6 + [3] and new == truth[:40]
    assert drafts == [(BLOCK - 1, BLOCK - 1)] * 6 + [(3, 3)]  # the cut round drafted 3 and kept all 3
    # ... and it ends at the first EOS: the round that produces one counts the tokens up to it
    i = next(i for i in range(BLOCK + 2, 40) if truth[i] not in truth[:i])  # a token first seen in round 2+
    new, rounds, _ = speculative_generate(target, drafter, prompt, max_new_tokens=40, eos={truth[i]})
    assert new == truth[: i + 1] and sum(rounds) == i and rounds[-1] == (i - 1) % BLOCK + 1


def test_acceptance_rate_per_block_position_counts_the_rounds_that_drafted_it():
    from trainer.run.acceptance import accept_rates, interval95

    # (drafts accepted, drafts offered) per round; the last round was cut to the budget (1 draft)
    assert accept_rates([(2, 3), (0, 3), (3, 3), (1, 1)], 5) == [0.75, 0.6667, 0.3333, None]
    assert accept_rates([], 3) == [None, None]
    assert interval95([3]) == (3.0, float("inf"))


def test_target_head_is_borrowed_frozen_and_not_saved(tiny):
    target, drafter = tiny
    emb, norm, head = target.head_weights()
    assert drafter.embed_tokens.weight.data_ptr() == emb.data_ptr()
    assert drafter.lm_head.weight.data_ptr() == head.data_ptr()
    assert not any(p.requires_grad for p in (drafter.embed_tokens.weight, drafter.lm_head.weight))
    keys = drafter.trainable_state_dict().keys()
    assert keys and not any(k.startswith(("embed_tokens", "lm_head")) for k in keys)
    assert "fc.weight" in keys and "hidden_norm.weight" in keys


def test_final_norm_is_the_drafters_own_starting_from_the_targets():
    """The reference (and SpecForge) train the draft's own final norm; own_norm=False keeps the old
    frozen, borrowed one; a checkpoint from before the own norm still loads."""
    target = load_target("tiny", device=torch.device("cpu"), dtype=torch.float32)
    norm = target.head_weights()[1]
    drafter = Drafter(target.drafter_config(num_layers=1, block_size=BLOCK, mask_token_id=None))
    drafter.init_norm(norm)
    drafter.borrow_target_head(*target.head_weights())
    assert torch.equal(drafter.norm.weight, norm) and drafter.norm.weight.data_ptr() != norm.data_ptr()
    assert drafter.norm.weight.requires_grad and "norm.weight" in drafter.trainable_state_dict()
    assert drafter.trainable_parameters()[-1][0] == "norm.weight"  # last: old optimizer states widen

    old = Drafter(target.drafter_config(num_layers=1, block_size=BLOCK, mask_token_id=None, own_norm=False))
    old.borrow_target_head(*target.head_weights())
    assert old.norm.weight.data_ptr() == norm.data_ptr() and not old.norm.weight.requires_grad
    sd = old.trainable_state_dict()
    assert "norm.weight" not in sd
    fresh = Drafter(target.drafter_config(num_layers=1, block_size=BLOCK, mask_token_id=None))
    fresh.init_norm(norm)
    assert fresh.load_trainable_state_dict(sd) == ["norm.weight"]
    assert torch.equal(fresh.norm.weight, norm) and torch.equal(fresh.fc.weight, old.fc.weight)
    with pytest.raises(ValueError, match="missing"):
        fresh.load_trainable_state_dict({k: v for k, v in sd.items() if k != "fc.weight"})


def test_loss_gradient_reaches_only_trainable_weights(tiny):
    target, drafter = tiny
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(4))
    lm = torch.ones(1, 24)
    anchors, valid = masks.sample_anchors(lm[0], 24, BLOCK, 3, torch.Generator().manual_seed(0))
    fn = DraftLoss(drafter, masks.position_weights(BLOCK, 4.0))
    loss_sum, correct, count = fn(target.features(ids), ids, lm, anchors[None], valid[None])
    loss_sum.backward()
    assert all(p.grad is not None for _, p in drafter.trainable_parameters())
    assert drafter.lm_head.weight.grad is None and drafter.embed_tokens.weight.grad is None
    assert int(count[0]) == 0 and int(count[1:].sum()) == 3 * (BLOCK - 1)
    drafter.zero_grad(set_to_none=True)


def test_flop_count_matches_the_dense_yardstick_of_docs_benchmarks():
    cfg = DrafterConfig(hidden_size=4096, vocab_size=151936, mask_token_id=0, num_layers=5, num_heads=32,
                        num_kv_heads=8, head_dim=128, intermediate_size=12288)
    assert flops_per_sample(cfg, 768, 256 * 16) / 1e12 == pytest.approx(45, rel=0.05)


def test_rope_tables_are_the_formulas_values_in_eager_and_compiled():
    """rope_cos_sin is one opaque op (so inductor saves the tables instead of recomputing sin/cos in
    every kernel); its values are HF's half-rotation formula, to the bit, in eager and compiled."""
    import torch

    from trainer.model.drafter import rope_cos_sin

    pos = torch.randint(0, 4096, (2, 37))
    inv = 1.0 / (1e6 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    f = pos.float()[..., None] * inv
    emb = torch.cat([f, f], -1)
    cos, sin = rope_cos_sin(pos, 64, 1e6, torch.float32)
    assert cos.shape == (2, 1, 37, 64)
    assert torch.equal(cos, emb.cos()[:, None]) and torch.equal(sin, emb.sin()[:, None])
    c2, s2 = torch.compile(lambda p: rope_cos_sin(p, 64, 1e6, torch.bfloat16), fullgraph=True)(pos)
    assert torch.equal(c2, emb.cos().to(torch.bfloat16)[:, None])
    assert torch.equal(s2, emb.sin().to(torch.bfloat16)[:, None])


def _hidden_and_grads(drafter, args, probe, select=None, **flags):
    """The drafter's hidden states under `flags` (rows picked by `select`) and every trainable
    weight's gradient of their product with `probe`."""
    drafter.zero_grad(set_to_none=True)
    hidden = drafter(*args, **flags)
    hidden = hidden if select is None else select(hidden)
    (hidden * probe).sum().backward()
    grads = {k: p.grad.clone() for k, p in drafter.trainable_parameters()
             if p.grad is not None}  # the final norm is not in `hidden`
    drafter.zero_grad(set_to_none=True)
    return hidden.detach(), grads


def _assert_same_function(got, want, must_train: str, cfg, keys: int, rows: int):
    """Hidden states and gradients equal to rounding (fp32, CPU); `must_train` got a real gradient."""
    chain = drafter_chain(cfg, keys)
    assert_close(got[0], want[0], n=chain)
    assert got[1].keys() == want[1].keys() and len(want[1]) > 10
    for k, full in want[1].items():
        assert_close(got[1][k], full, n=2 * chain + rows, msg=k)
    assert want[1][must_train].abs().max() > 1e-3, f"{must_train} got no gradient to compare"


def test_first_layer_on_the_distinct_rows_is_the_same_function(tiny):
    """masked_blocks: the first layer's norm and q/k/v projections run on the anchors' rows and the
    one MASK row instead of every block row. Same hidden states and the same gradient for every
    trainable weight as the full stream (fp32, CPU: to rounding)."""
    _, drafter = tiny
    g = torch.Generator().manual_seed(5)
    anchors = torch.tensor([[0, 7, 20, 33], [3, 4, 15, 30]])
    _, _, args = _training_pass(tiny, 40, anchors, g)
    probe = torch.randn(2, anchors.shape[1] * BLOCK, drafter.cfg.hidden_size, generator=g)
    _assert_same_function(_hidden_and_grads(drafter, args, probe, masked_blocks=True),
                          _hidden_and_grads(drafter, args, probe, masked_blocks=False),
                          must_train="layers.0.self_attn.q_proj.weight", cfg=drafter.cfg, keys=40 + BLOCK,
                          rows=2 * anchors.shape[1] * BLOCK)


def test_the_last_layer_on_the_predicted_rows_is_the_same_function(tiny):
    """predicted_only (DraftLoss): the last layer's o_proj, residual and MLP run on block positions
    1..Bs-1 only, and the hidden states returned are those rows. They and every trainable weight's
    gradient equal the full stream's on the same rows (fp32, CPU: to rounding); the rows are picked
    here by index, not by the code under test."""
    _, drafter = tiny
    g = torch.Generator().manual_seed(6)
    anchors = torch.tensor([[0, 7, 20, 33], [3, 4, 15, 30]])
    _, _, args = _training_pass(tiny, 40, anchors, g)
    rows = torch.tensor([i for i in range(anchors.shape[1] * BLOCK) if i % BLOCK])
    probe = torch.randn(2, len(rows), drafter.cfg.hidden_size, generator=g)
    got = _hidden_and_grads(drafter, args, probe, masked_blocks=True, predicted_only=True)
    assert got[0].shape == (2, len(rows), drafter.cfg.hidden_size)
    _assert_same_function(got, _hidden_and_grads(drafter, args, probe, lambda h: h[:, rows], masked_blocks=True),
                          must_train=f"layers.{drafter.cfg.num_layers - 1}.mlp.down_proj.weight", cfg=drafter.cfg,
                          keys=40 + BLOCK, rows=2 * anchors.shape[1] * BLOCK)


def test_block_rows_linear_sums_the_repeated_rows_gradient():
    """_BlockRowsLinear against nn.Linear on the expanded rows, the leading (context) rows included:
    output, weight gradient, and the compact rows' gradient (a repeated row's is the sum of its copies')."""
    from trainer.model.linear import Linear, block_rows_linear, expand_blocks

    torch.manual_seed(0)
    lead, n, bs = 3, 4, 5
    layer = Linear(6, 7, bias=False)
    xc = torch.randn(2, lead + n + 1, 6, requires_grad=True)
    dy = torch.randn(2, lead + n * bs, 7)
    y = block_rows_linear(layer, xc, lead, n, bs)
    (y * dy).sum().backward()
    dw, dxc = layer.weight.grad.clone(), xc.grad.clone()
    layer.weight.grad, xc.grad = None, None
    ref = layer(expand_blocks(xc, lead, n, bs))
    (ref * dy).sum().backward()
    assert_close(y, ref, n=6)  # a dot product over 6 inputs
    assert_close(dw, layer.weight.grad, n=2 * (lead + n * bs))  # a sum over the expanded rows
    assert_close(dxc, xc.grad, n=7 * bs)  # 7 outputs, summed over a row's bs copies
    # the layout the reference above relies on: 3 lead rows, then per block its row and row 7 x 4
    assert torch.equal(expand_blocks(torch.arange(lead + n + 1).view(1, -1, 1), lead, n, bs)[0, :, 0],
                       torch.tensor([0, 1, 2, 3, 7, 7, 7, 7, 4, 7, 7, 7, 7, 5, 7, 7, 7, 7, 6, 7, 7, 7, 7]))
