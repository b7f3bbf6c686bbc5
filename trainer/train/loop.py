"""The step loop, shared by both topologies: run_loop over an engine with its batches, checkpoints and
evals (evals.py), and the SIGTERM handling. What it runs on (the run folder, the devices, the policy,
prepare's target, data and drafter) is setup.py. trainer/train/main.py drives both with worker threads,
trainer/train/distributed.py with one torchrun rank per device.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time

import torch

from trainer import faults
from trainer.errors import EXIT_OK, EXIT_SIGTERM
from trainer.engine.protocol import Engine
from trainer.run import checkpoint, sizing
from trainer.run.config import TrainConfig
from trainer.run.data import Loader
from trainer.run.log import eval_line, step_line
from trainer.train.batches import Batches
from trainer.train import evals
from trainer.train.lr_schedule import lr_at
from trainer.train.setup import Prepared

# Dense bf16 peak FLOP/s by GPU name, for MFU; unknown GPUs report no MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
              "L40S": 362e12, "L4": 121e12, "4090": 165e12}


def run_loop(cfg: TrainConfig, engine: Engine, prep: Prepared, log, stop: threading.Event) -> int:
    """The training loop over an engine (ThreadEngine or RankEngine, trainer/engine/protocol.Engine): the
    same steps, logs, checkpoints.

    Under processes every rank runs this loop; engine.agree/check_replicas/barrier are collectives,
    called at the same points on every rank; only the writer (rank 0) logs metrics and evaluates; the
    savers (rank 0, and the first rank of every other node) write checkpoints.
    """
    # --epochs and --eval-every auto, decided once in prepare
    cfg = dataclasses.replace(cfg, steps=prep.steps or cfg.steps, eval_every=max(0, prep.eval_every))
    out, ck = prep.out, prep.ck
    loader = Loader(len(prep.samples), cfg.seed)
    step = 0
    if cfg.resume and ck is None:
        log.info(f"--resume: no checkpoint in {out}, starting from step 0")
    if ck is not None:
        loader.load_state(ck.meta["data"])
        step = ck.step
        log.info(f"resumed from {ck.path} at step {step}")
        # Lines logged after this checkpoint by the interrupted run are superseded from here on.
        log.metrics({"event": "resume", "step": step})
    batches = Batches(cfg, prep, loader)
    r0 = engine.primary
    peak = _peak_flops(r0.device) if r0.device.type == "cuda" else None
    peak = peak * max(1, cfg.gpus) if peak else None  # workers may share a GPU: count GPUs
    if cfg.eval_at_start and step == 0 and prep.eval_prompts:
        evals.evaluate(cfg, log, engine, prep, step)

    last_loss = None
    t_loop, first = time.perf_counter(), step   # the wall clock of this process's steps (the done event)
    # The step queued last, logged once the next one is queued (engine.step returns before the
    # devices have run it), or at a step boundary that needs its results.
    pending = None
    slow_said: list[int] = []   # the step whose slowness was said (once)

    def finish(until: float | None = None) -> None:
        """Read and log the pending step (waits for its update; a non-finite norm raises). Its
        time runs from its start to `until`, the next step's start, or to now."""
        nonlocal pending, last_loss
        if pending is None:
            return
        n, handle, batch, lr, t = pending
        pending = None
        res = handle.result()
        dt = (until if until is not None else time.perf_counter()) - t
        last_loss = res.loss_sum / max(batch.weight_total, 1e-12)
        if n % cfg.log_every == 0 or n == cfg.steps:
            correct, count = res.correct.float(), res.count.float()
            per_pos = (correct / count.clamp(min=1))[1:].tolist()  # block positions 1..B-1
            m = {"step": n, "loss": last_loss, "accuracy": float(correct.sum() / count.sum().clamp(min=1)),
                 "acc_per_position": per_pos, "lr": lr, "grad_norm": res.grad_norm,
                 "tokens_per_s": batch.tokens / dt, "samples_per_s": len(batch) / dt, "step_s": dt,
                 "peak_memory_gb": _peak_memory_gb(r0.device)}
            if peak:
                m["mfu"] = prep.flops * len(batch) / dt / peak
            # this process's pace so far, evals and checkpoints included: what the rest will take
            elapsed = time.perf_counter() - t_loop
            rate = (n - first) / elapsed if elapsed > 0 and n > first else None
            m.update(elapsed_s=elapsed, steps_per_s=rate, eta_s=(cfg.steps - n) / rate if rate else None)
            log.info(step_line(m, cfg.steps))
            log.metrics(m)
        # once, past the first step (which builds and warms up): a CPU run that will take long says so
        if not slow_said and n > first + 1 and dt > sizing.SLOW_STEP_S and r0.device.type == "cpu":
            slow_said.append(n)
            log.info(sizing.slow_line(dt, cfg.steps - n, prep.anchors, cfg.batch_size, cfg.n_devices))

    while step < cfg.steps:
        faults.hit("step_pause", step=step)
        if engine.agree(stop.is_set()):
            finish()
            return _stopped(cfg, log, prep, engine, batches, step)
        t = time.perf_counter()
        batch = batches.take(step)
        lr = lr_at(step, steps=cfg.steps, lr=cfg.lr, min_lr=cfg.min_lr, warmup=cfg.warmup)
        res = engine.step(batch, step, lr, cfg.grad_clip, ahead=batches.peek(step + 1))
        finish(until=t)
        step += 1
        pending = (step, res, batch, lr, t)
        checksum = cfg.checksum_every and step % cfg.checksum_every == 0 and step < cfg.steps
        save = cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps
        evaluate = cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps and prep.eval_prompts
        if checksum or save or evaluate:
            finish()
        if checksum:
            engine.check_replicas(step)
        if save:
            _save(cfg, log, prep, engine, batches, step)
        if evaluate:
            evals.evaluate(cfg, log, engine, prep, step)

    finish()
    engine.check_replicas(step)
    _save(cfg, log, prep, engine, batches, step)
    # every step this process ran, the first one's warm-up and the checkpoints too; not the final eval
    trained = {"steps_trained": step - first, "trained_s": round(time.perf_counter() - t_loop, 3)}
    stopped = engine.agree(stop.is_set())
    engine.collectives_done()   # rank 0's final eval is its own
    if stopped:
        log.metrics({"event": "stopped", "step": step})
        return EXIT_SIGTERM
    if not engine.writer:
        return EXIT_OK
    tau = evals.evaluate(cfg, log, engine, prep, step, final=True, stop=stop) if prep.eval_prompts else None
    if stop.is_set():  # SIGTERM during the final eval: the checkpoint above is complete
        log.metrics({"event": "stopped", "step": step})
        return EXIT_SIGTERM
    log.metrics({"event": "done", "step": step, "loss": last_loss, **trained, **evals.tau_metrics(tau)})
    log.info(f"done: {step} steps ({trained['steps_trained']} trained in {trained['trained_s']:.1f} s, "
             "warm-up included)" + (f"; {eval_line(tau, prep.eval_overlap)}" if tau else ""))
    return EXIT_OK


def on_sigterm():
    """SIGTERM sets a flag; the loop checkpoints at the next step boundary and exits 143. So does a
    first Ctrl-C of a trainer run by hand (not a torchrun rank: torchrun handles SIGINT for its ranks),
    which says so; a second one interrupts at once, as Ctrl-C does elsewhere.

    Returns (flag, restore): restore puts the previous handlers back (main() may run in-process).
    """
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return stop, lambda: None
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: stop.set())}
    if "LOCAL_RANK" not in os.environ and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        def on_ctrl_c(*_):
            if stop.is_set():
                raise KeyboardInterrupt
            stop.set()
            print("[trainer] Ctrl-C: checkpointing at the next step boundary, then exiting (Ctrl-C again to "
                  "quit at once, without a checkpoint)", flush=True)
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, on_ctrl_c)
    return stop, lambda: [signal.signal(s, h) for s, h in previous.items()]


def _save(cfg: TrainConfig, log, prep: Prepared, engine: Engine, batches: Batches, step: int) -> None:
    engine.excuse_until_boundary()   # on every rank: the saver works alone, the others wait for it
    engine.settle()  # the last step's update has run and its norm is finite
    if not engine.saver:     # rank 0, and under several nodes the first rank of each node
        return
    t = time.time()
    r0 = engine.primary
    with engine.own_work():  # a SIGTERM's grace does not run out while this rank writes
        path = checkpoint.save(prep.out, step, model=r0.drafter.trainable_state_dict(),
                               optimizer=r0.optimizer.state_dict(), keep=cfg.keep_checkpoints,
                               meta={"data": batches.state(), "config": cfg.to_dict(), "target": prep.identity,
                                     "anchors": sizing.record(cfg.anchors, prep.anchors)})
    log.metrics({"event": "checkpoint", "step": step, "path": str(path), "seconds": time.time() - t})


def _stopped(cfg: TrainConfig, log, prep: Prepared, engine: Engine, batches: Batches, step: int) -> int:
    log.info(f"SIGTERM: writing a checkpoint at step {step}, then exiting")
    _save(cfg, log, prep, engine, batches, step)
    engine.barrier()  # ranks leave together, after rank 0's checkpoint is complete
    engine.collectives_done()
    log.metrics({"event": "stopped", "step": step})
    return EXIT_SIGTERM


def _peak_memory_gb(device: torch.device) -> float:
    """The most memory this process has held so far, in GiB: the CUDA allocator's on a GPU (the
    primary's device), the resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20     # KiB on Linux


def _peak_flops(device: torch.device) -> float | None:
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def owns_process() -> bool:
    """True when this process is `python -m trainer` (not a test or a library calling main())."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) in ("trainer", "trainer.__main__")
