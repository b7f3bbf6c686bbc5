"""The all-reduce between threaded replicas (workers.ThreadEngine): the gradient sum over the
replicas' flat buffers, as chunked copies between devices or, with one replica per GPU, NCCL.
"""
from __future__ import annotations

import torch

from trainer.engine.step import Replica


# ---- the threaded all-reduce: reduce-scatter then all-gather over the flat buffers ----------------
# Worker i owns chunk i of every flat buffer. Phase 1 (reduce_own_chunk, in every worker at once):
# worker i adds chunk i of every other replica into its own, receiving through a scratch buffer of
# one chunk when the replicas sit on different devices. Phase 2 (gather_chunks): worker i copies
# every other worker's finished chunk into its buffer. Each replica moves ~2 (N-1)/N of the
# gradient bytes, every device works at once, and all replicas end with bit-identical sums.
# Cross-device `copy_` orders itself against both devices' current streams, so nothing here
# synchronises the host.

def _chunk(buf: torch.Tensor, n: int, i: int) -> torch.Tensor:
    return torch.tensor_split(buf, n)[i]


def _buffers(r: Replica) -> list[torch.Tensor]:
    """The replica's flat gradient buffers: the copy-based sum runs over FlatGrads only."""
    assert r.grads is not None
    return r.grads.buffers


def reduce_own_chunk(replicas: list[Replica], i: int) -> None:
    n, own = len(replicas), replicas[i]
    for b, buf in enumerate(_buffers(own)):
        mine = _chunk(buf, n, i)
        for k in range(1, n):  # ring order: in round k every device reads from a different peer
            theirs = _chunk(_buffers(replicas[(i + k) % n])[b], n, i)
            if theirs.device == mine.device:
                mine.add_(theirs)
                continue
            scratch = own.scratch.get(b)
            if scratch is None or scratch.numel() < mine.numel():
                scratch = own.scratch[b] = torch.empty(mine.numel(), dtype=mine.dtype, device=mine.device)
            recv = scratch[: mine.numel()]
            recv.copy_(theirs, non_blocking=True)
            mine.add_(recv)


def nccl_usable(replicas: list[Replica]) -> bool:
    """One replica per GPU, each on its own device, and this torch has NCCL: the gradient sum can be
    single-process NCCL all-reduces instead of the copies below."""
    devices = [r.device for r in replicas]
    if len(devices) < 2 or any(d.type != "cuda" for d in devices) or len(set(devices)) != len(devices):
        return False
    try:
        import torch.cuda.nccl as nccl

        return nccl.is_available([r.params[0] for r in replicas])
    except (ImportError, RuntimeError):
        return False


def nccl_all_reduce(replicas: list[Replica], side: bool = False) -> None:
    """Sum every replica's gradients in place, called from ONE thread for all devices
    (torch.cuda.nccl: a single-process communicator over the GPUs, NVLink where there is one):
    one all-reduce per flat buffer when the replicas have FlatGrads, else one per parameter. Queued
    after the backward the workers queued on each device's current stream; every replica ends with
    the same bits (checked by check_replicas).

    side=False: on each device's current stream. side=True: on each replica's own `comm` stream,
    after its current stream's work; `summed` is recorded there, and prefetch_features makes the
    replica's stream wait for it after queuing the next step's target forward, which so overlaps
    the sum. The gradients stay valid: they are freed only by the next step's zero_grad, which the
    host reaches after that wait is queued, so their memory is reused only by kernels behind it."""
    import torch.cuda.nccl as nccl

    streams = None
    if side:
        streams = []
        for r in replicas:
            if r.comm is None:
                r.comm = torch.cuda.Stream(r.device)
            r.comm.wait_stream(torch.cuda.current_stream(r.device))
            streams.append(r.comm)
    flats = [r.grads for r in replicas if r.grads is not None]
    if len(flats) == len(replicas):
        for b in range(len(flats[0].buffers)):
            nccl.all_reduce([f.buffers[b] for f in flats], streams=streams)
    else:
        for k in range(len(replicas[0].params)):
            nccl.all_reduce([r.params[k].grad for r in replicas], streams=streams)
    if side:
        for r in replicas:
            r.summed = torch.cuda.Event()
            r.summed.record(r.comm)


def gather_chunks(replicas: list[Replica], i: int) -> None:
    n, own = len(replicas), replicas[i]
    for b, buf in enumerate(_buffers(own)):
        for k in range(1, n):
            j = (i + k) % n
            _chunk(buf, n, j).copy_(_chunk(_buffers(replicas[j])[b], n, j), non_blocking=True)
