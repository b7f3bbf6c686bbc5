"""The drafter's Linear layers: nn.Linear with the weight gradient written in fp32 by cuBLAS under
CUDA bf16 autocast, and the first layer's projections computed on a block's distinct rows only;
or, given an fp8 matmul (trainer/model/fp8.py, --precision fp8), that matmul while they train.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _has_mm_out_dtype() -> bool:
    try:
        return torch.ops.aten.mm.dtype is not None  # bf16 x bf16 -> fp32 matmul (CUDA), torch 2.8+
    except (AttributeError, RuntimeError):
        return False


# Whether Linear takes its fp32 weight-gradient path under CUDA bf16 autocast: this torch has the op,
# and configure() (TrainConfig.fp32_wgrad) has not turned it off (autocast's bf16 gradient then).
MM_OUT_DTYPE = _has_mm_out_dtype()
FP32_WGRAD = MM_OUT_DTYPE


def configure(fp32_wgrad: bool) -> None:
    """The weight gradient in fp32 from cuBLAS where this torch can (True), or autocast's bf16 (False)."""
    global FP32_WGRAD
    FP32_WGRAD = MM_OUT_DTYPE and fp32_wgrad


class _Bf16LinearFp32Grad(torch.autograd.Function):
    """F.linear as CUDA bf16 autocast computes it, with the weight's gradient leaving the matmul in fp32.

    Forward and input gradient are autocast's to the bit (both operands cast to bf16, bf16 out, the
    input gradient cast back to the input's dtype). Autocast's weight gradient is a bf16 matmul output
    that a separate pass then casts to the fp32 master weight's dtype; here cuBLAS writes fp32 itself
    (aten.mm.dtype): one pass less over every weight's gradient, and no bf16 rounding of it.
    """

    @staticmethod
    def forward(ctx, x, w):
        xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
        ctx.save_for_backward(xb, wb)
        ctx.x_dtype = x.dtype
        return F.linear(xb, wb)

    @staticmethod
    def backward(ctx, dy):
        xb, wb = ctx.saved_tensors
        dy = dy.to(torch.bfloat16)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (dy @ wb).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = torch.mm(dy.reshape(-1, dy.shape[-1]).t(), xb.reshape(-1, xb.shape[-1]), out_dtype=torch.float32)
        return dx, dw


def _bf16_fp32_grad(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a matmul of x by the fp32 weight w trains as _Bf16LinearFp32Grad computes it: CUDA bf16
    autocast, and FP32_WGRAD."""
    return (FP32_WGRAD and x.is_cuda and w.dtype == torch.float32 and w.requires_grad and torch.is_grad_enabled()
            and torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16)


def _fp8(layer: nn.Linear) -> bool:
    """Whether `layer` computes with its fp8 matmul now: it has one, and its weight trains."""
    return getattr(layer, "fp8", None) is not None and layer.weight.requires_grad and torch.is_grad_enabled()


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) whose fp32 weight gets its gradient in fp32 straight
    from the matmul when it trains under CUDA bf16 autocast; everywhere else plain nn.Linear. With an
    fp8 matmul set (fp8.use), that matmul computes it while it trains (not under no_grad)."""

    # an fp8.Fp8Matmul, set by fp8.use: (x, w) -> x @ w.T (fp8.py imports this module, not the reverse)
    fp8: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fp8(self):
            assert self.fp8 is not None     # _fp8 saw it
            return self.fp8(x, self.weight)
        if self.bias is None and _bf16_fp32_grad(x, self.weight):
            return _Bf16LinearFp32Grad.apply(x, self.weight)
        return super().forward(x)


def expand_blocks(t: torch.Tensor, lead: int, n_blocks: int, block_size: int) -> torch.Tensor:
    """Compact rows -> the stream they stand for. t (B, lead + n + 1, ...): `lead` rows kept as they are,
    then one row per block (its position 0) and the row that every block repeats at positions
    1..block_size-1. Returns (B, lead + n * block_size, ...)."""
    B, n = t.shape[0], n_blocks
    first = t[:, lead:lead + n, None]
    shared = t[:, lead + n:lead + n + 1, None].expand(B, n, block_size - 1, *t.shape[2:])
    blocks = torch.cat([first, shared], dim=2).flatten(1, 2)
    return torch.cat([t[:, :lead], blocks], dim=1) if lead else blocks


def predicted_rows(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, n * block_size, ...) -> (B, n * (block_size - 1), ...): each block without its position 0
    (the anchor's row, which has nothing to predict)."""
    B, T = t.shape[:2]
    blocks = t.view(B, T // block_size, block_size, *t.shape[2:])
    return blocks[:, :, 1:].reshape(B, (T // block_size) * (block_size - 1), *t.shape[2:])


class _BlockRowsLinear(torch.autograd.Function):
    """x @ w.T over a stream whose blocks repeat one row, computed on its distinct rows only.

    x (B, lead + n + 1, K) compact rows (expand_blocks' layout), w (N, K) fp32. Returns
    expand_blocks(x @ w.T): (B, lead + n * block_size, N), the same values as Linear on the full
    stream (under CUDA bf16 autocast: bf16 operands and output, as _Bf16LinearFp32Grad; else in
    x's dtype). The backward sums the repeated rows' output gradient in fp32 and applies that sum
    in fp32 (an outer product for w's gradient, a matrix-vector product for the shared row's): the
    full stream's matmuls add the same products in fp32, with no rounding of the sum in between
    (tests/test_linear_grads.py, eager and compiled, on a GPU).
    """

    @staticmethod
    def forward(ctx, x, w, lead: int, n_blocks: int, block_size: int, bf16: bool):
        xc, wc = (x.to(torch.bfloat16), w.to(torch.bfloat16)) if bf16 else (x, w.to(x.dtype))
        ctx.save_for_backward(xc, wc)
        ctx.layout = (lead, n_blocks, block_size, bf16, x.dtype, w.dtype)
        return expand_blocks(F.linear(xc, wc), lead, n_blocks, block_size)

    @staticmethod
    def backward(ctx, dy):
        xc, wc = ctx.saved_tensors
        lead, n, bs, bf16, x_dtype, w_dtype = ctx.layout
        B = dy.shape[0]
        dy = dy.to(wc.dtype)
        blocks = dy[:, lead:].view(B, n, bs, dy.shape[-1])
        rows = torch.cat([dy[:, :lead], blocks[:, :, 0]], dim=1)  # (B, lead + n, N): one output row each
        shared = blocks[:, :, 1:].sum(dim=(1, 2), dtype=torch.float32)  # (B, N): the repeated row's, summed
        # The shared row's terms as products and sums, not matmuls: torch.compile traces this backward
        # under the forward's autocast (torch 2.11: functorch's backward_pass_autocast
        # "same_as_forward"), which would run an fp32 matmul here in bf16 (measured: 5e-3 off).
        # Both use the operands the forward used (xc, wc), exactly, in fp32.
        dx = dw = None
        if ctx.needs_input_grad[0]:
            d_shared = (shared[:, :, None] * wc.float()[None]).sum(1)  # (B, K): shared_b @ wc
            dx = torch.cat([(rows @ wc).to(x_dtype), d_shared.to(x_dtype)[:, None]], dim=1)
        if ctx.needs_input_grad[1]:
            flat, x_rows = rows.flatten(0, 1), xc[:, :lead + n].flatten(0, 1)  # (B*(lead+n), N), (.., K)
            dw = torch.mm(flat.t(), x_rows, out_dtype=torch.float32) if bf16 else flat.t() @ x_rows
            dw = dw.float() + (shared[:, :, None] * xc[:, None, lead + n].float()).sum(0)  # + sum_b shared_b (x) x_b
            dw = dw.to(w_dtype)
        return dx, dw, None, None, None, None


def block_rows_linear(layer: nn.Linear, x: torch.Tensor, lead: int, n_blocks: int, block_size: int) -> torch.Tensor:
    """`layer` (bias-free) on the stream that the compact rows x stand for (expand_blocks' layout):
    its matmuls run on lead + n + 1 rows per sample instead of lead + n * block_size."""
    bf16 = _bf16_fp32_grad(x, layer.weight)
    if _fp8(layer) or (not bf16 and torch.is_autocast_enabled(x.device.type)):
        # fp8 on the distinct rows (the input's amax, so its scale, is the full stream's), or another autocast
        return expand_blocks(layer(x), lead, n_blocks, block_size)  # as Linear computes it
    return _BlockRowsLinear.apply(x, layer.weight, lead, n_blocks, block_size, bf16)
