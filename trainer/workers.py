"""Worker threads: each owns one device and runs what the coordinating main thread submits.

A worker is a single long-lived thread (a one-thread executor), so everything submitted to it
(building and compiling its replica, every step, eval) runs in the same thread: compile state,
thread-local dynamo config and the current CUDA device stay with the replica (field notes 3).
The main thread only coordinates: it never touches a replica's tensors while a worker runs.
"""
from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable

import torch

from trainer.errors import TrainerError


class WorkerFailed(TrainerError):
    def __init__(self, index: int, error: BaseException):
        self.index, self.error = index, error
        super().__init__(f"worker {index} failed: {type(error).__name__}: {error}")


class Worker:
    def __init__(self, index: int, device: torch.device):
        self.index, self.device = index, device
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dflash-worker{index}")

    def submit(self, fn: Callable, *args, **kwargs) -> cf.Future:
        return self._pool.submit(fn, *args, **kwargs)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def run_all(workers: list[Worker], fn: Callable, per_worker_args: list[tuple], timeout: float | None = None) -> list:
    """Run fn(*args_i) on worker i for every worker; results in worker order.

    The first failure raises WorkerFailed (chained to the worker's exception, so the traceback in
    the log shows where it broke) as soon as it happens, without waiting for the others.
    """
    futures = [w.submit(fn, *args) for w, args in zip(workers, per_worker_args)]
    done, pending = cf.wait(futures, timeout=timeout, return_when=cf.FIRST_EXCEPTION)
    for i, f in enumerate(futures):
        if f in done and f.exception() is not None:
            raise WorkerFailed(i, f.exception()) from f.exception()
    if pending:
        raise TrainerError(f"{len(pending)} worker(s) did not finish within {timeout:.0f}s")
    return [f.result() for f in futures]
