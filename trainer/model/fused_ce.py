"""Final norm -> lm_head -> weighted cross-entropy, chunk by chunk, never holding all the logits.

At the 8B shape one sample's logits are 4096 x 151936: 1.2 GB in bf16, 2.5 GB once upcast for the
loss, and autograd keeps them for the backward. The target's lm_head is frozen, so the gradients
wanted are d loss / d hidden and d loss / d norm weight (the drafter's own final norm; none when it
is the target's, frozen), and the loss is a sum: they can be computed during the forward, chunk by
chunk (Liger-Kernel's fused linear cross-entropy does the same). Per chunk of rows: logits =
lm_head(norm(h)); CE, argmax and d CE / d logits = (softmax - onehot) * w in one pass; d h and
d norm weight = backprop of that through lm_head and the norm. The backward only scales them by the
incoming gradient. Peak memory drops from the full logits to one chunk of them; the matmuls are the
same two per chunk (forward and d input) that autograd would run.

    loss_sum, correct, count = block_loss(hidden, drafter.norm, drafter.lm_head.weight,
                                          labels, weights, block_size)

Same interface, arithmetic and dtypes as masks.block_loss(drafter.logits(hidden), ...):
tests/test_trainer_kernels.py checks value and gradient against it.

The per-chunk core (CE, argmax, d CE / d logits) is, on a GPU with Triton, one Triton kernel
(trainer/model/ce_kernel.py: two passes over the logits; tests/test_ce_kernel.py); else _ce_core, run
compiled on its own outside torch.compile (eager policy on CUDA) and as torch ops inside it.

Distilled (--objective kd or ce+kd, trainer/model/objective.py): `teacher` gives the target's final
hidden states at the same rows (after its final norm), and each chunk also computes the target's
logits through the same frozen lm_head, so one chunk of each is held at a time (chunk_rows then
halves the rows). Its core is _distill_core, in torch (compiled on its own on CUDA, as _ce_core
is); the Triton kernel computes the CE alone and is not used then. Same interface and arithmetic
as masks.block_loss and masks.block_kd on the full logits (tests/test_distill.py).

D-PACE (--position-weights dpace, masks.dpace_weights): a row's weight depends on the CE of every
row of its block, so each chunk holds whole blocks (its rows rounded down to a multiple of the
block's), and its core (_dpace_core, in torch like _distill_core) computes the chunk's CE, then the
weights, then the weighted gradient: no pass more over the logits (tests/test_dpace.py).
"""
from __future__ import annotations

import threading
import warnings

import torch
import torch.nn.functional as F

from trainer.model import ce_kernel, masks
from trainer.model.objective import Objective

# Rows per chunk: the largest power of two whose fp32 logits stay under this many bytes (1024 at
# the 8B shape); longer chunks are no faster on the H200 (benchmarks/gemm_bench.py,
# docs/decisions.md). configure(N) (TrainConfig.ce_rows) fixes the rows instead, for an A/B.
CHUNK_BYTES = 1 << 30
ROWS: int | None = None


def chunk_rows(n_rows: int, vocab: int) -> int:
    rows = 1
    while rows * 2 * vocab * 4 <= CHUNK_BYTES and rows * 2 <= n_rows:
        rows *= 2
    return rows


def configure(rows: int | None) -> None:
    """Fix the rows per chunk for this process (ValueError unless positive), or None: chunk_rows'."""
    global ROWS
    if rows is not None and rows < 1:
        raise ValueError(f"expected a positive number of rows, e.g. 2048, got {rows!r}")
    ROWS = rows


def _ce_core(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """logits (C, V), labels (C,), weights (C,) -> (sum w*CE fp32, argmax (C,), d sum / d logits (C, V))."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)  # (C,)
    target = lf.gather(1, labels[:, None])[:, 0]
    loss = ((lse - target) * weights).sum()
    p = torch.exp(lf - lse[:, None])
    hit = torch.arange(lf.shape[-1], device=lf.device)[None, :] == labels[:, None]
    grad = (torch.where(hit, p - 1.0, p) * weights[:, None]).to(logits.dtype)
    return loss, logits.argmax(-1), grad


def _distill_core(logits: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                  temperature: float, ce_weight: float, kd_weight: float):
    """logits (C, V) the drafter's, teacher (C, V) the target's, labels (C,), weights (C,) -> (sum
    w * (ce_weight * CE + kd_weight * KD) fp32, argmax (C,), d sum / d logits (C, V)). KD as
    masks.block_kd: T^2 KL(p_T || q_T), whose gradient is T (q_T - p_T). ce_weight 0: no CE."""
    t = temperature
    lf = logits.float()
    log_q = torch.log_softmax(lf / t, dim=-1)
    log_p = torch.log_softmax(teacher.float() / t, dim=-1)
    p = torch.exp(log_p)
    row = (kd_weight * t * t) * (p * (log_p - log_q)).sum(-1)  # (C,)
    grad = (kd_weight * t) * (torch.exp(log_q) - p)
    if ce_weight:
        lse = torch.logsumexp(lf, dim=-1)
        row = row + ce_weight * (lse - lf.gather(1, labels[:, None])[:, 0])
        soft = torch.exp(lf - lse[:, None])
        hit = torch.arange(lf.shape[-1], device=lf.device)[None, :] == labels[:, None]
        grad = grad + ce_weight * torch.where(hit, soft - 1.0, soft)
    loss = (row * weights).sum()
    return loss, logits.argmax(-1), (grad * weights[:, None]).to(logits.dtype)


def _dpace_core(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, block: int, alpha: float):
    """logits (C, V), labels (C,), mask (C,) with C whole blocks of `block` rows -> (sum d*CE fp32,
    argmax (C,), d sum / d logits (C, V)), d = masks.dpace_weights(CE, mask, block, alpha) (no gradient
    flows through d, as in masks.block_loss)."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)  # (C,)
    ce = lse - lf.gather(1, labels[:, None])[:, 0]
    w = masks.dpace_weights(ce, mask, block, alpha)
    loss = (ce * w).sum()
    p = torch.exp(lf - lse[:, None])
    hit = torch.arange(lf.shape[-1], device=lf.device)[None, :] == labels[:, None]
    grad = (torch.where(hit, p - 1.0, p) * w[:, None]).to(logits.dtype)
    return loss, logits.argmax(-1), grad


class _TriedOnce:
    """A faster way to run a core's math (_ce_core's or _distill_core's), used until it fails once
    outside torch.compile (process-wide); from then on `fallback`, after one warning that says why
    (`reason`). Under torch.compile the graph gets `traced`, the same math as plain ops (or ops
    torch.compile takes). `make` builds the fast function at its first call, in the calling thread."""

    def __init__(self, what: str, make, traced, fallback, instead: str):
        self.what, self.make, self.traced, self.fallback, self.instead = what, make, traced, fallback, instead
        self.fn = None
        self.reason: str | None = None
        self._lock = threading.Lock()

    def __call__(self, *args):
        if self.reason is None:
            if torch.compiler.is_compiling():
                return self.traced(*args)
            with self._lock:
                if self.fn is None:
                    self.fn = self.make()
            try:
                return self.fn(*args)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - the fallback computes the same; training must go on
                self.reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                warnings.warn(f"{self.what} failed ({self.reason}); {self.instead}", RuntimeWarning, stacklevel=2)
        return self.fallback(*args)


# _ce_core compiled on its own where nothing around it is (eager policy on CUDA): one fused
# reduction and one fused pointwise pass over each chunk instead of ~8 separate eager passes.
_compiled = _TriedOnce("compiled cross-entropy core", lambda: torch.compile(_ce_core, dynamic=False),
                       traced=_ce_core, fallback=_ce_core, instead="running it eagerly")
# The core in one Triton kernel, two passes per row (a GPU with Triton, ce_kernel.available); it
# falls back to the torch core where Triton cannot build it.
_kernel = _TriedOnce("the Triton cross-entropy kernel", lambda: ce_kernel.ce_core, traced=ce_kernel.ce_core,
                     fallback=_compiled, instead="using the torch core (--ce-kernel off skips the attempt)")
# _distill_core compiled on its own likewise (the eager policy on CUDA)
_compiled_distill = _TriedOnce("compiled distillation core", lambda: torch.compile(_distill_core, dynamic=False),
                               traced=_distill_core, fallback=_distill_core, instead="running it eagerly")
# _dpace_core compiled on its own likewise
_compiled_dpace = _TriedOnce("compiled D-PACE cross-entropy core", lambda: torch.compile(_dpace_core, dynamic=False),
                             traced=_dpace_core, fallback=_dpace_core, instead="running it eagerly")


class _LinearCE(torch.autograd.Function):
    """loss_sum and argmax of rms_norm(h) @ lm_w.T (distilled: against teacher @ lm_w.T as well);
    grads for h and norm_w (lm_head is frozen)."""

    @staticmethod
    def forward(ctx, h, norm_w, lm_w, labels, weights, eps: float, rows: int, fp8, teacher=None,
                temperature: float = 1.0, ce_weight: float = 1.0, kd_weight: float = 0.0,
                dpace: float | None = None, block: int = 1):
        # h (T, H) in the residual dtype; norm_w (H,); lm_w (V, H); labels, weights (T,); fp8 an
        # fp8.Fp8Head for the two lm_head matmuls, or None; teacher (T, H) the target's final
        # hidden states at the same rows (distilled; no gradient), or None (CE alone); dpace the
        # D-PACE alpha (weights are then the loss mask, `rows` whole blocks of `block` rows) or None
        want_grad = ctx.needs_input_grad[0]
        want_norm = ctx.needs_input_grad[1]
        dnorm = torch.zeros(norm_w.shape, dtype=torch.float32, device=h.device) if want_norm else None
        core = (_kernel if ce_kernel.available(h.device) else
                _compiled if h.device.type == "cuda" else _ce_core)
        distill = _compiled_distill if h.device.type == "cuda" else _distill_core
        dpace_core = _compiled_dpace if h.device.type == "cuda" else _dpace_core
        loss = h.new_zeros((), dtype=torch.float32)
        preds, grads = [], []
        w8 = fp8.weight(lm_w) if fp8 is not None else None
        for s in range(0, h.shape[0], rows):
            hc = h[s:s + rows]
            # RMSNorm exactly as model.RMSNorm computes it (so that the dense path's numbers come out)
            x = hc.float()
            r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            xn = x * r
            y = norm_w * xn.to(hc.dtype)
            # (C, V): bf16 under autocast, as lm_head() would give
            logits = F.linear(y, lm_w) if fp8 is None else fp8.logits(y, w8, _out_dtype(y))
            if dpace is not None:
                chunk_loss, pred, dlogits = dpace_core(logits, labels[s:s + rows], weights[s:s + rows], block, dpace)
            elif teacher is None:
                chunk_loss, pred, dlogits = core(logits, labels[s:s + rows], weights[s:s + rows])
            else:  # the target's own logits (plain matmul, under --precision fp8-lmhead too)
                chunk_loss, pred, dlogits = distill(logits, F.linear(teacher[s:s + rows], lm_w), labels[s:s + rows],
                                                    weights[s:s + rows], temperature, ce_weight, kd_weight)
            loss = loss + chunk_loss
            preds.append(pred)
            if want_grad or want_norm:
                # (C, H): autocast's bf16 matmul, like linear's backward
                dy = (dlogits @ lm_w if fp8 is None else fp8.grad_input(dlogits, w8, dlogits.dtype)).float()
            if want_norm:
                dnorm += (dy * xn.to(hc.dtype).float()).sum(0)  # y = norm_w * xn (in h's dtype)
            if want_grad:
                dxn = dy * norm_w.float()
                dx = r * (dxn - xn * (dxn * xn).mean(-1, keepdim=True))  # RMSNorm backward
                grads.append(dx.to(h.dtype))
        pred = torch.cat(preds)
        ctx.mark_non_differentiable(pred)
        ctx.norm_dtype = norm_w.dtype
        ctx.save_for_backward(torch.cat(grads) if want_grad else None, dnorm)
        return loss, pred

    @staticmethod
    def backward(ctx, grad_loss, grad_pred):
        dh, dnorm = ctx.saved_tensors
        dh = dh * grad_loss.to(dh.dtype) if dh is not None else None
        dnorm = (dnorm * grad_loss).to(ctx.norm_dtype) if dnorm is not None else None
        return dh, dnorm, None, None, None, None, None, None, None, None, None, None, None, None


def _out_dtype(y: torch.Tensor) -> torch.dtype:
    """The dtype F.linear gives y's matmul: autocast's where it is on, else y's."""
    return torch.get_autocast_dtype(y.device.type) if torch.is_autocast_enabled(y.device.type) else y.dtype


def block_loss(hidden: torch.Tensor, norm, lm_weight: torch.Tensor, labels: torch.Tensor,
               weights: torch.Tensor, block_size: int, rows: int | None = None, fp8=None,
               teacher: torch.Tensor | None = None, objective: Objective | None = None):
    """masks.block_loss(lm_head(norm(hidden)), labels, weights, block_size) without the full logits.

    hidden (B, Tq, H); norm an RMSNorm (weight, eps); lm_weight (V, H); labels, weights (B, Tq).
    Returns loss_sum (scalar), correct (Bs,), count (Bs,). Needs the lm_head frozen (requires_grad
    False): its gradient is not computed. The norm's is, when its weight requires grad. `fp8` (an
    fp8.Fp8Head, --precision fp8-lmhead) computes the lm_head's two matmuls (DraftLoss passes it
    while gradients are computed only). With `teacher` (B, Tq, H), the target's final hidden states
    at the same rows, and a distilling `objective`, loss_sum is its mix of CE and KD instead:
    ce_weight * masks.block_loss's + kd_weight * masks.block_kd(lm_head(norm(hidden)),
    lm_head(teacher), weights, T) (Objective.weights). With an objective whose position weights are
    D-PACE's, `weights` are the loss mask and loss_sum is masks.block_loss(..., dpace=alpha)'s; the
    chunks then hold whole blocks of `block_size` rows (`rows` rounded down to a multiple of it).
    """
    if lm_weight.requires_grad:
        raise ValueError("fused_ce.block_loss computes no gradient for the lm_head: "
                         "freeze it (the target's) or use masks.block_loss")
    if (teacher is None) != (objective is None or not objective.distills):
        raise ValueError("fused_ce.block_loss distils with the target's hidden states (teacher) and a kd or "
                         "ce+kd objective, both or neither")
    h = hidden.flatten(0, 1)  # (T, H)
    T, V = h.shape[0], lm_weight.shape[0]
    if objective is not None and objective.dpace:
        # whole blocks per chunk: a row's weight reads every row of its block
        rows = rows or ROWS or chunk_rows(T, V)
        rows = max(block_size, rows // block_size * block_size)
        loss_sum, pred = _LinearCE.apply(h, norm.weight, lm_weight, labels.flatten(), weights.flatten(),
                                         norm.eps, rows, fp8, None, 1.0, 1.0, 0.0, objective.dpace_alpha,
                                         block_size)
    elif teacher is None:
        rows = rows or ROWS or chunk_rows(T, V)
        loss_sum, pred = _LinearCE.apply(h, norm.weight, lm_weight, labels.flatten(), weights.flatten(),
                                         norm.eps, rows, fp8)
    else:  # two chunks of logits at a time, the drafter's and the target's: half the rows in the same bytes
        assert objective is not None        # a teacher comes with a distilling objective (checked above)
        rows = rows or ROWS or chunk_rows(T, 2 * V)
        loss_sum, pred = _LinearCE.apply(h, norm.weight, lm_weight, labels.flatten(), weights.flatten(),
                                         norm.eps, rows, fp8, teacher.detach().flatten(0, 1),
                                         objective.kd_temperature, *objective.weights)
    live = (weights > 0).view(weights.shape[0], -1, block_size)  # (B, N, Bs)
    hit = (pred.view_as(labels) == labels).view_as(live) & live
    return loss_sum, hit.sum(dim=(0, 1)), live.sum(dim=(0, 1))
