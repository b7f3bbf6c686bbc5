"""The fast paths of the training forward compute what the dense paths compute (CPU, small shapes).

- Block-sparse attention (trainer/model/attention.py): the tile lists cover exactly the pairs the dense
  mask allows, the mask_mod is the same rule, and FlexAttention (eager: mask_mod only; compiled:
  tiles honoured too) gives SDPA's output. FlexAttention has no backward on CPU: its gradients are
  checked on the GPU by benchmarks/drafter_bench.py (step-0 loss and gradient norm per variant).
- Chunked linear + cross-entropy (trainer/model/fused_ce.py): same loss, same hidden gradient, same counts.
"""
from __future__ import annotations

import contextlib
import os

import math

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from trainer.model import attention, fused_ce, masks  # noqa: E402
from trainer.model.draft_loss import DraftLoss  # noqa: E402
from trainer.model.drafter import Drafter, DrafterConfig, RMSNorm, flops_needed, flops_per_sample  # noqa: E402
from trainer.run.target import load_target  # noqa: E402
from tolerance import assert_close, bound, drafter_chain  # noqa: E402

needs_flex = pytest.mark.skipif(not attention.FLEX, reason="this torch has no FlexAttention")
# inductor lowers FlexAttention for the CPU only with AVX2 kernels (torch/_inductor/kernel/flex/flex_cpu.py)
compiles_flex = pytest.mark.skipif(not attention.FLEX or not torch.cpu._is_avx2_supported()
                                   or os.environ.get("ATEN_CPU_CAPABILITY") == "default",
                                   reason="inductor compiles FlexAttention on the CPU only with AVX2 kernels")


def _anchors(B, S, block, n, seed):
    g = torch.Generator().manual_seed(seed)
    lm = (torch.rand(B, S, generator=g) < 0.8).float()
    picked = [masks.sample_anchors(lm[b], S, block, n, g) for b in range(B)]
    return torch.stack([a for a, _ in picked]), torch.stack([v for _, v in picked])


def _tiles_dense(num, idx, nk):
    """FlexAttention tile lists (B, 1, nq), (B, 1, nq, nk) -> (B, nq, nk) bool."""
    B, _, nq = num.shape
    out = torch.zeros(B, nq, nk, dtype=torch.bool)
    for b in range(B):
        for i in range(nq):
            out[b, i, idx[b, 0, i, : num[b, 0, i]].long()] = True
    return out


# (S, block, anchors): a tiny one, one with ragged tiles on both axes, one with fully visible tiles.
SHAPES = [(40, 6, 4), (300, 8, 40), (700, 16, 24)]


@needs_flex
@pytest.mark.parametrize("S,block,n", SHAPES)
def test_sparse_tiles_cover_exactly_the_visible_pairs(S, block, n):
    anchors, _ = _anchors(2, S, block, n, seed=S)
    dense = masks.attention_mask(anchors, S, block)  # (B, Tq, Tk)
    sm = attention.sparse_mask(anchors, S, block)
    B, Tq, Tk = dense.shape
    T = attention.TILE
    nq, nk = math.ceil(Tq / T), math.ceil(Tk / T)
    partial = _tiles_dense(sm.kv_num, sm.kv_idx, nk)
    full = _tiles_dense(sm.full_num, sm.full_idx, nk)
    assert not (partial & full).any()
    for b in range(B):
        for i in range(nq):
            for j in range(nk):
                tile = dense[b, i * T:(i + 1) * T, j * T:(j + 1) * T]
                whole = tile.shape == (T, T) and bool(tile.all())
                assert bool(full[b, i, j]) == whole, (b, i, j)
                assert bool(partial[b, i, j]) == (bool(tile.any()) and not whole), (b, i, j)
    assert 0 < sm.density() <= 1


@needs_flex
@pytest.mark.parametrize("S,block,n", SHAPES)
def test_mask_mod_is_the_dense_rule(S, block, n):
    from torch.nn.attention.flex_attention import create_mask

    anchors, _ = _anchors(2, S, block, n, seed=S + 1)
    dense = masks.attention_mask(anchors, S, block)
    Tq, Tk = dense.shape[1:]
    got = create_mask(attention.mask_mod(anchors, Tq, S, block), 2, 1, Tq, Tk, device="cpu")
    assert torch.equal(got[:, 0], dense)


def _attention_chain(q, k) -> int:
    """An attention output's reductions: the scores (head_dim), the softmax's sum and the weighted sum
    over the keys."""
    return q.shape[-1] + 2 * k.shape[-2]


def _qkv(B, Tq, Tk, nh=4, nkv=2, hd=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, nh, Tq, hd, generator=g), torch.randn(B, nkv, Tk, hd, generator=g),
            torch.randn(B, nkv, Tk, hd, generator=g))


@needs_flex
@pytest.mark.parametrize("S,block,n", SHAPES[:2])
def test_flex_equals_dense_sdpa_eager(S, block, n):
    anchors, _ = _anchors(2, S, block, n, seed=S + 2)
    q, k, v = _qkv(2, n * block, S + n * block)
    ref = attention.attend(q, k, v, masks.attention_mask(anchors, S, block))
    got = attention.attend(q, k, v, attention.sparse_mask(anchors, S, block))
    assert_close(got, ref, n=_attention_chain(q, k))


@compiles_flex
def test_compiled_flex_honours_the_tiles_and_equals_sdpa():
    """Compiled, FlexAttention skips unlisted tiles (eager evaluates mask_mod everywhere): a wrong
    tile list shows up here and nowhere else on CPU."""
    S, block, n = 700, 16, 24  # fully visible tiles, ragged last tiles
    anchors, _ = _anchors(2, S, block, n, seed=5)
    q, k, v = _qkv(2, n * block, S + n * block, seed=1)
    ref = attention.attend(q, k, v, masks.attention_mask(anchors, S, block))
    sm = attention.sparse_mask(anchors, S, block)
    assert int(sm.full_num.sum()) > 0
    fn = torch.compile(attention._flex_sparse, dynamic=False)
    args = (q, k, v, sm.anchors, sm.kv_num, sm.kv_idx, sm.full_num, sm.full_idx, S, block)
    assert_close(fn(*args), ref, n=_attention_chain(q, k))
    sm.full_num[0, 0, -1] -= 1  # drop one fully visible tile: the output must notice
    args = (q, k, v, sm.anchors, sm.kv_num, sm.kv_idx, sm.full_num, sm.full_idx, S, block)
    assert float((fn(*args) - ref).abs().max()) > 100 * bound(torch.float32, _attention_chain(q, k), 4.0)


@compiles_flex
def test_flex_with_kv_expanded_to_the_query_heads_is_the_same_attention():
    """--flex-tiles ...+kv repeats K/V to the query heads inside the flex call (for the
    backward's work split); the function stays the same. (No flex backward on CPU: the gradients are
    checked against an fp32 reference by benchmarks/flex_bench.py on a GPU.)"""
    S, block, n = 300, 16, 12
    anchors, _ = _anchors(2, S, block, n, seed=3)
    q, k, v = _qkv(2, n * block, S + n * block, seed=2)
    sm = attention.sparse_mask(anchors, S, block)
    args = (sm.anchors, sm.kv_num, sm.kv_idx, sm.full_num, sm.full_idx, S, block)
    ref = attention.attend(q, k, v, masks.attention_mask(anchors, S, block))
    fn = torch.compile(attention._flex_sparse, dynamic=False)
    for choice in (attention.FlexChoice(), attention.FlexChoice(expand_kv=True)):
        assert_close(fn(q, k, v, *args, choice=choice), ref, n=_attention_chain(q, k), msg=str(choice))


@needs_flex
def test_a_failing_flex_compile_falls_back_to_dense_sdpa(monkeypatch):
    """The eager policy must keep working where torch.compile does not."""
    def broken(*a, **k):
        raise RuntimeError("BackendCompilerFailed: simulated")

    monkeypatch.setattr(attention, "_compile_here", lambda q: True)
    monkeypatch.setattr(attention, "_compiled_flex", lambda: broken)
    monkeypatch.setattr(attention, "fallback_reason", None)
    anchors, _ = _anchors(2, 40, 6, 4, seed=7)
    q, k, v = _qkv(2, 24, 64)
    ref = attention.attend(q, k, v, masks.attention_mask(anchors, 40, 6))
    with pytest.warns(RuntimeWarning, match="simulated"):
        got = attention.attend(q, k, v, attention.sparse_mask(anchors, 40, 6))
    assert torch.equal(got, ref) and "simulated" in attention.fallback_reason


def test_a_failing_ce_core_compile_runs_the_core_eagerly(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("InductorError: simulated")

    monkeypatch.setattr(fused_ce._compiled, "fn", broken)
    monkeypatch.setattr(fused_ce._compiled, "reason", None)
    logits, labels, w = torch.randn(4, 10), torch.tensor([1, 2, 3, 4]), torch.ones(4)
    with pytest.warns(RuntimeWarning, match="simulated"):
        got = fused_ce._compiled(logits, labels, w)
    ref = fused_ce._ce_core(logits, labels, w)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert "simulated" in fused_ce._compiled.reason


def test_a_failing_triton_kernel_runs_the_torch_core(monkeypatch):
    """Where Triton cannot build the kernel (an unsupported GPU, say), the loss goes on with the torch
    core: one warning, the same numbers, and the kernel is not tried again."""
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("triton: simulated")

    monkeypatch.setattr(fused_ce._kernel, "fn", broken)
    monkeypatch.setattr(fused_ce._kernel, "reason", None)
    monkeypatch.setattr(fused_ce._compiled, "reason", "not under test")  # its fallback: the eager core
    logits, labels, w = torch.randn(4, 10), torch.tensor([1, 2, 3, 4]), torch.ones(4)
    ref = fused_ce._ce_core(logits, labels, w)
    with pytest.warns(RuntimeWarning, match="Triton cross-entropy kernel failed .*simulated"):
        got = fused_ce._kernel(logits, labels, w)
    again = fused_ce._kernel(logits, labels, w)
    assert all(torch.equal(a, b) for a, b in zip(got, ref)) and all(torch.equal(a, b) for a, b in zip(again, ref))
    assert calls == [1]


def _head(H=32, V=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(H, 1e-6)
    norm.weight = torch.nn.Parameter(torch.rand(H, generator=g) + 0.5, requires_grad=False)
    return norm, torch.randn(V, H, generator=g) * 0.3


@pytest.mark.parametrize("rows", [None, 16, 7])
def test_chunked_ce_equals_unfused_in_value_gradient_and_counts(rows):
    B, Tq, H, V, block = 2, 24, 32, 100, 6
    norm, W = _head(H, V)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(B, Tq, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, Tq), generator=g)
    w = torch.rand(B, Tq, generator=g)
    w[:, ::block] = 0
    w[1, 6:12] = 0  # an invalid block
    ref = masks.block_loss(F.linear(norm(h), W), labels, w, block)
    (ref[0] / 7).backward()
    g_ref, h.grad = h.grad, None
    got = fused_ce.block_loss(h, norm, W, labels, w, block, rows=rows)
    (got[0] / 7).backward()
    # the loss: the norm and the head (H each), the log-sum-exp over V, the sum over the rows
    assert_close(got[0], ref[0], n=2 * H + V + B * Tq)
    assert_close(h.grad, g_ref, n=2 * (2 * H + V))
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])


def test_chunked_ce_gives_the_trainable_final_norm_its_gradient():
    """The drafter's own final norm is trained: its weight gradient equals autograd's through the
    unfused path (fp32, and bf16 autocast within the noise)."""
    B, Tq, H, V, block = 2, 24, 32, 100, 6
    # fp32: the reductions of the loss and back; bf16: the operands of the head's matmul and its
    # output are rounded to bf16 in one path where the other keeps fp32 (three roundings)
    fp32, bf16 = bound(torch.float32, 2 * (2 * H + V) + B * Tq), bound(torch.bfloat16, 3)
    for dtype, tol in ((None, fp32), (torch.bfloat16, bf16)):
        norm, W = _head(H, V, seed=5)
        norm.weight.requires_grad_(True)
        g = torch.Generator().manual_seed(6)
        h = torch.randn(B, Tq, H, generator=g, requires_grad=True)
        labels = torch.randint(0, V, (B, Tq), generator=g)
        w = torch.rand(B, Tq, generator=g)
        amp = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
        with amp:
            ref = masks.block_loss(F.linear(norm(h), W.to(dtype or W.dtype)), labels, w, block)
        (ref[0] / 3).backward()
        gn_ref, gh_ref = norm.weight.grad, h.grad
        norm.weight.grad = h.grad = None
        with amp:
            got = fused_ce.block_loss(h, norm, W.to(dtype or W.dtype), labels, w, block, rows=16)
        (got[0] / 3).backward()
        assert ((norm.weight.grad - gn_ref).norm() / gn_ref.norm()) < tol
        assert ((h.grad - gh_ref).norm() / gh_ref.norm()) < tol


def test_chunked_ce_under_bf16_autocast_matches_unfused():
    B, Tq, H, V, block = 2, 32, 64, 300, 8
    norm, W = _head(H, V, seed=2)
    W = W.bfloat16()
    norm.weight = torch.nn.Parameter(norm.weight.bfloat16(), requires_grad=False)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(B, Tq, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, Tq), generator=g)
    w = torch.rand(B, Tq, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = masks.block_loss(F.linear(norm(h), W), labels, w, block)
    ref[0].backward()
    g_ref, h.grad = h.grad, None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_ce.block_loss(h, norm, W, labels, w, block, rows=16)
    got[0].backward()
    # the same bf16 logits in both; the fp32 log-sum-exp over V and the sum over the rows differ in order
    assert_close(got[0], ref[0], n=V + B * Tq, dtype=torch.float32)
    # the head's backward: the logits' gradient and its product with W, each rounded to bf16 once
    assert ((h.grad - g_ref).norm() / g_ref.norm()) < bound(torch.bfloat16, 2)


def test_chunked_ce_refuses_a_trainable_head():
    norm, W = _head()
    with pytest.raises(ValueError, match="freeze"):
        fused_ce.block_loss(torch.randn(1, 6, 32), norm, W.requires_grad_(), torch.zeros(1, 6, dtype=torch.long),
                            torch.ones(1, 6), 6)


def test_chunk_rows_keep_a_chunk_of_fp32_logits_under_a_gib():
    assert fused_ce.chunk_rows(8192, 151936) == 1024
    assert fused_ce.chunk_rows(24, 100) == 16


def test_ce_rows_configured_set_the_chunks(monkeypatch):
    """--ce-rows (fused_ce.configure) fixes the chunk (a benchmark's A/B); the loss is the same function of the rows."""
    norm, W = _head()
    torch.manual_seed(0)
    h, labels, w = torch.randn(1, 24, 32), torch.randint(0, W.shape[0], (1, 24)), torch.rand(1, 24)
    seen = []
    real = fused_ce._LinearCE.apply
    monkeypatch.setattr(fused_ce._LinearCE, "apply", lambda *a: seen.append(a[6]) or real(*a))  # rows
    monkeypatch.setattr(fused_ce, "ROWS", None)
    fused_ce.configure(5)
    five = fused_ce.block_loss(h, norm, W, labels, w, 6)[0]
    fused_ce.configure(None)
    default = fused_ce.block_loss(h, norm, W, labels, w, 6)[0]
    assert seen == [5, 16]
    assert_close(five, default, n=2 * 32 + W.shape[0] + 24)
    with pytest.raises(ValueError, match="positive number of rows"):
        fused_ce.configure(0)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    target = load_target("tiny", device=torch.device("cpu"), dtype=torch.float32)
    torch.manual_seed(3)
    drafter = Drafter(target.drafter_config(num_layers=2, block_size=8, mask_token_id=None))
    drafter.borrow_target_head(*target.head_weights())
    with torch.no_grad():
        for _, p in drafter.trainable_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    S = 200
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, S), generator=g)
    lm = torch.ones(2, S)
    anchors, valid = _anchors(2, S, 8, 20, seed=9)
    valid[1, -3:] = False
    return drafter, (target.features(ids), ids, lm, anchors, valid)


def _loss_chain(drafter, S, anchors) -> int:
    """The draft loss's reductions: the drafter's over S context keys and the blocks, the head's
    log-sum-exp over the vocabulary, the sum over every block row."""
    rows = anchors.numel() * drafter.cfg.block_size
    return drafter_chain(drafter.cfg, S + rows) + drafter.cfg.hidden_size + drafter.cfg.vocab_size + rows


def _grads(drafter):
    out = [p.grad.clone() for _, p in drafter.trainable_parameters()]
    drafter.zero_grad(set_to_none=True)
    return out


def test_auto_backends_are_the_ones_measured_to_work(tiny):
    drafter, _ = tiny
    fn = DraftLoss(drafter, masks.position_weights(8, 4.0))
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert fn.backends(cpu) == ("sdpa", "dense")
    # CUDA, under any policy: flex + chunked CE (measured on the H200, eager and inductor)
    assert fn.backends(cuda) == ("flex" if attention.FLEX else "sdpa", "chunked")
    explicit = DraftLoss(drafter, masks.position_weights(8, 4.0), attention="sdpa", loss="dense")
    assert explicit.backends(cuda) == ("sdpa", "dense")
    with pytest.raises(ValueError, match="attention backend"):
        DraftLoss(drafter, masks.position_weights(8, 4.0), attention="fast")


def test_draft_loss_skips_only_the_anchor_rows_that_carry_no_loss(tiny):
    """DraftLoss runs the head on block positions 1..Bs-1; the loss, its gradient and the
    per-position counts equal the head over every row (the formulation before the skip)."""
    drafter, (feats, ids, lm, anchors, valid) = tiny
    pw = masks.position_weights(8, 4.0)
    B, S = ids.shape
    block_ids = masks.block_inputs(ids, anchors, 8, drafter.cfg.mask_token_id)
    labels, weights = masks.block_labels(ids, lm, anchors, valid, pw)
    hidden = drafter(block_ids, masks.block_positions(anchors, 8), feats,
                     torch.arange(S).expand(B, S), masks.attention_mask(anchors, S, 8))
    ref = masks.block_loss(drafter.logits(hidden), labels, weights, 8)
    ref[0].backward()
    g_ref = _grads(drafter)
    for loss in ("dense", "chunked"):
        got = DraftLoss(drafter, pw, attention="sdpa", loss=loss)(feats, ids, lm, anchors, valid)
        got[0].backward()
        assert_close(got[0], ref[0], n=_loss_chain(drafter, S, anchors), msg=loss)
        assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2]) and int(got[2][0]) == 0
        for a, b in zip(_grads(drafter), g_ref):
            assert_close(a, b, n=2 * _loss_chain(drafter, S, anchors), msg=loss)  # fp32 summation order
    with pytest.raises(ValueError, match="position 0 is the anchor"):
        DraftLoss(drafter, torch.ones(8))


@needs_flex
def test_draft_loss_fast_paths_equal_the_dense_paths(tiny):
    drafter, batch = tiny
    pw = masks.position_weights(8, 4.0)
    ref = DraftLoss(drafter, pw, attention="sdpa", loss="dense")(*batch)
    ref[0].backward()
    g_ref = _grads(drafter)
    with torch.no_grad():  # FlexAttention has no backward on CPU
        flex = DraftLoss(drafter, pw, attention="flex", loss="chunked")(*batch)
    chain = _loss_chain(drafter, batch[1].shape[1], batch[3])
    assert_close(flex[0], ref[0], n=chain)
    assert torch.equal(flex[1], ref[1]) and torch.equal(flex[2], ref[2])
    # chunked CE, traced by dynamo + AOTAutograd (what a compile policy does, minus inductor)
    fn = torch.compile(DraftLoss(drafter, pw, attention="sdpa", loss="chunked"), backend="aot_eager")
    got = fn(*batch)
    got[0].backward()
    assert_close(got[0], ref[0], n=chain)
    for a, b in zip(_grads(drafter), g_ref):
        assert_close(a, b, n=2 * chain)


def test_flop_counts_for_the_8b_shape():
    cfg = DrafterConfig(hidden_size=4096, vocab_size=151936, mask_token_id=0)
    dense = flops_per_sample(cfg, 768, 4096)
    assert dense / 1e12 == pytest.approx(44.5, abs=0.1)
    # frozen lm_head (no weight gradient): the "~39 TFLOP by a dense count" of docs/benchmarks.md (39.4),
    # less what is not computed: the head on block position 0 (the anchor, no loss), the fc's input
    # gradient (the target's features are frozen), and the first layer's q/k/v on the 15 MASK rows
    # of each block (masked_blocks: 256 anchors + 1 MASK row computed of 4096), and the last layer's
    # o_proj and MLP on the 256 anchors' rows (predicted_only)
    head_on_anchors = 2 * 2 * 4096 * 151936 * 4096 / 16
    fc_input_grad = 2 * 5 * 4096 * 4096 * 768
    first_layer_repeats = 3 * (2 * 4096 * 4096 + 2 * 2 * 4096 * 1024) * (4096 - 256 - 1)
    last_layer_anchors = 3 * (2 * 4096 * 4096 + 3 * 2 * 4096 * 12288) * 256
    skipped = head_on_anchors + fc_input_grad + first_layer_repeats + last_layer_anchors
    assert (flops_needed(cfg, 768, 4096) + skipped) / 1e12 == pytest.approx(39.4, abs=0.1)
    assert flops_needed(cfg, 768, 4096) / 1e12 == pytest.approx(37.8, abs=0.1)
    # ~392 keys per query: 256 anchors uniform over 753 positions, plus the block's own 16
    assert flops_needed(cfg, 768, 4096, attended_pairs=4096 * 392) / 1e12 == pytest.approx(33.3, abs=0.1)
