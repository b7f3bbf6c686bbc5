"""Muon for the drafter's weight matrices, AdamW for its other parameters, as one optimizer (--optimizer muon).

Upstream: vLLM's speculators 0.9.0 trains DFlash drafters with `--optimizer muon`, its default
(speculators/train/optimizers.py, build_optimizers): torch.optim.Muon over every trainable 2-D
matrix with both sides > 1 whose name is not an embedding, codebook or vocabulary head, and a
torch.optim.AdamW over the rest (norms, biases), both stepped after one clip_grad_norm_ over all
parameters (speculators/train/trainer.py). Its Muon settings (speculators/train/config/schema.py,
OptimizerArgs): lr --muon-lr (default: --lr), momentum 0.95, weight decay 0.1, 5 Newton-Schulz
steps, adjust_lr_fn "match_rms_adamw"; each optimizer follows the same schedule from its own base
lr. Here the drafter's trainable parameters are its fc, attention and MLP matrices (Muon) and its
norms (AdamW); the embedding and lm_head are the target's, frozen.

The update of a matrix W (A x B) with gradient G, torch.optim.Muon's (torch/optim/_muon.py): Keller
Jordan's Muon (kellerjordan.github.io/posts/muon) with Moonshot's scale ("Muon is Scalable for LLM
Training", arXiv 2502.16982), which gives the update AdamW's RMS so that AdamW's lr carries over:

    M = mu M + (1 - mu) G                        the momentum buffer, fp32 like W
    U = (1 - mu) G + mu M  (Nesterov)
    O = NS5(U)                                   ~ the nearest semi-orthogonal matrix, in bf16
    W = W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O

NS5 (newton_schulz5) is the quintic Newton-Schulz iteration X <- a X + (b X X^T + c (X X^T)^2) X,
(a, b, c) = (3.4445, -4.7750, 2.0315), 5 steps from X = U / ||U||_F (on U^T when A > B), in bf16
as upstream: it maps every singular value into roughly [0.7, 1.2] rather than exactly 1, which
Keller Jordan found no worse.

The AdamW part is torch.optim.AdamW's arithmetic (the single-tensor path) on the non-matrix
parameters. One torch Optimizer holds both as two param groups ("adamw", then "muon"), so the
replica's optimizer, its state_dict, the checkpoints and the resume are as with AdamW alone: the
moments and the momentum buffer stay fp32, as the weights do. queue_update sets every group's lr to
the schedule's; the Muon group scales it by --muon-lr / --lr. The clip is the caller's
(clip_grad_norm_ over all parameters, before step). tests/test_muon.py checks the update against
torch.optim.Muon + torch.optim.AdamW on identical inputs.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)   # Keller Jordan's quintic, as torch.optim.Muon's
NS_STEPS = 5
NS_EPS = 1e-7
# Names that stay on AdamW even when 2-D (speculators' _ADAMW_NAME_HINTS): vocabulary-indexed tables
# and heads, whose rows are not a layer's linear map. The drafter borrows both from the target, frozen.
ADAMW_NAMES = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class MuonSettings:
    """--muon-lr (its peak; the schedule of --lr scales it), --muon-momentum, --muon-weight-decay."""
    lr: float
    momentum: float = 0.95
    weight_decay: float = 0.1
    nesterov: bool = True
    ns_steps: int = NS_STEPS


def takes_muon(name: str, p: torch.Tensor) -> bool:
    """A matrix of a layer (2-D, both sides > 1, not an embedding or head): Muon's; else AdamW's."""
    return p.ndim == 2 and min(p.shape) > 1 and not any(n in name for n in ADAMW_NAMES)


@torch.no_grad()
def newton_schulz5(g: torch.Tensor, steps: int = NS_STEPS, eps: float = NS_EPS,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """G (A, B) -> ~ U V^T of G = U S V^T: the quintic Newton-Schulz iteration in `dtype` (see the
    module doc), as torch.optim.Muon computes it (its addmm's, in bf16 by default)."""
    if g.ndim != 2:
        raise ValueError(f"Newton-Schulz orthogonalises matrices, got shape {tuple(g.shape)}")
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)   # spectral norm <= Frobenius norm = 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, shape: Sequence[int]) -> float:
    """Moonshot's match-AdamW-RMS scale of a Muon update (torch's adjust_lr_fn "match_rms_adamw")."""
    return lr * 0.2 * math.sqrt(max(shape[0], shape[1]))


class MuonAdamW(torch.optim.Optimizer):
    """Muon over the matrices (takes_muon), AdamW over the rest, as two param groups of one optimizer.

    named: the trainable parameters in the replica's order (each group keeps that order); lr, betas,
    eps, weight_decay: AdamW's (the --lr schedule sets every group's "lr"); muon: Muon's settings.
    State per parameter: AdamW's "step" (a CPU float32 tensor, as torch's non-fused AdamW keeps it),
    "exp_avg", "exp_avg_sq"; Muon's "momentum_buffer" (torch.optim.Muon's names)."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], *, lr: float, betas: tuple[float, float],
                 weight_decay: float, muon: MuonSettings, eps: float = 1e-8):
        matrices = [p for n, p in named if takes_muon(n, p)]
        rest = [p for n, p in named if not takes_muon(n, p)]
        groups = []
        if rest:
            groups.append({"params": rest, "kind": "adamw", "betas": tuple(betas), "eps": eps,
                           "weight_decay": weight_decay})
        if matrices:
            groups.append({"params": matrices, "kind": "muon", "lr_scale": muon.lr / lr, "momentum": muon.momentum,
                           "nesterov": muon.nesterov, "ns_steps": muon.ns_steps, "weight_decay": muon.weight_decay})
        super().__init__(groups, {"lr": lr})

    def load_state_dict(self, state_dict: dict) -> None:
        """The saved state (moments, momentum buffers, step counts) under this run's group settings:
        a resumed run's --muon-lr, --muon-momentum, decays and betas apply from there on, as its --lr
        does (torch's load_state_dict would keep the saved ones)."""
        mine = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        saved = [g.get("kind") for g in state_dict["param_groups"]]
        if saved != [g["kind"] for g in mine]:
            raise ValueError(f"optimizer state of groups {saved}, not {[g['kind'] for g in mine]}")
        super().load_state_dict(state_dict)
        for g, settings in zip(self.param_groups, mine):
            g.update(settings)

    def counts(self) -> dict[str, int]:
        """Parameters per kind, for the run's log: {"muon": n, "adamw": m}."""
        return {g["kind"]: len(g["params"]) for g in self.param_groups}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["kind"] == "muon":
                self._muon(group, params)
            else:
                self._adamw(group, params)
        return loss

    def _muon(self, group: dict, params: list[nn.Parameter]) -> None:
        lr = group["lr"] * group["lr_scale"]
        mu, wd = group["momentum"], group["weight_decay"]
        for p in params:
            grad = p.grad
            assert grad is not None     # step() passes only the parameters that have a gradient
            st = self.state[p]
            if "momentum_buffer" not in st:
                st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = st["momentum_buffer"]
            buf.lerp_(grad, 1 - mu)
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            update = newton_schulz5(update, group["ns_steps"])
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-adjusted_lr(lr, p.shape))

    def _adamw(self, group: dict, params: list[nn.Parameter]) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            m, v, g = st["exp_avg"], st["exp_avg_sq"], p.grad
            st["step"] += 1
            step = float(st["step"])
            p.mul_(1 - lr * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
            denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))
