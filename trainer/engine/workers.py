"""Worker threads: one per device, each owning one replica; the main thread only coordinates.

A worker is a single long-lived thread, so everything submitted to it (building and compiling its
replica, every step, eval) runs in the same thread: compile state, thread-local dynamo config and
the current CUDA device stay with the replica (docs/background.md#torchcompile-in-worker-threads).
The main thread never touches a replica's tensors; it submits phases and waits for them.

`ThreadEngine` is the threads topology (`--topology threads`):
  - start-up is serialized with a readiness handshake: worker 0 builds its replica, then worker 1,
    ...; then worker 0 compiles and runs its share of the first step, then worker 1, ... Later
    workers find the first one's compile work in the in-process and on-disk Inductor caches instead
    of paying it N times, and a worker that fails or hangs is named alone. Each wait is bounded by
    --warmup-timeout; each worker's ready time is logged as {"event": "worker_ready", ...}.
    The warm-up IS the first step (its real shard, nothing thrown away), so step 1 computes
    exactly what it would without the handshake.
  - every step: compute (all workers at once) -> sum grads (NCCL all-reduces when each worker has
    its own GPU; else reduce-scatter + all-gather over flat gradient buffers, in the workers) ->
    the next step's target features (on a GPU while the NCCL sum runs) -> the same optimizer
    update in every worker.
  - every --checksum-every steps and at the end: the replicas' weights must be bit-identical.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from trainer.run.log import heartbeat
from trainer.errors import TrainerError
from trainer import faults
from trainer.engine.numerics import guard_first_step
from trainer.engine.allreduce import gather_chunks, nccl_all_reduce, nccl_usable, reduce_own_chunk
from trainer.engine.step import (FlatGrads, QueuedStep, Replica, ShardStats, apply_update, compute_grads,
                                 prefetch_features, update_async, weight_checksum)


class WorkerFailed(TrainerError):
    """A worker raised; chained to its exception so the traceback shows where it broke."""

    def __init__(self, index: int, device, error: BaseException, phase: str = "step"):
        self.index, self.device, self.error, self.phase = index, device, error, phase
        self.signature = name_failure(error)
        where = " during warm-up" if phase == "warmup" else ""
        first = (str(error).strip().splitlines() or [""])[0]
        self.what = what = type(error).__name__ + (f": {first}" if first else "")
        super().__init__(f"worker {index} ({device}) failed{where}: {what}"
                         + (f" [signature {self.signature}]" if self.signature else ""))


class WorkerHung(TrainerError):
    def __init__(self, index: int, device, seconds: float, phase: str = "warmup"):
        self.index, self.device, self.seconds, self.phase = index, device, seconds, phase
        self.stack = ""  # the hung thread's stack when the run gave up on it
        super().__init__(f"worker {index} ({device}) did not become ready within {seconds:g} s "
                         "(--warmup-timeout); its thread cannot be stopped, so the run ends here")


class ReplicasDiverged(TrainerError):
    pass


def name_failure(error: BaseException) -> str | None:
    """The failure-catalog id that the error's traceback matches (e.g. cudagraph-trees-tls), if any."""
    try:
        from trainer.signatures import classify

        return classify("".join(traceback.format_exception(error)), None)
    except Exception:  # noqa: BLE001 - naming is a courtesy; never hide the real error behind it
        return None


class Worker:
    """One daemon thread running submitted calls in order (a daemon, so that a worker stuck in a
    hung compile can never keep the process alive after the run has given up on it)."""

    def __init__(self, index: int, device: torch.device):
        self.index, self.device = index, device
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"dflash-worker{index}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the coordinator
                fut.set_exception(e)

    def submit(self, fn: Callable, *args, **kwargs) -> cf.Future:
        fut: cf.Future = cf.Future()
        self._queue.put((fut, fn, args, kwargs))
        return fut

    def stack(self) -> str:
        """Where the thread is right now (to show where a hung worker is stuck)."""
        ident = self._thread.ident         # None: not started
        frame = sys._current_frames().get(ident) if ident is not None else None
        return "".join(traceback.format_stack(frame)) if frame is not None else ""

    def close(self, wait: bool = True) -> None:
        self._queue.put(None)
        if wait:
            self._thread.join()


def run_all(workers: list[Worker], fn: Callable, per_worker_args: list[tuple]) -> list:
    """Run fn(*args_i) on worker i for every worker; results in worker order.

    The first failure raises WorkerFailed as soon as it happens, without waiting for the others.
    """
    futures = [w.submit(fn, *args) for w, args in zip(workers, per_worker_args)]
    done, _ = cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
    for w, f in zip(workers, futures):
        error = f.exception() if f in done else None
        if error is not None:
            raise WorkerFailed(w.index, w.device, error) from error
    return [f.result() for f in futures]


@dataclass
class StepOut:
    """One step summed over all shards (the whole global batch)."""
    loss_sum: float
    correct: torch.Tensor   # (Bs,)
    count: torch.Tensor     # (Bs,)
    grad_norm: float

    def result(self) -> "StepOut":
        return self


class PendingStep:
    """A step whose work is queued: result() waits for its update (not for what was queued after
    it), checks its norm and sums its shards' stats; the first call does it, later ones return the
    same StepOut (or raise the same error)."""

    def __init__(self, ends: list[QueuedStep]):
        self._ends = ends
        self._out: StepOut | None = None
        self._error: TrainerError | None = None

    def result(self) -> StepOut:
        if self._error is not None:
            raise self._error
        if self._out is None:
            try:
                read = [e.read() for e in self._ends]
            except TrainerError as e:
                self._error = e
                raise
            stats = [st for st, _ in read]
            # tensors: one stats per worker, never sum()'s bare start (0)
            correct = cast(torch.Tensor, sum(s.correct for s in stats))
            count = cast(torch.Tensor, sum(s.count for s in stats))
            self._out = StepOut(sum(s.loss_sum for s in stats), correct, count, read[0][1])
        return self._out


class ThreadEngine:
    """N replicas, one per worker thread, driven step by step from the main thread; an Engine (protocol.py)."""

    writer = True  # one process: it logs, checkpoints and evaluates
    saver = True
    # The gradient sum across replicas: "auto" = NCCL all-reduces when every replica has its own
    # GPU (allreduce.nccl_usable), else the reduce-scatter + all-gather copies; "copy" / "nccl" force one.
    allreduce = "auto"
    # Where the gradients live: "auto" = in FlatGrads buffers only when the copy-sum needs them,
    # else each parameter keeps the gradient backward hands it (two passes a step fewer);
    # "flat" = FlatGrads always (benchmarks compare the two).
    grads = "auto"

    def __init__(self, workers: list[Worker], log, warmup_timeout: float, guard: bool = True):
        self.workers, self.log, self.timeout, self.guard = workers, log, warmup_timeout, guard
        self.replicas: list[Replica] = []
        self._built: list[float] = []
        self._warm = False
        self._hung: set[int] = set()
        self._nccl: bool | None = None  # nccl_usable(replicas), decided at the first gradient sum
        self._flat: dict[int, FlatGrads] = {}  # each replica's FlatGrads, once made
        self._pending: PendingStep | None = None  # the last step, until settle()

    @classmethod
    def start(cls, devices: list[torch.device], build: Callable[[int, torch.device], Replica], log,
              warmup_timeout: float, guard: bool = True) -> "ThreadEngine":
        """Build the replicas one worker at a time (build(i, device) runs in worker i).

        Serialized also because each replica's target copy is made on device 0 before it moves
        (Target.to): N copies at once would need N+1 targets' memory there. With `guard`, each
        worker's first compiled step is checked against eager (numerics.guard_first_step).
        """
        eng = cls([Worker(i, d) for i, d in enumerate(devices)], log, warmup_timeout, guard)
        try:
            for w in eng.workers:
                t = time.perf_counter()
                eng.replicas.append(eng._await(w, w.submit(build, w.index, w.device)))
                eng._built.append(time.perf_counter() - t)
        except BaseException:
            eng.close()
            raise
        return eng

    @property
    def primary(self) -> Replica:
        return self.replicas[0]

    @property
    def size(self) -> int:
        return len(self.replicas)

    def step(self, batch, step: int, lr: float, grad_clip: float, ahead=None) -> PendingStep:
        """One training step on `batch`, queued: returns before the GPUs have run it (PendingStep;
        its result() waits). `ahead`: the next step's batch, whose target features are made
        during this step's gradient sum (compute).

        The host runs one step ahead of the devices: it queues this step's forward and backward
        while they still run the previous step's update, then settles that update's norm (a
        non-finite one raises TrainerError here, before this step's update is queued, so the
        weights stay as they were before it), then queues this step's update. So the devices do not
        sit idle while the host reads a step's results and prepares the next one."""
        stats = self.compute(batch, host=False, ahead=ahead)
        self.settle()
        ends = run_all(self.workers, update_async, [(r, st, lr, grad_clip, step)
                                                    for r, st in zip(self.replicas, stats)])
        self._pending = PendingStep(ends)
        return self._pending

    def settle(self) -> None:
        """Wait for the last step's update and check its norm (TrainerError when not finite). Call
        before anything that reads or changes the weights outside step() (checkpoints, checks)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def compute(self, batch, host: bool = True, ahead=None) -> list[ShardStats]:
        """Forward + backward of every worker's shard, then the cross-replica sum: afterwards every
        replica holds the gradient of the global-batch loss (the first call is the warm-up).
        host=False: the stats stay on the devices (ShardStats.to_host), see step().
        ahead: the next step's batch; each worker then makes its shard's target features
        (step.prefetch_features) while the NCCL sum runs on side streams, so the sum's time hides
        behind the target's forward. Same arithmetic on the same data, so the same bits."""
        rs, K = self.replicas, len(self.replicas)
        shards = [batch.shard(i, K) for i in range(K)]
        copies = self._sum_by_copies()
        self._place_grads(copies or self.grads == "flat")
        if self._warm:
            stats = run_all(self.workers, compute_grads, [(r, s, host) for r, s in zip(rs, shards)])
        else:
            stats = [self._warm_up(w, shards[w.index]) for w in self.workers]
            self._warm = True
        if copies:
            run_all(self.workers, reduce_own_chunk, [(rs, i) for i in range(K)])
            run_all(self.workers, gather_chunks, [(rs, i) for i in range(K)])
        elif K > 1:
            nccl_all_reduce(rs, side=ahead is not None)
        if ahead is not None:
            run_all(self.workers, prefetch_features, [(r, ahead.shard(i, K)) for i, r in enumerate(rs)])
        return stats

    def _sum_by_copies(self) -> bool:
        """True when this step's gradient sum is the copy-based one (else NCCL, or none with one replica)."""
        if len(self.replicas) == 1:
            return False
        if self._nccl is None:
            self._nccl = nccl_usable(self.replicas)
        if self.allreduce == "nccl" and not self._nccl:
            raise TrainerError("allreduce = nccl, but the replicas are not one per GPU with NCCL "
                               "(allreduce.nccl_usable)")
        return self.allreduce == "copy" or not self._nccl

    def _place_grads(self, flat: bool) -> None:
        """Give every replica FlatGrads (made once, kept) or let each parameter own its gradient."""
        for r in self.replicas:
            if not flat:
                r.grads = None
            elif r.grads is None:
                r.grads = self._flat.get(r.index) or FlatGrads(r.params)
                self._flat[r.index] = r.grads

    def update(self, lr: float, grad_clip: float, step: int) -> float:
        """The same optimizer update in every worker; returns the pre-clip gradient norm."""
        self.settle()
        return run_all(self.workers, apply_update, [(r, lr, grad_clip, step) for r in self.replicas])[0]

    def run_each(self, fn: Callable, per_worker_args: list[tuple]) -> list:
        """fn(replica_i, *args_i) in worker i's thread, for every worker (after settle())."""
        self.settle()
        return run_all(self.workers, fn, [(r, *a) for r, a in zip(self.replicas, per_worker_args)])

    def _warm_up(self, w: Worker, shard):
        t = time.perf_counter()
        guard = self.guard and self.replicas[w.index].compiled
        what = f"warming up worker {w.index}" if not self.replicas[w.index].compiled else \
            f"compiling worker {w.index}"
        with heartbeat(self.log, what):
            stats, check = self._await(w, w.submit(_first_step, self.replicas[w.index], shard, guard))
        first, built = time.perf_counter() - t, self._built[w.index]
        self.log.metrics({"event": "worker_ready", "worker": w.index, "device": str(w.device),
                          "seconds": built + first, "build_s": built, "first_step_s": first})
        self.log.info(f"worker {w.index} ({w.device}) ready in {built + first:.1f}s (build {built:.1f}s, "
                      + ("compile + " if self.replicas[w.index].compiled else "") + f"first step {first:.1f}s)")
        if check is not None:
            log_guard(self.log, f"worker {w.index}", w.index, check)
        return stats

    def _await(self, w: Worker, fut: cf.Future):
        """A warm-up wait: the worker's result, WorkerFailed if it raised, WorkerHung past the timeout."""
        done, _ = cf.wait([fut], timeout=self.timeout)
        if not done:
            self._hung.add(w.index)
            err = WorkerHung(w.index, w.device, self.timeout)
            err.stack = w.stack()
            self.log.metrics({"event": "worker_hung", "worker": w.index, "device": str(w.device),
                              "seconds": self.timeout})
            raise err
        error = fut.exception()
        if error is not None:
            failed = WorkerFailed(w.index, w.device, error, phase="warmup")
            self.log.metrics({"event": "worker_failed", "worker": w.index, "device": str(w.device),
                              "phase": "warmup", "error": failed.what, "signature": failed.signature})
            raise failed from failed.error
        return fut.result()

    def check_replicas(self, step: int) -> None:
        """Every replica's weights must equal replica 0's, bit for bit; a divergence ends the run."""
        self.settle()
        if len(self.replicas) == 1:
            return
        sums = run_all(self.workers, weight_checksum, [(r,) for r in self.replicas])
        for i in range(1, len(sums)):
            bad = (sums[i] != sums[0]).nonzero().flatten().tolist()
            if bad:
                r0, ri = self.replicas[0], self.replicas[i]
                self.log.metrics({"event": "diverged", "step": step, "worker": i, "tensors": len(bad)})
                raise ReplicasDiverged(
                    f"replica weights diverged at step {step}: worker {i} ({ri.device}) differs from worker 0 "
                    f"({r0.device}) in {r0.names[bad[0]]}"
                    + (f" and {len(bad) - 1} more tensor(s)" if len(bad) > 1 else ""))
        self.log.metrics({"event": "checksum", "step": step, "replicas": len(sums)})

    def on_primary(self, fn: Callable, *args, **kwargs):
        """Run fn in worker 0's thread (it owns device 0 and the replica eval and saving use), after settle()."""
        self.settle()
        return self.workers[0].submit(fn, *args, **kwargs).result()

    def agree(self, flag: bool) -> bool:
        return flag  # one process: every worker sees the same flag

    def collectives_done(self) -> None:
        """(RankEngine's: no collective follows.)"""

    def excuse_until_boundary(self) -> None:
        """(RankEngine's: a rank works alone before the next step boundary.)"""

    def own_work(self):
        """(RankEngine's: this rank works alone, not waiting for the others.)"""
        return contextlib.nullcontext()

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        for w in self.workers:
            w.close(wait=w.index not in self._hung)


def _first_step(r: Replica, shard, guard: bool):
    faults.hit("fail_worker", index=r.index)
    stats = compute_grads(r, shard)
    return stats, (guard_first_step(r, shard, stats.loss_sum) if guard else None)


def log_guard(log, who: str, index: int, check) -> None:
    log.metrics({"event": "compile_guard", "worker": index, "grad_err": check.err, "tolerance": check.tol,
                 "loss": check.loss_c, "eager_loss": check.loss_e, "seconds": check.seconds})
    log.info(f"{who}: first compiled step matches eager (gradient relative L2 {check.err:.2g} <= {check.tol:g}); "
             f"the check cost {check.seconds:.1f}s (one eager forward/backward; --skip-compile-guard skips it)")
