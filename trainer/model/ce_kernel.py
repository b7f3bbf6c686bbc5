"""The cross-entropy core of the chunked loss as one Triton kernel: two passes over each row of logits.

fused_ce._ce_core computes, for a chunk of logits (C, V) in bf16: the weighted CE sum, the argmax
and d CE / d logits = (softmax - onehot) * w. Inductor fuses it into one kernel that reads each
row three times (max and argmax, the exponentials' sum, then the gradient) and writes the gradient
once (docs/benchmarks.md has its speed on an H200). Here pass 1 is
an online softmax (running max and sum of exponentials, rescaled as the max grows) with the argmax
and the label's logit, and pass 2 writes the gradient: two reads and a write.

    loss_sum, pred, grad = ce_core(logits, labels, weights)   # as fused_ce._ce_core

A `torch.library.triton_op`, so torch.compile traces into it (the trainer's compiled DraftLoss) and
eager code calls it as an op. CUDA only, and only where Triton imports: `available()` says; else
fused_ce uses its torch core. Same arithmetic in float32, summed in another order: the loss and
gradient agree with _ce_core to float32 rounding, and the argmax picks the first of equal maxima
as torch's does (tests/test_ce_kernel.py, on a GPU). configure(False) (--ce-kernel off) turns it off.
"""


import torch

try:  # Triton ships with torch's CUDA builds; a CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the build
    triton = None


ENABLED = True  # configure(False) (TrainConfig.ce_kernel off) leaves the core to torch


def configure(enabled: bool) -> None:
    global ENABLED
    ENABLED = enabled


def available(device: torch.device) -> bool:
    return triton is not None and torch.device(device).type == "cuda" and ENABLED


if triton is not None:
    @triton.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=w) for b, w in
                              ((2048, 8), (4096, 8), (4096, 16), (8192, 16))], key=["V"])
    @triton.jit
    def _ce_rows(logits_ptr, row_stride, labels_ptr, weights_ptr, loss_ptr, pred_ptr, grad_ptr, grad_stride, V,
                 BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        src = logits_ptr + row * row_stride
        offs = tl.arange(0, BLOCK)
        # pass 1: running max m, sum of exp(x - m), first index of the max
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        best_idx = tl.zeros((), tl.int64)
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = tl.load(src + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            blk_max = tl.max(x, 0)
            blk_idx = tl.min(tl.where(x == blk_max, cols, V), 0).to(tl.int64)  # first of equal maxima
            best_idx = tl.where(blk_max > m, blk_idx, best_idx)  # strictly greater: earlier blocks win ties
            new_m = tl.maximum(m, blk_max)
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
            m = new_m
        lse = m + tl.log(s)
        label = tl.load(labels_ptr + row)
        w = tl.load(weights_ptr + row).to(tl.float32)
        target = tl.load(src + label).to(tl.float32)
        tl.store(loss_ptr + row, (lse - target) * w)
        tl.store(pred_ptr + row, best_idx)
        # pass 2: d CE / d logits = (softmax - onehot) * w, in the logits' dtype
        dst = grad_ptr + row * grad_stride
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = tl.load(src + cols, mask=cols < V, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            g = tl.where(cols == label, p - 1.0, p) * w
            tl.store(dst + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < V)

    @torch.library.triton_op("dflash::ce_core", mutates_args=())
    def _ce_core_op(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor]:
        C, V = logits.shape
        rows = torch.empty((C,), dtype=torch.float32, device=logits.device)
        pred = torch.empty((C,), dtype=torch.int64, device=logits.device)
        grad = torch.empty_like(logits)
        torch.library.wrap_triton(_ce_rows)[(C,)](logits, logits.stride(0), labels, weights, rows, pred, grad,
                                                 grad.stride(0), V)
        return rows, pred, grad


def ce_core(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """logits (C, V) on CUDA, labels (C,) int64, weights (C,) -> (sum w*CE fp32, argmax (C,), grad (C, V))."""
    rows, pred, grad = _ce_core_op(logits.contiguous(), labels.contiguous(), weights.contiguous())
    return rows.sum(), pred, grad
