"""trainer/model/ce_kernel.py: the chunked loss's cross-entropy core as one Triton kernel, on a GPU.

Checked against float64 on identical inputs, with the torch core (fused_ce._ce_core, what runs
without the kernel) as the yardstick of float32 noise: the kernel may be as far from float64 as
that core is, not farther. Only a GPU with Triton runs this file (the CPU build has no Triton);
the CPU suite checks the torch core against the unfused loss (tests/test_trainer_kernels.py).
"""
from __future__ import annotations

import pytest
import torch

import torch.nn.functional as F

from trainer.model import ce_kernel, fused_ce, masks
from trainer.model.drafter import RMSNorm

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and ce_kernel.triton is not None),
                                reason="the Triton kernel needs a GPU")


def _inputs(C: int, V: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(C, V, device="cuda", generator=g) * 4).to(torch.bfloat16)
    labels = torch.randint(0, V, (C,), device="cuda", generator=g)
    weights = torch.rand(C, device="cuda", generator=g)
    weights[::5] = 0.0  # rows that carry no loss
    # ties for the argmax: row 1's maximum twice, in different blocks of any block size
    top = logits[1].max()
    logits[1, 3] = top
    logits[1, V - 2] = top
    return logits, labels, weights


def _float64(logits, labels, weights):
    lf, w = logits.double(), weights.double()
    lse = torch.logsumexp(lf, -1)
    loss = ((lse - lf.gather(1, labels[:, None])[:, 0]) * w).sum()
    p = torch.exp(lf - lse[:, None])
    hit = torch.arange(lf.shape[1], device=lf.device)[None, :] == labels[:, None]
    return loss, torch.where(hit, p - 1.0, p) * w[:, None]


@pytest.mark.parametrize("C,V", [(64, 151936), (37, 5003), (8, 100)])
def test_the_kernel_is_as_close_to_float64_as_the_torch_core(C, V):
    logits, labels, weights = _inputs(C, V)
    ref_loss, ref_grad = _float64(logits, labels, weights)
    k_loss, k_pred, k_grad = ce_kernel.ce_core(logits, labels, weights)
    t_loss, t_pred, t_grad = fused_ce._ce_core(logits, labels, weights)
    assert k_grad.dtype == logits.dtype and k_pred.dtype == torch.int64 and k_loss.dtype == torch.float32
    k_err, t_err = abs(float(k_loss) - float(ref_loss)), abs(float(t_loss) - float(ref_loss))
    assert k_err <= max(4 * t_err, 2e-7 * abs(float(ref_loss))), (k_err, t_err)
    # the gradient: a bf16 rounding of the same float32 value, as the torch core's
    kg, tg = (k_grad.double() - ref_grad).abs().max(), (t_grad.double() - ref_grad).abs().max()
    assert kg <= 1.5 * tg + 1e-12, (float(kg), float(tg))  # a wrong value is off by far more than a rounding
    assert torch.equal(k_grad[weights == 0], torch.zeros_like(k_grad[weights == 0]))
    first_max = torch.where(logits == logits.max(-1, keepdim=True).values,
                            torch.arange(V, device="cuda"), V).min(-1).values
    assert torch.equal(k_pred, first_max) and int(k_pred[1]) == 3  # the first of equal maxima


def test_the_chunked_loss_with_the_kernel_compiled_and_eager(monkeypatch):
    """fused_ce.block_loss as the trainer runs it (under torch.compile, and eagerly) with the kernel,
    against the same loss without it: the loss to float32 rounding, the same predictions, and the
    gradients no farther apart than the unfused loss (full logits, autograd) is from it: that
    distance is this bf16 arithmetic's own noise."""
    g = torch.Generator(device="cuda").manual_seed(1)
    H, V, B, T, bs = 64, 3001, 2, 45, 15
    norm = RMSNorm(H, eps=1e-6).cuda()
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(H, device="cuda", generator=g))
    lm = torch.randn(V, H, device="cuda", generator=g).to(torch.bfloat16) * 0.2
    labels = torch.randint(0, V, (B, T), device="cuda", generator=g)
    weights = torch.rand(B, T, device="cuda", generator=g)
    hidden = torch.randn(B, T, H, device="cuda", generator=g)

    def run(fn):
        h = hidden.clone().requires_grad_(True)
        norm.weight.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, correct, count = fn(h, norm, lm, labels, weights, bs, 16)
        loss.backward()
        return loss.detach(), correct, h.grad, norm.weight.grad.clone()

    def unfused(h, norm, lm, labels, weights, bs, rows):
        return masks.block_loss(F.linear(norm(h), lm), labels, weights, bs)

    with_kernel = run(fused_ce.block_loss)
    compiled = run(torch.compile(fused_ce.block_loss, dynamic=False))
    monkeypatch.setattr(ce_kernel, "ENABLED", False)
    without = run(fused_ce.block_loss)
    dense = run(unfused)

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    noise = [rel(d, w) for d, w in zip(dense[2:], without[2:])]
    assert max(noise) > 0, "the yardstick must measure something"
    for got in (with_kernel, compiled):
        assert float(got[0]) == pytest.approx(float(without[0]), rel=2e-6)
        assert torch.equal(got[1], without[1])
        for a, b, n in zip(got[2:], without[2:], noise):
            assert rel(a, b) <= 2 * n, (rel(a, b), n)
