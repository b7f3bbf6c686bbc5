"""One replica per worker, and the training step as functions of (replica, batch).

Both topologies run the same step on each replica's shard of one global batch:

    threads (trainer/engine/workers.py), the coordinator drives four phases over N worker threads:
        compute_grads(replica_i, batch.shard(i, N))       # forward + backward, in worker i
        allreduce.nccl_all_reduce(replicas)  # sum grads (allreduce.py): one GPU per worker (else, in
        allreduce.reduce_own_chunk(...); gather_chunks(...)  #  every worker, over FlatGrads:
                                                           #  reduce-scatter + all-gather)
        prefetch_features(replica_i, next_batch.shard(i, N))  # the next step's target forward, while
                                                           #  the NCCL sum runs on side streams
        apply_update(replica_i, lr, clip)                  # the same update everywhere
    processes (trainer/engine/ranks.py), one replica per rank, DDP sums grads during backward:
        compute_grads(replica, batch.shard(rank, N)); prefetch_features(...); apply_update(replica, lr, clip)

Every shard divides its loss by the weight of the WHOLE batch (`Batch.weight_total`), so summed
shard gradients are exactly the gradient of the global loss: N workers and one worker with the
same global batch compute the same update (up to float reassociation of the sum).
"""
from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from trainer import faults, policies
from trainer.engine.adamw import CompileFailed, CompiledUpdate
from trainer.engine.muon import MuonAdamW, MuonSettings
from trainer.run.data import Batch
from trainer.model.draft_loss import DraftLoss
from trainer.errors import TrainerError
from trainer.model.drafter import Drafter
from trainer.model.objective import Objective
from trainer.run.target import Target



class FlatGrads:
    """A replica's gradients in one flat buffer per dtype; every `param.grad` is a view into it.

    Backward accumulates into an existing `.grad` in place, so after `zero()` + backward the
    gradients already sit in the flat buffers: the copy-based cross-replica sum is a few large
    copies and adds (O(params) bytes, a handful of kernels) instead of one small op per parameter.
    They cost two passes a step that own gradients do not (zeroing the buffers, and backward's
    in-place add instead of handing over its fresh gradient: 16 bytes per fp32 parameter), so only
    that sum uses them (ThreadEngine.grads).
    """

    def __init__(self, params: list[nn.Parameter]):
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        self.buffers: list[torch.Tensor] = []
        self.views: list[tuple[nn.Parameter, torch.Tensor]] = []
        for dtype, group in by_dtype.items():
            buf = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=group[0].device)
            offset = 0
            for p in group:
                self.views.append((p, buf[offset: offset + p.numel()].view_as(p)))
                offset += p.numel()
            self.buffers.append(buf)
        self.attach()

    def attach(self) -> None:
        for p, v in self.views:
            p.grad = v

    def zero(self) -> None:
        for b in self.buffers:
            b.zero_()
        self.attach()  # cheap; undoes anything that replaced a .grad (e.g. zero_grad(set_to_none))

    def collect(self) -> None:
        """After backward: copy back any gradient autograd stored elsewhere (not expected)."""
        for p, v in self.views:
            if p.grad is None:
                v.zero_()
            elif p.grad.data_ptr() != v.data_ptr():
                v.copy_(p.grad)
            p.grad = v


@dataclass
class Replica:
    index: int
    device: torch.device
    target: Target                 # frozen, on `device`
    drafter: Drafter               # the uncompiled handle: state_dict, eval
    loss_fn: Callable              # DraftLoss under the compile policy (inside DDP for processes)
    loss_module: DraftLoss         # the same DraftLoss, uncompiled and unwrapped: eager checks
    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]     # trainable, in name order: the same order on every replica
    names: list[str]
    policy: str
    grads: FlatGrads | None = None  # flat gradient buffers for the threaded copy-sum; else each
                                    # parameter owns the gradient backward hands it (DDP's, processes)
    scratch: dict[int, torch.Tensor] = field(default_factory=dict)  # receive buffers for the reduce
    update: CompiledUpdate | None = None  # the clip + AdamW compiled over `optimizer`'s state (adamw.py)
                                          # (never with Muon: MuonAdamW steps eagerly)
    ahead: tuple[torch.Tensor, torch.Tensor] | None = None  # (host input ids, target features) made
                                   # early by prefetch_features for the next step's shard
    comm: torch.cuda.Stream | None = None  # the gradient sum's stream when it overlaps (nccl_all_reduce)
    summed: torch.cuda.Event | None = None  # recorded on `comm` after the sum; prefetch_features waits for it

    @property
    def compiled(self) -> bool:
        """Something in this replica's step runs compiled: the drafter's loss or the target's layers."""
        return self.policy != "eager" or self.target.compiled

    @property
    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


@dataclass
class ShardStats:
    loss_sum: float                # sum of w * CE over the shard (a 0-d device tensor until to_host)
    correct: torch.Tensor          # (Bs,) right predictions per block position
    count: torch.Tensor            # (Bs,) loss-bearing tokens per block position
    samples: int
    tokens: int

    def to_host(self) -> "ShardStats":
        """The values on the host (a float, CPU tensors): waits for the device when they are not."""
        if isinstance(self.loss_sum, float):
            return self
        return ShardStats(float(self.loss_sum), self.correct.cpu(), self.count.cpu(), self.samples, self.tokens)


def build_replica(index: int, device: torch.device, drafter: Drafter, target: Target, *, policy: str,
                  n_devices: int, lr: float, betas: tuple[float, float], weight_decay: float,
                  pos_weights: torch.Tensor, optimizer_state: dict | None = None,
                  wrap: Callable[[nn.Module], nn.Module] | None = None,
                  compile_target: bool = False, graph_target: bool = False, compile_update: bool = False,
                  objective: Objective = Objective(), muon: MuonSettings | None = None) -> Replica:
    """Run IN the worker thread (or rank): per-thread compile config, device, target head, optimizer, compile.

    `drafter` holds the initial (or resumed) trainable weights on the CPU; it is moved, not copied.
    `wrap` wraps the loss module before compilation (DDP for --topology processes).
    `compile_target`: the target's decoder layers run compiled (Target.compile_layers).
    `graph_target`: with compile_target on a GPU that this replica alone uses, the target's forward
    replays a CUDA graph (Target.graph_features).
    `compile_update`: clip + AdamW run as one compiled function over the optimizer's state (adamw.py);
    it is AdamW's alone, so with `muon` it does not apply (the config refuses --compile-update on).
    `muon`: Muon over the drafter's matrices and AdamW (lr, betas, weight_decay) over the rest, one
    MuonAdamW (trainer/engine/muon.py); None: torch's AdamW over all of them (the recipe).
    `objective`: what the loss trains the drafter to match; a distilling one needs a target whose
    features carry its final hidden state (Target.final_hidden).
    """
    policies.configure_thread(n_devices)  # thread-local from torch 2.12 (pytorch#186537)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # inductor's non-tree CUDA graphs have no device guard
    target = target.to(device)
    if compile_target:
        target.compile_layers()
        if graph_target and device.type == "cuda":
            target.graph_features()
    drafter.borrow_target_head(*target.head_weights())
    drafter.to(device)
    named = drafter.trainable_parameters()
    params = [p for _, p in named]
    opt: torch.optim.Optimizer
    if muon is None:
        opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay,
                                **({"fused": True} if device.type == "cuda" else {}))
    else:
        opt = MuonAdamW(named, lr=lr, betas=betas, weight_decay=weight_decay, muon=muon)
    if optimizer_state is not None:
        # A private copy: load_state_dict keeps same-device tensors as they are, and replicas must
        # never share moment buffers.
        opt.load_state_dict(copy.deepcopy(optimizer_state))
    unit = DraftLoss(drafter, pos_weights, objective=objective).to(device)
    module = wrap(unit) if wrap is not None else unit
    loss_fn = policies.compile_module(module, policy, n_devices=n_devices)
    update = CompiledUpdate(opt, params) if compile_update and muon is None else None
    return Replica(index, device, target, drafter, loss_fn, unit, opt, params, [n for n, _ in named], policy,
                   update=update)


def compute_grads(r: Replica, shard: Batch, host: bool = True) -> ShardStats:
    """Forward + backward of one shard; leaves grads of the global-batch loss in r.params.

    host=False: the stats stay device tensors (ShardStats.to_host reads them), so the host does not
    wait for the backward to finish before it queues the update."""
    policies.step_begin(r.policy)
    stats = _forward_backward(r, r.loss_fn, shard)
    return stats.to_host() if host else stats


def eager_grads(r: Replica, shard: Batch) -> float:
    """The same step through the uncompiled, unwrapped DraftLoss on the eager target's features (no
    DDP sync): this shard's own gradient of the global-batch loss in r.params; returns the shard's
    loss sum. For checks."""
    return float(_forward_backward(r, r.loss_module, shard, eager=True).loss_sum)


def _forward_backward(r: Replica, fn: Callable, shard: Batch, eager: bool = False) -> ShardStats:
    if r.grads is not None:
        r.grads.zero()
    else:
        r.optimizer.zero_grad(set_to_none=True)
    b = shard.to(r.device)
    feats = _take_ahead(r, shard) if not eager else None
    if feats is None:
        feats = r.target.features(b.input_ids, eager=eager)  # (B, S, n*H), no grad
    with r.autocast:
        loss_sum, correct, count = fn(feats, b.input_ids, b.loss_mask, b.anchors, b.valid)
    (loss_sum / max(shard.weight_total, 1e-12)).backward()
    if r.grads is not None:
        r.grads.collect()
    else:  # as FlatGrads.collect: a parameter the loss did not reach gets zeros, so the update is the same
        for p in r.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    return ShardStats(loss_sum.detach(), correct.detach(), count.detach(), len(shard), shard.tokens)


def prefetch_features(r: Replica, shard: Batch) -> None:
    """The target's features of the NEXT step's shard, made now: the frozen target does not depend
    on the update, and on a GPU its forward then runs while the gradient sum does (nccl_all_reduce
    with side streams), instead of after the update. The next _forward_backward on the same input
    ids takes them. Afterwards this replica's stream waits for the sum (`summed`), so what follows
    (the update) reads summed gradients."""
    ids = shard.input_ids
    r.ahead = (ids, r.target.features(ids.to(r.device, non_blocking=True)))
    if r.summed is not None:
        torch.cuda.current_stream(r.device).wait_event(r.summed)
        r.summed = None


def _take_ahead(r: Replica, shard: Batch) -> torch.Tensor | None:
    """The prefetched features when they are this shard's (same input ids), else None; either way
    they are dropped (a shard that is not the prefetched one is computed afresh)."""
    ahead, r.ahead = r.ahead, None
    if ahead is None or not torch.equal(ahead[0], shard.input_ids):
        return None
    return ahead[1]


@torch.no_grad()
def load_weights(r: Replica, weights: list[torch.Tensor]) -> None:
    """Copy `weights` (in r.params order) into the replica's trainable parameters IN PLACE, as an
    optimizer step does: CUDA graphs keep reading the same addresses."""
    for p, w in zip(r.params, weights):
        p.copy_(w, non_blocking=True)


def apply_update(r: Replica, lr: float, grad_clip: float, step: int) -> float:
    """Clip to the global norm and step the optimizer; returns the pre-clip gradient norm, read on
    the host (queue_update, then settle_norm).

    A non-finite norm raises TrainerError and leaves the weights and optimizer state untouched."""
    return settle_norm(queue_update(r, lr, grad_clip, step), step)


def queue_update(r: Replica, lr: float, grad_clip: float, step: int) -> torch.Tensor | float:
    """apply_update without the host's wait: returns the pre-clip norm as a device tensor where the
    update itself leaves everything untouched on the device when the norm is not finite, else a
    float already checked. A device norm must go through settle_norm before anything else changes
    the weights (ThreadEngine.step settles the previous step's before it queues the next update).

    With a CompiledUpdate (a GPU under a compiled policy) clip and AdamW are one compiled function
    (trainer/engine/adamw.py). Else, with the fused AdamW (CUDA), the clip is folded into the
    optimizer's kernel: it divides every gradient by `grad_scale` = 1 / clip_grad_norm_'s coefficient
    as it reads it, and skips the whole update on the device when `found_inf` is set, so the
    gradients are not rewritten in a separate pass (8 bytes per parameter: 8.4 GB a step for a 1B
    drafter). Else (the CPU, and MuonAdamW anywhere) the norm is read before the step, which a
    non-finite norm skips.
    """
    for g in r.optimizer.param_groups:
        g["lr"] = lr
    norm: torch.Tensor | float
    if r.update is not None:
        try:
            norm = r.update(lr, grad_clip)
        except CompileFailed as e:  # torch's own AdamW below does the same update
            warnings.warn(f"the compiled optimizer update failed to compile ({e}); using torch's AdamW "
                          "(--compile-update off skips the attempt)", RuntimeWarning, stacklevel=2)
            r.update = None
            return queue_update(r, lr, grad_clip, step)
    elif r.optimizer.defaults.get("fused"):
        # every parameter has one (_forward_backward); clip_grad_norm_ too leaves out those without
        total = _total_norm([p.grad for p in r.params if p.grad is not None])
        # clip_grad_norm_'s coefficient is grad_clip / (norm + 1e-6), clamped to at most 1. The fused
        # AdamW reads the two attributes GradScaler sets, which torch.optim.Optimizer does not declare.
        r.optimizer.grad_scale = torch.clamp((total + 1e-6) / grad_clip, min=1.0).float()  # type: ignore[attr-defined]
        r.optimizer.found_inf = (~torch.isfinite(total)).float()  # type: ignore[attr-defined]
        try:
            r.optimizer.step()
        finally:
            r.optimizer.grad_scale = r.optimizer.found_inf = None  # type: ignore[attr-defined]
        norm = total
    else:
        norm = settle_norm(torch.nn.utils.clip_grad_norm_(r.params, grad_clip), step)
        r.optimizer.step()
    faults.hit("diverge", index=r.index, step=step + 1, params=r.params)
    return norm


def settle_norm(norm: torch.Tensor | float, step: int) -> float:
    """The norm on the host; raises TrainerError when it is not finite (the update skipped itself)."""
    norm = float(norm)
    if not math.isfinite(norm):
        raise TrainerError(f"gradient norm is {norm} at step {step}: the loss diverged (try a lower --lr)")
    return norm


class HostTransfer:
    """Values on their way to the host without the host waiting: each CUDA tensor is copied now, on
    its device's current stream, into pinned memory, so wait() waits for the work queued before the
    copies, not for what the host queues afterwards. Anything else (CPU tensors, floats) passes
    through as it is. All CUDA tensors are on one device (a replica's)."""

    def __init__(self, values: list):
        on_gpu = [v for v in values if isinstance(v, torch.Tensor) and v.is_cuda]
        self.values = [_pinned_copy(v) if isinstance(v, torch.Tensor) and v.is_cuda else v for v in values]
        self.done = None
        if on_gpu:
            self.done = torch.cuda.Event()
            self.done.record(torch.cuda.current_stream(on_gpu[0].device))

    def wait(self) -> list:
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        return self.values


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach(), non_blocking=True)
    return host


class QueuedStep:
    """One replica's step after its update was queued: its shard's stats and the pre-clip norm, on
    their way to the host (HostTransfer). read() waits for them and checks the norm (settle_norm)."""

    def __init__(self, stats: ShardStats, norm: torch.Tensor | float, step: int):
        self.samples, self.tokens, self.step = stats.samples, stats.tokens, step
        self._host = HostTransfer([stats.loss_sum, stats.correct, stats.count, norm])

    def read(self) -> tuple[ShardStats, float]:
        loss_sum, correct, count, norm = self._host.wait()
        return ShardStats(float(loss_sum), correct, count, self.samples, self.tokens), settle_norm(norm, self.step)


def update_async(r: Replica, stats: ShardStats, lr: float, grad_clip: float, step: int) -> QueuedStep:
    """queue_update, then the step's stats and norm start for the host (QueuedStep): nothing waits."""
    return QueuedStep(stats, queue_update(r, lr, grad_clip, step), step)


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all gradients together, as clip_grad_norm_ computes it (a device tensor)."""
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: clip_grad_norm_'s own first half
        return torch.nn.utils.get_total_norm(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def weight_checksum(r: Replica) -> torch.Tensor:
    """(n_params,) int64 on the CPU: per parameter, the sum of its raw bit patterns.

    Replicas that applied the same updates hold bit-identical weights, so any flipped bit shows.
    """
    sums = [p.detach().view(_INT_VIEW[p.element_size()]).sum(dtype=torch.int64) for p in r.params]
    return torch.stack(sums).cpu()
