"""Train a DFlash drafter: config -> devices -> target and data -> model -> workers (compile) -> loop -> cleanup.

Read top to bottom (style habit 6). The main thread coordinates; each worker thread owns one replica
on one device and does all the tensor work for it (trainer/step.py, trainer/workers.py).
Exit: 0 finished, 143 after SIGTERM (with a complete checkpoint), errors via trainer/cli.py.
"""
from __future__ import annotations

import copy
import json
import signal
import threading
import time
from pathlib import Path

import torch

from trainer import checkpoint, masks, policies
from trainer.config import RUN_CONFIG, TrainConfig, layer_ids
from trainer.data import (Loader, check_samples, encode_rows, make_batch, random_prompts, prompt_vocab, read_rows,
                          split_eval, synthetic)
from trainer.errors import EXIT_OK, EXIT_SIGTERM, UsageError
from trainer.eval import acceptance_length
from trainer.log import RunLog, step_line
from trainer.model import Drafter, flops_per_sample
from trainer.step import apply_update, build_replica, compute_grads, lr_at, reduce_grads
from trainer.target import load_target
from trainer.workers import Worker, run_all

# Settings that must not change across --resume (they change the model or the data it sees).
RESUME_FIXED = ("target", "target_layers", "data", "draft_layers", "block_size", "mask_token_id", "seq_len",
                "seed", "synthetic_samples", "synthetic_prompt_len", "synthetic_new_tokens",
                "synthetic_temperature", "eval_prompts")
# Dense bf16 peak FLOP/s by GPU name, for MFU; unknown GPUs report no MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
              "L40S": 362e12, "L4": 121e12, "4090": 165e12}


def main(cfg: TrainConfig) -> int:
    stop, restore_signal = _on_sigterm()
    try:
        return _main(cfg, stop)
    finally:
        restore_signal()


def _main(cfg: TrainConfig, stop: threading.Event) -> int:
    # ---- config and run folder ----------------------------------------------------------------
    if cfg.topology == "processes":
        raise UsageError("--topology processes is not implemented yet (issue 5); use --topology threads")
    out = Path(cfg.out)
    resume_from = checkpoint.find_latest(out) if cfg.resume else None
    if not cfg.resume and checkpoint.any_checkpoint(out):
        raise UsageError(f"--out {cfg.out} already holds checkpoints: pass --resume to continue, or use a new --out")
    _check_resume_config(cfg, out, resume_from)
    out.mkdir(parents=True, exist_ok=True)
    if resume_from is None:
        (out / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run's metrics start empty
    log = RunLog(out / "metrics.jsonl")
    (out / RUN_CONFIG).write_text(json.dumps(cfg.to_dict(), indent=1))

    # ---- devices and compile policy -----------------------------------------------------------
    devices = _devices(cfg)
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    policy = policies.resolve(cfg.compile_policy, cfg.workdir or None)
    log.info(f"torch {torch.__version__} | devices {', '.join(map(str, devices))} | topology threads | "
             f"compile policy {policy}" + (" (auto: from probe.json)" if cfg.compile_policy == "auto" else ""))
    if policies.needs_cuda(policy) and devices[0].type != "cuda":
        raise UsageError(f"--compile-policy {policy} captures CUDA graphs and needs --gpus >= 1")

    # ---- target and data ----------------------------------------------------------------------
    dtype = torch.bfloat16 if devices[0].type == "cuda" else torch.float32
    target = load_target(cfg.target, device=devices[0], dtype=dtype, layers=layer_ids(cfg))
    log.info(f"target {cfg.target}: {target.num_layers} layers, hidden {target.config.hidden_size}, "
             f"features from layers {list(target.layer_ids)}")
    samples, eval_prompts = _load_data(cfg, target, out, log, stop)
    if resume_from is None:
        (out / "eval_prompts.json").write_text(json.dumps(eval_prompts))
    pad_len = min(cfg.seq_len, max(len(s.input_ids) for s in samples))
    gamma = cfg.gamma or masks.default_gamma(cfg.block_size)
    pos_weights = masks.position_weights(cfg.block_size, gamma)

    # ---- model --------------------------------------------------------------------------------
    dcfg = target.drafter_config(num_layers=cfg.draft_layers, block_size=cfg.block_size,
                                 mask_token_id=None if cfg.mask_token_id < 0 else cfg.mask_token_id)
    torch.manual_seed(cfg.seed)
    drafter = Drafter(dcfg)
    n_params = sum(p.numel() for _, p in drafter.trainable_parameters())
    ck = checkpoint.load(resume_from) if resume_from else None
    if ck is not None:
        drafter.load_trainable_state_dict(ck.model)
    log.info(f"drafter: {dcfg.num_layers} layers, {n_params / 1e6:.2f}M trainable params, block {dcfg.block_size}, "
             f"mask token {dcfg.mask_token_id}, gamma {gamma:g}")

    # ---- workers: each builds and compiles its replica in its own thread ----------------------
    workers = [Worker(i, d) for i, d in enumerate(devices)]
    copies = [drafter] + [copy.deepcopy(drafter) for _ in devices[1:]]
    t0 = time.time()
    try:
        replicas = run_all(workers, _build, [
            (i, d, copies[i], target, policy, len(devices), cfg, pos_weights, ck.optimizer if ck else None)
            for i, d in enumerate(devices)])
        log.info(f"{len(replicas)} worker(s) ready in {time.time() - t0:.1f}s"
                 + ("" if policy == "eager" else "; compilation happens in the first step"))
        if ck is not None:
            checkpoint.restore_rng(ck.rng)
        return _loop(cfg, log, out, workers, replicas, samples, eval_prompts, pad_len, pos_weights,
                     ck, stop, flops_per_sample(dcfg, pad_len, cfg.anchors * cfg.block_size))
    finally:
        # ---- cleanup --------------------------------------------------------------------------
        for w in workers:
            w.close()


def _loop(cfg, log, out, workers, replicas, samples, eval_prompts, pad_len, pos_weights, ck, stop, flops) -> int:
    loader = Loader(len(samples), cfg.seed)
    step = 0
    if cfg.resume and ck is None:
        log.info(f"--resume: no checkpoint in {out}, starting from step 0")
    if ck is not None:
        loader.load_state(ck.meta["data"])
        step = ck.step
        log.info(f"resumed from {ck.path} at step {step}")
        # Lines logged after this checkpoint by the interrupted run are superseded from here on.
        log.metrics({"event": "resume", "step": step})
    r0, K = replicas[0], len(replicas)
    peak = _peak_flops(r0.device) if r0.device.type == "cuda" else None
    peak = peak * K if peak else None
    if cfg.eval_at_start and step == 0 and eval_prompts:
        _eval(cfg, log, workers, r0, eval_prompts, step)

    last_loss = None
    while step < cfg.steps:
        if stop.is_set():
            return _stopped(cfg, log, out, replicas, loader, step)
        t = time.perf_counter()
        batch = make_batch([samples[i] for i in loader.next(cfg.batch_size)], pad_len=pad_len,
                           pad_id=0, step=step, seed=cfg.seed, block_size=cfg.block_size,
                           anchors=cfg.anchors, pos_weights=pos_weights)
        stats = run_all(workers, compute_grads, [(r, batch.shard(i, K)) for i, r in enumerate(replicas)])
        reduce_grads(replicas)
        lr = lr_at(step, steps=cfg.steps, lr=cfg.lr, min_lr=cfg.min_lr, warmup=cfg.warmup)
        norms = run_all(workers, apply_update, [(r, lr, cfg.grad_clip, step) for r in replicas])
        step += 1
        dt = time.perf_counter() - t

        last_loss = sum(s.loss_sum for s in stats) / max(batch.weight_total, 1e-12)
        if step % cfg.log_every == 0 or step == cfg.steps:
            correct = sum(s.correct for s in stats).float()
            count = sum(s.count for s in stats).float()
            per_pos = (correct / count.clamp(min=1))[1:].tolist()  # block positions 1..B-1
            m = {"step": step, "loss": last_loss, "accuracy": float(correct.sum() / count.sum().clamp(min=1)),
                 "acc_per_position": per_pos, "lr": lr, "grad_norm": norms[0],
                 "tokens_per_s": batch.tokens / dt, "samples_per_s": len(batch) / dt, "step_s": dt}
            if peak:
                m["mfu"] = flops * len(batch) / dt / peak
            log.info(step_line(m, cfg.steps))
            log.metrics(m)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps:
            _save(cfg, log, out, replicas, loader, step)
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps and eval_prompts:
            _eval(cfg, log, workers, r0, eval_prompts, step)

    _save(cfg, log, out, replicas, loader, step)
    if stop.is_set():
        log.metrics({"event": "stopped", "step": step})
        return EXIT_SIGTERM
    tau = _eval(cfg, log, workers, r0, eval_prompts, step, final=True, stop=stop) if eval_prompts else None
    if stop.is_set():  # SIGTERM during the final eval: the checkpoint above is complete
        log.metrics({"event": "stopped", "step": step})
        return EXIT_SIGTERM
    log.metrics({"event": "done", "step": step, "loss": last_loss, "acceptance_length": tau})
    log.info(f"done: {step} steps" + (f", acceptance length {tau:.3f}" if tau is not None else ""))
    return EXIT_OK


# ---- helpers, in the order main uses them ---------------------------------------------------------

def _check_resume_config(cfg: TrainConfig, out: Path, resume_from) -> None:
    if resume_from is None:
        return
    try:
        old = json.loads((out / RUN_CONFIG).read_text())
    except (OSError, ValueError):
        return
    changed = [k for k in RESUME_FIXED if k in old and old[k] != getattr(cfg, k)]
    if changed:
        k = changed[0]
        raise UsageError(f"--resume: {k} was {old[k]!r} in {out / RUN_CONFIG}, now {getattr(cfg, k)!r}; "
                         "a resumed run must keep the model and data settings")


def _on_sigterm():
    """SIGTERM sets a flag; the loop checkpoints at the next step boundary and exits 143.

    Returns (flag, restore): restore puts the previous handler back (main() may run in-process).
    """
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return stop, lambda: None
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return stop, lambda: signal.signal(signal.SIGTERM, previous)


def _devices(cfg: TrainConfig) -> list[torch.device]:
    if cfg.gpus == 0:
        return [torch.device("cpu")] * cfg.workers
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < cfg.gpus:
        raise UsageError(f"--gpus {cfg.gpus}: this machine has {have} CUDA device(s)")
    return [torch.device(f"cuda:{i}") for i in range(cfg.gpus)]


def _load_data(cfg, target, out, log, stop):
    if cfg.data == "synthetic":
        t = time.time()
        path = synthetic(target, out_dir=str(out), n=cfg.synthetic_samples, prompt_len=cfg.synthetic_prompt_len,
                         new_tokens=cfg.synthetic_new_tokens, temperature=cfg.synthetic_temperature,
                         seed=cfg.seed, min_new=cfg.block_size, should_stop=stop.is_set)
        log.info(f"synthetic data: {path} ({time.time() - t:.1f}s)")
        samples, skipped = _read_samples(str(path), cfg, target)
        low, high, exclude = prompt_vocab(target)
        # Held out by construction: fresh random prompts from another seed.
        prompts = random_prompts(cfg.eval_prompts, cfg.synthetic_prompt_len, low=low, high=high,
                                 seed=cfg.seed + 7_777_777, exclude=exclude)
        return samples, prompts
    samples, skipped = _read_samples(cfg.data, cfg, target)
    samples, prompts, held_out = split_eval(samples, cfg.eval_prompts)
    log.info(f"data {cfg.data}: {len(samples)} rows for training"
             + (f", {skipped} skipped (no room for a block in the loss mask)" if skipped else "")
             + ("" if held_out else "; eval prompts come from training rows (too few rows to hold out)"))
    return samples, prompts


def _read_samples(path: str, cfg, target):
    rows = encode_rows(read_rows(path), target.tokenizer, path)
    vocab = target.model.get_input_embeddings().weight.shape[0]
    return check_samples(rows, path=path, block_size=cfg.block_size, seq_len=cfg.seq_len, vocab_size=vocab)


def _build(i, device, drafter, target, policy, n_devices, cfg, pos_weights, optimizer_state):
    return build_replica(i, device, drafter, target, policy=policy, n_devices=n_devices, lr=cfg.lr,
                         weight_decay=cfg.weight_decay, pos_weights=pos_weights, optimizer_state=optimizer_state)


def _save(cfg, log, out, replicas, loader, step) -> None:
    t = time.time()
    r0 = replicas[0]
    path = checkpoint.save(out, step, model=r0.drafter.trainable_state_dict(), optimizer=r0.optimizer.state_dict(),
                           meta={"data": loader.state(), "config": cfg.to_dict()}, keep=cfg.keep_checkpoints)
    log.metrics({"event": "checkpoint", "step": step, "path": str(path), "seconds": time.time() - t})


def _stopped(cfg, log, out, replicas, loader, step) -> int:
    log.info(f"SIGTERM: writing a checkpoint at step {step}, then exiting")
    _save(cfg, log, out, replicas, loader, step)
    log.metrics({"event": "stopped", "step": step})
    return EXIT_SIGTERM


def _eval(cfg, log, workers, r0, prompts, step, final=False, stop=None):
    """Acceptance length, measured in worker 0's thread (it owns the device and the drafter)."""
    t = time.time()
    res = workers[0].submit(acceptance_length, r0.target, r0.drafter, prompts, max_new_tokens=cfg.eval_new_tokens,
                            should_stop=stop.is_set if stop else (lambda: False)).result()
    log.info(f"eval at step {step}: acceptance length {res['acceptance_length']:.3f} over {res['rounds']} rounds, "
             f"{len(prompts)} prompts ({time.time() - t:.1f}s)")
    if not final:
        log.metrics({"event": "eval", "step": step, "acceptance_length": res["acceptance_length"]})
    return res["acceptance_length"]


def _peak_flops(device: torch.device) -> float | None:
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)

