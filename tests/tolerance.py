"""Tolerances of floating-point comparisons, from the precision and the size of the reduction.

Two computations of one function differ by their rounding, and by how much depends on the kernels:
torch picks its CPU code path per machine (ATEN_CPU_CAPABILITY default, avx2 or avx512), which changes
the order of sums and where multiply-adds fuse, and so does the number of threads. A tolerance read off
one machine's output fails on another (fp32 drafter states differ by 8.6e-6 with the default kernels and
by 1.7e-5 with AVX-512 and two threads). So every comparison here is bounded by the arithmetic itself:

- A sum or dot product of n terms in a precision of unit roundoff u = eps/2 is within
  gamma_n = n*u / (1 - n*u) of the exact value, relative to the sum of the terms' magnitudes (Higham,
  Accuracy and Stability of Numerical Algorithms, 2nd ed., 2002, section 3.1). Two results computed
  in different orders are each within that, so within about n*eps of each other.
- Reductions in series (a layer after a layer) add to first order: `n` is the total length of the
  reductions an output goes through (`drafter_chain` counts them for the drafter).
- `scale` is the magnitude of the terms; by default the largest |value| of the reference.

This is the worst case (typical errors are ~sqrt(n)*u); a real mistake (a mask off by one, a term
dropped, an update skipped) moves values by far more at the sizes these tests use.
"""
from __future__ import annotations

import torch


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def bound(dtype: torch.dtype, n: int, scale: float = 1.0) -> float:
    """How far two results of the same length-n reduction in `dtype` may lie apart, for terms of
    magnitude `scale` (for a relative error, leave scale at 1)."""
    return n * eps(dtype) * scale


def assert_close(got: torch.Tensor, want: torch.Tensor, *, n: int, dtype: torch.dtype | None = None,
                 scale: float | None = None, msg: str = "") -> None:
    """|got - want| <= bound(dtype, n, scale) everywhere; dtype defaults to got's, scale to max |want|."""
    assert got.shape == want.shape, (msg, got.shape, want.shape)
    dtype = dtype or got.dtype
    if scale is None:
        scale = float(want.detach().abs().max()) if want.numel() else 0.0
    diff = float((got.detach().double() - want.detach().double()).abs().max()) if got.numel() else 0.0
    limit = bound(dtype, n, max(scale, eps(dtype)))
    assert diff <= limit, (f"{msg}: max |got - want| = {diff:.3g} > {limit:.3g} "
                           f"(n {n} x eps {eps(dtype):.3g} x scale {scale:.3g})")


def drafter_chain(cfg, keys: int) -> int:
    """The reductions one drafter hidden state goes through: the fc over the target's features, then
    per layer two norms, q/k/v and gate/up (over the hidden size), the scores (head_dim), the weighted
    sum over `keys`, o_proj (heads x head_dim) and down_proj (intermediate size). A gradient goes
    through it twice (forward and back) plus the sum over the rows that share a weight."""
    per_layer = 4 * cfg.hidden_size + cfg.head_dim + keys + cfg.num_heads * cfg.head_dim + cfg.intermediate_size
    return cfg.num_target_layers * cfg.hidden_size + cfg.num_layers * per_layer


def loss_chain(cfg, keys: int, rows: int) -> int:
    """The draft loss's reductions: the drafter's (`keys` context and block positions), the final norm,
    the head's log-sum-exp over the vocabulary, and the sum over the `rows` that carry a loss."""
    return drafter_chain(cfg, keys) + cfg.hidden_size + cfg.vocab_size + rows


def trained_weights_bound(steps: int, chain: int) -> float:
    """How far (relative L2 per tensor) weights after `steps` AdamW steps may lie apart when each
    step's gradients are two orderings of a length-`chain` reduction: Adam's step is the gradient
    normalized elementwise, so its relative error is the gradient's, and steps add. (An element whose
    gradient is within rounding of zero may flip its step's sign; such elements are about as rare as the
    relative error itself, so they do not move the norm.) A skipped or doubled step moves the weights by
    lr / |w| relative, ~1e-2 in the tiny runs, far beyond this."""
    return steps * bound(torch.float32, 2 * chain)


# The tiny run of tests/trainer_quick.py (QUICK): the tiny target's drafter with one layer, 32-token
# rows, 4 anchors of block 4 per row, batch 4.
QUICK_CFG = dict(hidden_size=64, head_dim=16, num_heads=4, intermediate_size=128, num_target_layers=5,
                 num_layers=1, vocab_size=264)
QUICK_CHAIN = loss_chain(type("QuickDrafter", (), QUICK_CFG), keys=32 + 4 * 4, rows=4 * 4 * 4)
