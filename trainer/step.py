"""One replica per worker, and the training step as functions of (replica, batch).

The coordinator (train.py, main thread) drives every step in three phases so that N replicas stay
identical (issue 5 adds more workers, the checksum and the compile handshake on top of this):

    stats = [worker_i.submit(compute_grads, replica_i, batch.shard(i, N))]   # in each worker thread
    reduce_grads(replicas)                                                   # sum grads over replicas
    norms = [worker_i.submit(apply_update, replica_i, lr, clip)]             # same update everywhere

Every shard divides its loss by the weight of the WHOLE batch (`Batch.weight_total`), so summed
shard gradients are exactly the gradient of the global loss: N workers and one worker with the
same global batch compute the same update.
"""
from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from trainer import masks, policies
from trainer.data import Batch
from trainer.draft_loss import DraftLoss
from trainer.errors import TrainerError
from trainer.model import Drafter
from trainer.target import Target


@dataclass
class Replica:
    index: int
    device: torch.device
    target: Target                 # frozen, on `device`
    drafter: Drafter               # the uncompiled handle: state_dict, eval
    loss_fn: Callable              # DraftLoss under the compile policy
    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]     # trainable, in name order: the same order on every replica
    policy: str

    @property
    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


@dataclass
class ShardStats:
    loss_sum: float                # sum of w * CE over the shard
    correct: torch.Tensor          # (Bs,) right predictions per block position
    count: torch.Tensor            # (Bs,) loss-bearing tokens per block position
    samples: int
    tokens: int


def build_replica(index: int, device: torch.device, drafter: Drafter, target: Target, *, policy: str,
                  n_devices: int, lr: float, weight_decay: float, pos_weights: torch.Tensor,
                  optimizer_state: dict | None = None) -> Replica:
    """Run IN the worker thread: per-thread compile config, device, target head, optimizer, compile.

    `drafter` holds the initial (or resumed) trainable weights on the CPU; it is moved, not copied.
    """
    policies.configure_thread(n_devices)  # thread-local from torch 2.12 (pytorch#186537)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # inductor's non-tree CUDA graphs have no device guard
    target = target.to(device)
    drafter.borrow_target_head(*target.head_weights())
    drafter.to(device)
    named = drafter.trainable_parameters()
    params = [p for _, p in named]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                            **({"fused": True} if device.type == "cuda" else {}))
    if optimizer_state is not None:
        # A private copy: load_state_dict keeps same-device tensors as they are, and replicas must
        # never share moment buffers.
        opt.load_state_dict(copy.deepcopy(optimizer_state))
    loss_fn = policies.compile_module(DraftLoss(drafter, pos_weights).to(device), policy, n_devices=n_devices)
    return Replica(index, device, target, drafter, loss_fn, opt, params, policy)


def compute_grads(r: Replica, shard: Batch) -> ShardStats:
    """Forward + backward of one shard; leaves grads of the global-batch loss in r.params."""
    policies.step_begin(r.policy)
    r.optimizer.zero_grad(set_to_none=True)
    b = shard.to(r.device)
    feats = r.target.features(b.input_ids)  # (B, S, n*H), no grad
    with r.autocast:
        loss_sum, correct, count = r.loss_fn(feats, b.input_ids, b.loss_mask, b.anchors, b.valid)
    (loss_sum / max(shard.weight_total, 1e-12)).backward()
    return ShardStats(float(loss_sum.detach()), correct.detach().cpu(), count.detach().cpu(),
                      len(shard), shard.tokens)


def reduce_grads(replicas: list[Replica]) -> None:
    """Sum the gradients of all replicas into every replica (called by the coordinator)."""
    if len(replicas) == 1:
        return
    first = replicas[0]
    for i, p0 in enumerate(first.params):
        total = torch.zeros_like(p0)
        for r in replicas:
            g = r.params[i].grad
            if g is not None:
                total += g.to(p0.device)
        for r in replicas:
            r.params[i].grad = total.to(r.params[i].device, copy=r is not first)


def apply_update(r: Replica, lr: float, grad_clip: float, step: int) -> float:
    """Clip to the global norm and step the optimizer; returns the pre-clip gradient norm."""
    for g in r.optimizer.param_groups:
        g["lr"] = lr
    norm = float(torch.nn.utils.clip_grad_norm_(r.params, grad_clip))
    if not torch.isfinite(torch.tensor(norm)):
        raise TrainerError(f"gradient norm is {norm} at step {step}: the loss diverged (try a lower --lr)")
    r.optimizer.step()
    return norm


def lr_at(step: int, *, steps: int, lr: float, min_lr: float, warmup: float) -> float:
    """Linear warmup over warmup*steps steps, then cosine from lr down to min_lr at the last step."""
    n_warm = max(1, round(warmup * steps)) if warmup > 0 else 0
    if step < n_warm:
        return lr * (step + 1) / n_warm
    span = max(1, steps - n_warm)
    t = min(1.0, (step - n_warm) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * t))
