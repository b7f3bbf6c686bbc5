"""Train a DFlash drafter: config -> devices -> target and data -> model -> workers (compile) -> loop -> cleanup.

Read top to bottom. Two topologies share everything but the engine that runs a step:
  threads (default, here): one worker thread per device (trainer/engine/workers.py: ThreadEngine);
  processes: one process per device under torchrun + DDP (trainer/train/distributed.py,
  trainer/engine/ranks.py: RankEngine), which shares run_folder / prepare / run_loop
  (trainer/train/loop.py) with this module.
Exit: 0 finished, 143 after SIGTERM (with a complete checkpoint), errors via trainer/exits.py.
"""
from __future__ import annotations

import copy
import faulthandler
import threading
import time

import torch

from trainer import cores, policies
from trainer.engine.step import build_replica
from trainer.engine.workers import ThreadEngine, WorkerFailed, WorkerHung
from trainer.exits import exit_process, report
from trainer.run import checkpoint
from trainer.run.config import TrainConfig
from trainer.run.log import RunLog
from trainer.train.loop import on_sigterm, owns_process, run_loop
from trainer.train.setup import devices_for, open_log, prepare, resolve_policy, run_folder

def main(cfg: TrainConfig) -> int:
    if cfg.topology == "processes":
        from trainer.train import distributed

        return distributed.main(cfg)
    stop, restore_signal = on_sigterm()
    # A native crash in a worker (a segfault after a CUDA-graph assertion: cudagraph-trees-tls in
    # trainer/signatures.yaml) then prints every thread's Python stack to the log instead of
    # dying silently.
    fault_was_on = faulthandler.is_enabled()
    if not fault_was_on:
        try:
            faulthandler.enable(all_threads=True)
        except (OSError, ValueError, AttributeError):  # stderr without a file descriptor (captured)
            fault_was_on = True
    try:
        return _main(cfg, stop)
    except (WorkerFailed, WorkerHung) as e:
        if (isinstance(e, WorkerHung) or e.phase == "warmup") and owns_process():
            try:  # a hung thread cannot be stopped, and a failed compile may leave native state behind
                _report(e)
            finally:
                exit_process(e.exit_code, finalize=False)
        raise
    finally:
        if not fault_was_on:
            faulthandler.disable()
        restore_signal()


def _main(cfg: TrainConfig, stop: threading.Event) -> int:
    # ---- config and run folder ----------------------------------------------------------------
    with run_folder(cfg, writer=True) as (out, resume_from):
        log = open_log(cfg, out)
        try:
            return _train(cfg, stop, out, resume_from, log)
        finally:
            log.close()


def _train(cfg: TrainConfig, stop: threading.Event, out, resume_from, log: RunLog) -> int:

    # ---- devices and compile policy -----------------------------------------------------------
    devices = devices_for(cfg)
    said = cores.training_threads(cfg.cpu_threads, len(devices) if devices[0].type == "cpu" else 0)
    if said:
        log.info(said)
    policy, why = resolve_policy(cfg, devices[0], out)
    log.info(f"torch {torch.__version__} | devices {', '.join(map(str, devices))} | topology threads | "
             f"compile policy {policy}" + (" (auto: from probe.json)" if cfg.compile_policy == "auto" else ""))
    if why:
        log.info(why)
    if policy == "reduce-overhead" and len(devices) > 1 and policies.torch_version() < (2, 13):
        # Not refused: the probe decides empirically; the warm-up handshake makes it fail fast and named.
        log.info("warning: CUDA Graph Trees fail in every worker thread but one before torch 2.13 "
                 "(cudagraph-trees-tls / cudagraph-trees-threads, pytorch#123177); expect a worker to fail. "
                 "--topology processes runs reduce-overhead")

    # ---- target, data, model ------------------------------------------------------------------
    prep = prepare(cfg, devices[0], log, out, resume_from, stop)

    # ---- workers: each builds its replica in its own thread, one after the other ---------------
    copies = [prep.drafter] + [copy.deepcopy(prep.drafter) for _ in devices[1:]]
    opt_state = prep.ck.optimizer if prep.ck else None

    def build(i: int, device: torch.device):
        return build_replica(i, device, copies[i], prep.target, policy=policy, n_devices=len(devices), lr=cfg.lr,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay,
                             pos_weights=prep.pos_weights, optimizer_state=opt_state,
                             compile_target=policies.compiled_part(cfg.compile_target, policy, device),
                             # workers share one interpreter: a graph spares each the target's launches
                             graph_target=cfg.graph_target == "on" and len(set(devices)) == len(devices),
                             compile_update=policies.compiled_part(cfg.compile_update, policy, device),
                             objective=prep.objective, muon=prep.muon)

    t0 = time.time()
    engine = ThreadEngine.start(devices, build, log, cfg.warmup_timeout, guard=not cfg.skip_compile_guard)
    try:
        log.info(f"{engine.size} replica(s) built in {time.time() - t0:.1f}s; "
                 + ("the first step runs one worker at a time" if policy == "eager" else
                    "compilation happens in the first step, one worker at a time"))
        if prep.ck is not None:
            checkpoint.restore_rng(prep.ck.rng)
        return run_loop(cfg, engine, prep, log, stop)
    finally:
        # ---- cleanup --------------------------------------------------------------------------
        engine.close()


def _report(e: WorkerFailed | WorkerHung) -> None:
    """Report a warm-up failure the way trainer.exits.run would (the process then ends without it).

    A worker thread stuck in a compile cannot be stopped or joined, and a failed CUDA-graph warm-up
    has crashed the interpreter on the way out (an AssertionError, then a segfault:
    cudagraph-trees-tls in trainer/signatures.yaml): exiting without finalization makes the exit
    status the one reported here.
    """
    stack = getattr(e, "stack", "")
    report(e, f"worker {e.index} was here when the run gave up on it:\n{stack}" if stack else "")
