"""D-PACE position weights (--position-weights dpace, masks.dpace_weights): the weights are D-PACE's
(a case computed by hand, and upstream's formula written out as loops on whole blocks, anchor slot
included), no gradient flows through them, the chunked loss equals the dense one, a batch divides by
its loss tokens, the trainer runs it end to end and refuses bad settings in one line.

Tolerances: the weights against the loop reference, both in float64, within the bound of their
reductions (tests/tolerance.py: a product and a sum of at most `block` terms). The chunked loss against
the dense reference as tests/test_distill.py holds it: within NOISE_FACTOR times the dense float32
result's own distance from the float64 one (the float32 noise of this computation, measured on the spot).
"""
from __future__ import annotations

import copy
import math
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from trainer.errors import UsageError  # noqa: E402
from trainer.model import fused_ce, masks  # noqa: E402
from trainer.model.draft_loss import DraftLoss  # noqa: E402
from trainer.model.drafter import Drafter, RMSNorm  # noqa: E402
from trainer.model.linear import predicted_rows  # noqa: E402
from trainer.model.objective import Objective  # noqa: E402
from trainer.run.flags import check_before_launch, parse  # noqa: E402
from trainer.run.data import Sample, make_batch  # noqa: E402
from trainer.run.target import load_target  # noqa: E402
from tolerance import assert_close, eps  # noqa: E402
from trainer_quick import QUICK, ROOT, metrics, step_losses, subprocess_env  # noqa: E402

NOISE_FACTOR = 8.0
DPACE = Objective(position_weights="dpace")


# ---- the weights ------------------------------------------------------------------------------------

def test_the_weights_of_a_block_computed_by_hand():
    """q = 0.8, 0.4, 0.1 at alpha 0.5: s = 0.9, 0.7, 0.55; prefix products 0.9, 0.63, 0.3465; the weights
    are their suffix sums 1.8765, 0.9765, 0.3465. A masked middle row passes the product through (s = 1)
    and drops out of the sums: 0.9 + 0.495 = 1.395, 0, 0.495. alpha 1 ignores the confidence: each row
    counts the rows from it to the block's end."""
    ce = -torch.log(torch.tensor([0.8, 0.4, 0.1]))
    cases = [(torch.ones(3), 0.5, [1.8765, 0.9765, 0.3465]),
             (torch.tensor([1.0, 0.0, 1.0]), 0.5, [1.395, 0.0, 0.495]),
             (torch.ones(3), 1.0, [3.0, 2.0, 1.0])]
    for mask, alpha, want in cases:
        got = masks.dpace_weights(ce, mask, 3, alpha)
        assert_close(got, torch.tensor(want), n=3 * 3, msg=f"mask {mask.tolist()} alpha {alpha}")
    # two blocks at once (and a batch dimension) are two independent blocks
    two = masks.dpace_weights(ce.repeat(2, 2), torch.tensor([[1.0, 1, 1, 1, 0, 1]] * 2), 3, 0.5)
    assert_close(two, torch.tensor([[1.8765, 0.9765, 0.3465, 1.395, 0.0, 0.495]] * 2), n=9)


def _upstream_weights(ce: torch.Tensor, mask: torch.Tensor, bs: int, alpha: float) -> torch.Tensor:
    """speculators 0.9.0's D-PACE weights (speculators/losses/utils.py, dpace_loss_decay) written out as
    loops over WHOLE blocks of bs slots, slot 0 the anchor with loss mask 0, as upstream lays them out:
    w_k = m_k * sum_{j >= k} m_j prod_{i <= j} s_i, s_i = (1 - alpha) exp(-ce_i) + alpha where m_i > 0,
    else 1. ce, mask (n * bs,) float64."""
    w = torch.zeros_like(ce)
    for b in range(0, len(ce), bs):
        s = [(1 - alpha) * math.exp(-float(ce[b + i])) + alpha if mask[b + i] > 0 else 1.0 for i in range(bs)]
        for k in range(bs):
            total, prod = 0.0, 1.0
            for j in range(bs):
                prod *= s[j]
                if j >= k:
                    total += float(mask[b + j]) * prod
            w[b + k] = float(mask[b + k]) * total
    return w


@pytest.mark.parametrize("bs, alpha", [(4, 0.5), (16, 0.5), (16, 0.2), (8, 1.0)])
def test_the_weights_are_upstreams_on_the_predicted_rows(bs, alpha):
    """Upstream weighs whole blocks with the anchor's slot masked; the trainer's rows leave that slot out
    (linear.predicted_rows). The anchor's slot is a factor 1 in every product and weight 0: same weights."""
    g = torch.Generator().manual_seed(bs)
    n = 6
    ce = torch.rand(n * bs, generator=g, dtype=torch.float64) * 6    # confidences from ~0.0025 to 1
    mask = (torch.rand(n * bs, generator=g) < 0.8).double()
    mask[::bs] = 0                               # the anchors
    mask[2 * bs: 3 * bs] = 0                     # a dead block (an invalid anchor)
    mask[4 * bs + 3] = 0                         # a masked row mid-block
    want = _upstream_weights(ce, mask, bs, alpha)
    got = masks.dpace_weights(predicted_rows(ce[None], bs), predicted_rows(mask[None], bs), bs - 1, alpha)
    assert_close(got, predicted_rows(want[None], bs), n=2 * bs, msg=f"bs {bs}")
    assert float(want[::bs].abs().max()) == 0.0 and float(want[2 * bs: 3 * bs].abs().max()) == 0.0


def test_no_gradient_flows_through_the_weights():
    """The dense loss's gradient is that of sum(CE * d) with d the same weights held fixed."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 12, 50, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (2, 12), generator=g)
    mask = (torch.rand(2, 12, generator=g) < 0.8).float()
    loss, _, _ = masks.block_loss(logits, labels, mask, 4, dpace=0.5)
    loss.backward()
    ce = F.cross_entropy(logits.detach().flatten(0, 1), labels.flatten(), reduction="none").view(2, 12)
    fixed = masks.dpace_weights(ce, mask, 4, 0.5)
    ref = logits.detach().clone().requires_grad_(True)
    ref_ce = F.cross_entropy(ref.flatten(0, 1), labels.flatten(), reduction="none").view(2, 12)
    (ref_ce * fixed).sum().backward()
    assert torch.equal(logits.grad, ref.grad) and float(loss.detach()) == float((ref_ce * fixed).sum().detach())


# ---- the chunked loss -------------------------------------------------------------------------------

def _within_noise(got, exact, ref32, what, chunks=1):
    """got within NOISE_FACTOR x the dense float32 noise of the exact value, plus what summing `chunks`
    partial sums adds: one rounding of the total per addition (every term of these sums has one sign
    per element, so no partial sum exceeds the total), so that a lucky noise of 0 cannot fail it."""
    err = float((got.detach().double() - exact.detach()).abs().max())
    noise = float((ref32.detach().double() - exact.detach()).abs().max())
    floor = (chunks + 1) * eps(torch.float32) * float(exact.detach().abs().max())
    assert err <= NOISE_FACTOR * noise + floor, (f"{what}: |chunked - exact| {err:.3g} > {NOISE_FACTOR} x "
                                                 f"float32 noise {noise:.3g} + {floor:.3g}")


def _case(seed, B=2, n=8, block=6, H=32, V=100):
    """A head (norm with a trainable weight, frozen W), hidden rows of n blocks of `block` predicted rows
    each, labels, and a 0/1 loss mask with a dead block and a masked row mid-block."""
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(H, 1e-6)
    norm.weight = torch.nn.Parameter(torch.rand(H, generator=g) + 0.5)
    W = torch.randn(V, H, generator=g) * 0.5
    h = torch.randn(B, n * block, H, generator=g)
    labels = torch.randint(0, V, (B, n * block), generator=g)
    mask = (torch.rand(B, n * block, generator=g) < 0.85).float()
    mask[1, block:2 * block] = 0
    mask[0, 3 * block + 2] = 0
    return norm, W, h, labels, mask, block


def _dense(norm, W, h, labels, mask, block, dtype):
    norm = copy.deepcopy(norm).to(dtype)
    h = h.detach().to(dtype).clone().requires_grad_(True)
    loss, correct, count = masks.block_loss(F.linear(norm(h), W.to(dtype)), labels, mask.to(dtype), block, dpace=0.5)
    (loss / 5).backward()
    return loss.detach(), h.grad, norm.weight.grad, correct, count


def _chunked(norm, W, h, labels, mask, block, rows):
    norm = copy.deepcopy(norm)
    h = h.clone().requires_grad_(True)
    loss, correct, count = fused_ce.block_loss(h, norm, W, labels, mask, block, rows=rows, objective=DPACE)
    (loss / 5).backward()
    return loss.detach(), h.grad, norm.weight.grad, correct, count


@pytest.mark.parametrize("rows, chunks", [(None, 2), (16, 8), (7, 16), (3, 16)])  # 96 rows: 64 -> 60, 36;
def test_chunked_dpace_equals_the_dense_reference(rows, chunks):           # 12 (whole blocks of 6); 6; 6
    for seed in range(3):
        case = _case(seed)
        exact = _dense(*case, torch.float64)
        ref = _dense(*case, torch.float32)
        got = _chunked(*case, rows)
        for i, what in enumerate(("loss", "d h", "d norm weight")):
            _within_noise(got[i], exact[i], ref[i], f"seed {seed} rows {rows} {what}", chunks)
        assert torch.equal(got[3], ref[3]) and torch.equal(got[4], ref[4])


def test_a_chunk_that_splits_a_block_would_weigh_it_wrong():
    """Why chunks hold whole blocks: the core on half a block weighs its rows as if the block ended there."""
    norm, W, h, labels, mask, block = _case(0)
    logits = F.linear(norm(h[0]), W).detach()
    whole, _, _ = fused_ce._dpace_core(logits[:block], labels[0, :block], mask[0, :block], block, 0.5)
    halves = sum(fused_ce._dpace_core(logits[s:s + 3], labels[0, s:s + 3], mask[0, s:s + 3], 3, 0.5)[0]
                 for s in (0, 3))
    assert abs(float(whole) - float(halves)) > 0.05 * abs(float(whole))


# ---- the whole loss on the tiny target --------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    target = load_target("tiny", device=torch.device("cpu"), dtype=torch.float32)
    torch.manual_seed(3)
    drafter = Drafter(target.drafter_config(num_layers=2, block_size=8, mask_token_id=None))
    drafter.init_norm(target.head_weights()[1])
    drafter.borrow_target_head(*target.head_weights())
    with torch.no_grad():
        for _, p in drafter.trainable_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return target, drafter


def _batch(seed=2, S=80):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, S), generator=g)
    lm = torch.zeros(2, S)
    lm[:, 10:] = 1
    picked = [masks.sample_anchors(lm[b], S, 8, 6, g) for b in range(2)]
    return ids, lm, torch.stack([a for a, _ in picked]), torch.stack([v for _, v in picked])


def _grads(drafter):
    out = [p.grad.clone() for _, p in drafter.trainable_parameters()]
    drafter.zero_grad(set_to_none=True)
    return out


def test_draft_loss_chunked_dpace_equals_dense_in_every_trainable_gradient(tiny):
    target, drafter = tiny
    ids, lm, anchors, valid = _batch()
    pw = masks.flat_weights(8)
    feats = target.features(ids)

    def run(module, f):
        loss, correct, count = module(f, ids, lm, anchors, valid)
        (loss / 9).backward()
        return loss.detach(), correct, count

    exact_drafter = copy.deepcopy(drafter).double()
    exact = run(DraftLoss(exact_drafter, pw.double(), attention="sdpa", loss="dense", objective=DPACE), feats.double())
    g_exact = _grads(exact_drafter)
    ref = run(DraftLoss(drafter, pw, attention="sdpa", loss="dense", objective=DPACE), feats)
    g_ref = _grads(drafter)
    # D-PACE weighs differently from the flat weights it starts from
    plain = run(DraftLoss(drafter, pw, attention="sdpa", loss="dense"), feats)
    _grads(drafter)
    assert abs(float(plain[0]) - float(ref[0])) > 0.05 * float(ref[0])
    chunked = DraftLoss(drafter, pw, attention="sdpa", loss="chunked", objective=DPACE)
    names = [k for k, _ in drafter.trainable_parameters()]
    for how, module in (("eager", chunked), ("compiled", torch.compile(chunked, backend="aot_eager"))):
        got = run(module, feats)
        _within_noise(got[0], exact[0], ref[0], f"{how} loss")
        assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
        for name, a, b, c in zip(names, _grads(drafter), g_ref, g_exact):
            assert float(c.abs().max()) > 0, name
            _within_noise(a, c, b, f"{how} {name}")


def test_draft_loss_refuses_dpace_over_decayed_weights(tiny):
    _, drafter = tiny
    with pytest.raises(ValueError, match="flat_weights"):
        DraftLoss(drafter, masks.position_weights(8, 4.0), objective=DPACE)


def test_a_dpace_batch_divides_by_its_loss_tokens():
    """With flat weights the batch's total is the count of loss-bearing predicted tokens, as upstream's
    loss divides by the loss mask's sum."""
    samples = [Sample(list(range(40)), [0] * 8 + [1] * 32), Sample(list(range(30)), [0] * 5 + [1] * 25)]
    b = make_batch(samples, pad_len=40, pad_id=0, step=0, seed=1, block_size=4, anchors=5,
                   pos_weights=masks.flat_weights(4))
    _, w = masks.block_labels(b.input_ids, b.loss_mask, b.anchors, b.valid, masks.flat_weights(4))
    assert b.weight_total == float((w > 0).sum()) == 3 * float(b.valid.sum())


# ---- the trainer ------------------------------------------------------------------------------------

def test_a_dpace_run_trains_end_to_end_and_its_loss_falls(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "trainer", *QUICK, "--steps", "60", "--log-every", "5",
                        "--position-weights", "dpace", "--out", str(out)],
                       cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.strip() == "", p.stderr[-3000:]
    assert "objective ce, D-PACE position weights (alpha 0.5)" in p.stdout and "gamma" not in p.stdout
    losses = step_losses(out)
    assert sorted(losses) == list(range(5, 61, 5))
    first, last = (losses[5] + losses[10]) / 2, (losses[55] + losses[60]) / 2
    acc = {m["step"]: m["accuracy"] for m in metrics(out) if "accuracy" in m}
    print(f"dpace loss: steps 5-10 {first:.3f}, steps 55-60 {last:.3f}; accuracy {acc[5]:.3f} -> {acc[60]:.3f}")
    assert last < 0.6 * first, losses
    assert (acc[55] + acc[60]) / 2 > (acc[5] + acc[10]) / 2 + 0.2, acc


@pytest.mark.parametrize("flags, needle", [
    (["--position-weights", "linear"], "--position-weights 'linear': expected one of exp, dpace"),
    (["--position-weights", "dpace", "--dpace-alpha", "0"], "--dpace-alpha is D-PACE's confidence smoothing, "
                                                            "in (0, 1]; got 0.0"),
    (["--dpace-alpha", "1.5"], "--dpace-alpha"),
    (["--dpace-alpha", "nan"], "--dpace-alpha"),
    (["--position-weights", "dpace", "--objective", "kd"], "--position-weights dpace weighs each position by the "
                                                           "drafter's confidence in the data's token (exp(-CE)): "
                                                           "it needs --objective ce, not kd"),
    (["--position-weights", "dpace", "--gamma", "4"], "--gamma 4 sets the fixed decay of --position-weights exp; "
                                                      "dpace has none (drop --gamma)"),
])
def test_bad_position_weight_settings_are_one_line_usage_errors(flags, needle):
    for check in (lambda: parse(["--steps", "3", *flags]), lambda: check_before_launch(flags)):
        with pytest.raises(UsageError) as e:
            check()
        assert needle in str(e.value) and "\n" not in str(e.value)
