"""The optimizer update as one compiled function: clip to the global norm + AdamW, in one pass.

The update is bound by memory: it reads and writes the drafter's weights, gradients and both
moments (28 bytes per parameter). torch's fused AdamW streams them below a copy's speed, slower
still with the clip folded in (grad_scale / found_inf); the same update written as plain tensor
math and compiled by inductor streams at a copy's speed (docs/benchmarks.md has the figures). So on a
GPU under a compiled policy the update is this module's function over the SAME torch.optim.AdamW's
state (its `exp_avg`, `exp_avg_sq`, `step` tensors and param_groups): checkpoints, resume and
the eager path are unchanged, and the optimizer object stays the one source of truth.

The math is clip_grad_norm_ followed by AdamW's step, as torch's fused kernel computes it:

    norm = ||all grads||_2;  coef = min(1, clip / (norm + 1e-6));  g = coef * grad
    step += 1;  bc1 = 1 - beta1^step;  bc2 = 1 - beta2^step
    param *= 1 - lr * weight_decay
    exp_avg = beta1 * exp_avg + (1 - beta1) * g;  exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g^2
    param -= (lr / bc1) * exp_avg / (sqrt(exp_avg_sq) / sqrt(bc2) + eps)

and a non-finite norm changes nothing (weights, moments and step counts keep their values, on
the device, without the host waiting): the caller raises on it. tests/test_update.py checks it
against clip_grad_norm_ + torch's AdamW on identical inputs.
"""
from __future__ import annotations

from typing import Sequence, cast

import torch


@torch.no_grad()
def clip_adamw_(params: Sequence[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], lr: torch.Tensor, clip: torch.Tensor,
                beta1: float, beta2: float, eps: float, weight_decay: float) -> torch.Tensor:
    """The update in place (see the module doc); returns the pre-clip global norm (a device tensor).

    lr and clip are 0-d float32 tensors on the device (values that change between steps must not
    be graph constants); betas, eps and weight decay are fixed for a run."""
    norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    keep = torch.isfinite(total)
    coef = torch.clamp(clip / (total + 1e-6), max=1.0)
    step = steps[0] + keep.to(steps[0].dtype)
    # In float64, as torch's fused kernel computes them: 1 - beta2^step cancels (0.05 at step 1
    # with beta2 0.95), so float32 here would cost ~1e-6 of relative error in every update.
    t = step.to(torch.float64)
    bc1 = (1 - beta1 ** t).to(torch.float32)
    bc2_sqrt = torch.sqrt(1 - beta2 ** t).to(torch.float32)
    step_size = lr / bc1
    decay = 1 - lr * weight_decay
    for s in steps:
        s.copy_(step)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        g = g * coef
        m_new = beta1 * m + (1 - beta1) * g
        v_new = beta2 * v + (1 - beta2) * g * g
        p_new = p * decay - step_size * m_new / (torch.sqrt(v_new) / bc2_sqrt + eps)
        m.copy_(torch.where(keep, m_new, m))
        v.copy_(torch.where(keep, v_new, v))
        p.copy_(torch.where(keep, p_new, p))
    return total


class CompiledUpdate:
    """clip_adamw_ over `optimizer`'s state, compiled once (in the thread that calls it first).

    `optimizer` is the replica's torch.optim.AdamW (one param group over `params`); its state is
    created here on the first call exactly as torch creates it for the fused AdamW (a float32
    `step` on the parameter's device, zeroed moments), so a checkpoint holds the same thing either
    way. `compiled=False` runs the same function uncompiled (tests); `backend` is torch.compile's.

    If the compile fails (a torch whose dynamo or inductor cannot take it), the call raises
    CompileFailed before anything was changed, and the caller runs torch's own AdamW instead."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], compiled: bool = True,
                 backend="inductor"):
        if len(optimizer.param_groups) != 1:
            raise ValueError("CompiledUpdate: one param group expected")
        if optimizer.param_groups[0].get("amsgrad") or optimizer.param_groups[0].get("maximize"):
            raise ValueError("CompiledUpdate: amsgrad and maximize are not supported")
        self.optimizer, self.params = optimizer, params
        device = params[0].device
        self._lr = torch.zeros((), dtype=torch.float32, device=device)
        self._clip = torch.zeros((), dtype=torch.float32, device=device)
        self._fn = torch.compile(clip_adamw_, dynamic=False, backend=backend) if compiled else clip_adamw_
        self._ran = False

    def _state(self) -> tuple[list, list, list]:
        st = self.optimizer.state
        for p in self.params:
            if not st[p]:
                st[p]["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif st[p]["step"].device != p.device or st[p]["step"].dtype != torch.float32:
                st[p]["step"] = st[p]["step"].to(device=p.device, dtype=torch.float32)
        return ([st[p]["exp_avg"] for p in self.params], [st[p]["exp_avg_sq"] for p in self.params],
                [st[p]["step"] for p in self.params])

    def __call__(self, lr: float, grad_clip: float) -> torch.Tensor:
        """One step at `lr` (the caller also records it in the param group, as for torch's AdamW);
        returns the pre-clip norm as a device tensor (read it after queuing more work)."""
        group = self.optimizer.param_groups[0]
        self._lr.fill_(lr)
        self._clip.fill_(grad_clip)
        m, v, steps = self._state()
        beta1, beta2 = group["betas"]
        try:
            grads = cast(list[torch.Tensor], [p.grad for p in self.params])    # every parameter has one (step.py)
            out = self._fn(self.params, grads, m, v, steps, self._lr, self._clip,
                           float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]))
        except Exception as e:
            # The first call compiles; dynamo and inductor raise before any kernel has run.
            if self._ran or not type(e).__module__.startswith(("torch._dynamo", "torch._inductor")):
                raise
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise CompileFailed(f"{type(e).__name__}: {first}") from e
        self._ran = True
        return out


class CompileFailed(RuntimeError):
    """The compiled update could not be compiled; nothing was updated."""
