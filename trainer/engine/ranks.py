"""One torchrun rank's engine: this rank's replica in DDP (gloo on CPU, NCCL on GPU), an Engine
(engine/protocol.py) as workers.ThreadEngine is, so the run's loop drives threads and ranks alike.

DDP SUMS the gradients (a comm hook): each shard's loss is already divided by the global batch
weight, as in threads, so the two topologies compute the same update.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from trainer import faults
from trainer.engine.numerics import guard_first_step
from trainer.engine.step import (Replica, ShardStats, apply_update, compute_grads, prefetch_features,
                                 weight_checksum)
from trainer.engine.workers import ReplicasDiverged, StepOut, log_guard
from trainer.run.log import heartbeat


class RankEngine:
    """This rank's replica in DDP; an Engine (protocol.py), as workers.ThreadEngine, for trainer.train.loop.run_loop."""

    def __init__(self, build: Callable[[], Replica], rank: int, world: int, device: torch.device, log,
                 guard: bool = True, node_first: bool = False, grace=None, job=None):
        """`build()` makes this rank's replica (its DraftLoss inside DDP). With `guard`, the first
        compiled step is checked against eager (numerics.guard_first_step), on every rank.
        `node_first`: this is the first rank of its node (LOCAL_RANK 0), which writes checkpoints.
        `grace` (trainer/train/grace.StopGrace) learns each step boundary and that the ranks agreed to
        stop; `job` (its Watch, several nodes) is disarmed when no collective is left."""
        self.rank, self.size, self.device, self.log, self.guard = rank, world, device, log, guard
        self.grace, self.job = grace, job
        self.writer = rank == 0
        # Every node keeps its own copy of the checkpoints (its first rank writes them into its --out):
        # a node's folder is then complete on its own, for --resume and to compare the nodes' weights.
        self.saver = self.writer or node_first
        t = time.perf_counter()
        self.replica: Replica = build()
        self._built = time.perf_counter() - t
        self._warm = False

    @property
    def primary(self) -> Replica:
        return self.replica

    @property
    def replicas(self) -> list[Replica]:
        return [self.replica]

    def step(self, batch, step: int, lr: float, grad_clip: float, ahead=None) -> StepOut:
        t = time.perf_counter()
        warm = self._warm
        # As ThreadEngine.step: the shard's stats stay on the device until the update is queued.
        st = self.compute(batch, host=False, ahead=ahead)[0]
        norm = self.update(lr, grad_clip, step)
        n = len(st.correct)
        packed = torch.cat([torch.as_tensor(st.loss_sum, dtype=torch.float64, device=self.device).view(1),
                            st.correct.to(self.device, torch.float64), st.count.to(self.device, torch.float64)])
        dist.all_reduce(packed)
        packed = packed.cpu()
        if not warm:
            self._report_ready(time.perf_counter() - t)
        return StepOut(float(packed[0]), packed[1: 1 + n].to(st.correct.dtype),
                       packed[1 + n:].to(st.count.dtype), norm)

    def settle(self) -> None:
        """step() returns its results read (StepOut): nothing is left pending."""

    def compute(self, batch, host: bool = True, ahead=None) -> list[ShardStats]:
        """This rank's shard, forward + backward; DDP sums the gradients over the ranks in backward.
        The first call is the warm-up, checked against eager when the guard is on. host=False: the
        stats stay on the device (ShardStats.to_host) after the warm-up. ahead: the next step's
        batch, whose target features this rank then makes (step.prefetch_features)."""
        shard = batch.shard(self.rank, self.size)
        st = compute_grads(self.replica, shard, host) if self._warm else self._warm_up(shard)
        if ahead is not None:
            prefetch_features(self.replica, ahead.shard(self.rank, self.size))
        return [st]

    def _warm_up(self, shard) -> ShardStats:
        faults.hit("fail_worker", index=self.rank)
        with heartbeat(self.log, f"compiling rank {self.rank}"):
            st = compute_grads(self.replica, shard)
        self._warm = True
        if self.guard and self.replica.compiled:
            check = guard_first_step(self.replica, shard, st.loss_sum, reduce=dist.all_reduce)
            log_guard(self.log, f"rank {self.rank}", self.rank, check)
        return st

    def update(self, lr: float, grad_clip: float, step: int) -> float:
        return apply_update(self.replica, lr, grad_clip, step)

    def run_each(self, fn, per_worker_args: list[tuple]) -> list:
        return [fn(self.replica, *per_worker_args[0])]

    def _report_ready(self, first: float) -> None:
        got: list = [None] * self.size
        dist.all_gather_object(got, (self._built, first, str(self.device)))
        for i, (built, first_i, dev) in enumerate(got):
            self.log.metrics({"event": "worker_ready", "worker": i, "device": dev,
                              "seconds": built + first_i, "build_s": built, "first_step_s": first_i})
            self.log.info(f"rank {i} ({dev}) ready in {built + first_i:.1f}s (build {built:.1f}s, "
                          + ("compile + " if self.replica.compiled else "") + f"first step {first_i:.1f}s)")

    def agree(self, flag: bool) -> bool:
        """Any rank's flag, on every rank (SIGTERM may reach the ranks at different steps)."""
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t)
        agreed = bool(t.item() > 0)
        if self.grace is not None:
            self.grace.boundary()
            if agreed:      # every rank checkpoints and leaves together: SIGTERM's deadline is off
                self.grace.hold()
        return agreed

    def collectives_done(self) -> None:
        """No collective follows: another node that ends from now on ended normally, and this rank's
        end is no failure of the job (its launcher and the others read `done/RANK`)."""
        if self.job is not None:
            self.job.finished(self.rank)

    def excuse_until_boundary(self) -> None:
        """A rank works alone before the next step boundary (a checkpoint, an eval): this one's SIGTERM
        grace does not run out while it waits for it there."""
        if self.grace is not None:
            self.grace.excuse_until_boundary()

    def check_replicas(self, step: int) -> None:
        mine = weight_checksum(self.replica).to(self.device)
        every = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine)
        for i in range(1, self.size):
            bad = (every[i] != every[0]).nonzero().flatten().tolist()
            if bad:
                self.log.metrics({"event": "diverged", "step": step, "worker": i, "tensors": len(bad)})
                raise ReplicasDiverged(
                    f"replica weights diverged at step {step}: rank {i} differs from rank 0 in "
                    f"{self.replica.names[bad[0]]}" + (f" and {len(bad) - 1} more tensor(s)" if len(bad) > 1 else ""))
        if self.size > 1:
            self.log.metrics({"event": "checksum", "step": step, "replicas": self.size})

    def on_primary(self, fn, *args, **kwargs):
        with self.own_work():       # rank 0's eval
            return fn(*args, **kwargs)

    def own_work(self):
        """While this rank works alone (a checkpoint, an eval), a SIGTERM's grace does not run out."""
        return self.grace.busy() if self.grace is not None else contextlib.nullcontext()

    def barrier(self) -> None:
        device_barrier(self.device)

    def close(self) -> None:
        pass


def wrap_ddp(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # The borrowed target head (embedding, lm_head; the final norm too with --freeze-draft-norm) is
    # frozen and the buffers are constants, identical everywhere: keep DDP from broadcasting them
    # (GBs for a real target's head) at construction and from syncing buffers before every forward.
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    DDP._set_params_and_buffers_to_ignore_for_model(module, frozen + [n for n, _ in module.named_buffers()])
    ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
    ddp.register_comm_hook(None, _sum_hook)
    return ddp


def _sum_hook(state, bucket):
    """All-reduce SUM (DDP's default divides by the world size): each shard's loss is already divided
    by the global batch weight, so the global gradient is the plain sum, exactly as in threads."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def device_barrier(device: torch.device) -> None:
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
