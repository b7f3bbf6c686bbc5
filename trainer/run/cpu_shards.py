"""A training step's gradient on a CPU that other work may be using: the batch cut into a fixed number
of shards, each shard's forward and backward run by a worker thread with one intra-op thread, the
shards' gradients summed in shard order by the caller's thread.

Why not torch's intra-op threads: they meet at a barrier after every op (thousands a step), and on
cores other work is using, one descheduled thread holds every other one at each barrier. Worker
threads meet once a step. So on a loaded machine shard workers are the fastest way to use its cores,
and on a quiet one about as fast as intra-op threads (docs/decisions.md has the figures).

The result does not depend on how many workers run, nor on the load: the shards, the intra-op thread
count (cores // shards: one on 2 cores) and the order of the gradients' sum are fixed, so 1 worker or
2 give the same bits (before, the thread count followed the free cores, and the build with it).

    with ShardedGrads(params, shards=2) as grads:
        loss = grads(rows, loss_of)   # p.grad set for every p in params; loss: the batch's mean
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from trainer import cores


class ShardedGrads:
    """The gradient of a batch's mean loss, from `shards` equal parts of its rows run by up to
    min(shards, cores) worker threads. While open, torch's intra-op threads are cores // shards
    (cores.share_cpu: one on 2 cores), restored on close. OMP_NUM_THREADS, when set, is left alone
    (and then the bits follow it)."""

    def __init__(self, params: Sequence[torch.Tensor], shards: int = 2, workers: int | None = None):
        self.params, self.shards = list(params), shards
        self.workers = max(1, min(shards, workers or cores.cores()))
        self._threads_before = torch.get_num_threads()
        self.intra_op = cores.share_cpu(shards)     # not workers: the bits must not follow them
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="shard")

    def describe(self) -> str:
        return (f"{self.workers} shard worker thread(s) x {self.intra_op} CPU thread(s), "
                f"{self.shards} shards a batch: {cores.cores()} cores")

    def __call__(self, rows: torch.Tensor, loss_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Set p.grad to d(mean loss)/dp for the batch `rows` (its first dim cut into the shards; it
        must divide evenly, so each shard's mean weighs the same) and return the mean loss (detached).
        loss_of(shard_rows): that shard's mean loss."""
        if len(rows) % self.shards:
            raise ValueError(f"a batch of {len(rows)} rows does not cut into {self.shards} equal shards")
        parts = rows.chunk(self.shards)
        done = [f.result() for f in [self._pool.submit(self._one, p, loss_of) for p in parts]]
        for i, p in enumerate(self.params):
            g = None
            for _, grads in done:           # shard order: the same sum however many workers ran
                if grads[i] is not None:
                    g = grads[i] if g is None else g + grads[i]
            p.grad = g
        return torch.stack([loss for loss, _ in done]).sum()

    def _one(self, part: torch.Tensor, loss_of) -> tuple[torch.Tensor, tuple]:
        loss = loss_of(part) / self.shards
        return loss.detach(), torch.autograd.grad(loss, self.params, allow_unused=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.intra_op != self._threads_before:
            torch.set_num_threads(self._threads_before)

    def __enter__(self) -> "ShardedGrads":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
