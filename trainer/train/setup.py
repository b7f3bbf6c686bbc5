"""A run's setup, shared by both topologies: the run folder (open_run, run_folder), the log, the
devices and the compile policy (resolved once, here), and what every replica is built from (prepare:
the target, the data, the drafter, the anchors, the run's length, a resume's checks). The step loop
that runs on it is loop.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer import files, policies
from trainer.errors import UsageError
from trainer.engine.muon import MuonSettings, takes_muon
from trainer.model import choices, fp8, masks
from trainer.model.drafter import Drafter, DrafterConfig, flops_per_sample
from trainer.model.objective import Objective
from trainer.run import checkpoint, provenance, sizing
from trainer.run.cache import cache_root
from trainer.run.config import CHOSEN_POLICY, RUN_CONFIG, TrainConfig, chat_template_options, layer_ids, objective_of
from trainer.run.data import (check_samples, encode_rows, most_anchors, overlap, read_rows,
                              split_eval, synthetic)
from trainer.run.log import RunLog, heartbeat
from trainer.run.trackers import Trackers, check as trackers_to_use
from trainer.run.target import Target, load_target

# Settings that must not change across --resume (they change the model or the data it sees).
RESUME_FIXED = ("target", "target_layers", "data", "draft_layers", "block_size", "mask_token_id", "seq_len",
                "seed", "synthetic_samples", "synthetic_prompt_len", "synthetic_new_tokens",
                "synthetic_temperature", "eval_prompts", "freeze_draft_norm", "chat_template_kwargs",
                "train_thinking")


@dataclass
class Prepared:
    """Everything a replica is built from: the same on every worker and every rank."""
    out: Path
    ck: checkpoint.Checkpoint | None
    target: Target
    samples: list
    eval_prompts: list
    pad_len: int
    pos_weights: torch.Tensor
    dcfg: DrafterConfig
    drafter: Drafter             # initial (or resumed) trainable weights, on the CPU
    flops: float                 # training FLOPs per sample, for MFU
    identity: dict | None = None  # the target as trained against, recorded in every checkpoint (provenance.py)
    eval_overlap: int = 0        # eval prompts that are also training rows' prompts (--eval-overlap-ok)
    anchors: int = 0             # anchors per sequence a step uses: --anchors, or fewer (sizing.py)
    objective: Objective = Objective()  # what the loss trains the drafter to match (--objective)
    muon: MuonSettings | None = None    # --optimizer muon's settings; None: AdamW alone (the recipe)
    steps: int = 0               # the run's length: --steps, or what --epochs makes of the rows (run_length)
    eval_every: int = 0          # --eval-every, or what auto (-1) makes of the length (run_length)
    held_out: list = dataclasses.field(default_factory=list)   # the held-out rows: the loss at each eval


def open_run(cfg: TrainConfig, *, writer: bool) -> tuple[Path, Path | None]:
    """Check the run folder (fresh vs --resume); the writer creates it and records the settings."""
    out = Path(cfg.out)
    resume_from = checkpoint.find_latest(out) if cfg.resume else None
    if not cfg.resume and checkpoint.any_checkpoint(out):
        raise UsageError(f"--out {cfg.out} already holds checkpoints: pass --resume to continue, or use a new --out")
    _check_resume_config(cfg, out, resume_from)
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        if resume_from is None:
            (out / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run's metrics start empty
        (out / RUN_CONFIG).write_text(json.dumps(cfg.to_dict(), indent=1))
    return out, resume_from


@contextlib.contextmanager
def run_folder(cfg: TrainConfig, *, writer: bool) -> Iterator[tuple[Path, Path | None]]:
    """open_run for the process that trains; the writer holds the run's lock meanwhile, so that
    `python -m trainer.export` knows this run is running."""
    out, resume_from = open_run(cfg, writer=writer)
    with provenance.running(out) if writer else contextlib.nullcontext():
        yield out, resume_from


def open_log(cfg: TrainConfig, out: Path) -> RunLog:
    """The writer's log: stdout, OUT/metrics.jsonl, and the trackers --report-to names (closed by
    log.close())."""
    log = RunLog(out / "metrics.jsonl")
    names = trackers_to_use(cfg.report_to)
    if names:
        log.trackers = Trackers(names, out, log.info)
    return log


def resolve_policy(cfg: TrainConfig, device: torch.device, out: Path | None = None) -> tuple[str, str | None]:
    """The run's policy, and for auto the line that says why it is eager (a run too short for the
    probe's choice to pay its compile back), or None. The writer (out given) records it in
    out/CHOSEN_POLICY, which `dflash-ops status` reads back: `auto` is resolved here, and only here."""
    policy, why = policies.resolve_for_run(cfg.compile_policy, cfg.workdir or None, cfg.topology, cfg.steps)
    if policies.needs_cuda(policy) and device.type != "cuda":
        raise UsageError(f"--compile-policy {policy} captures CUDA graphs and needs --gpus >= 1")
    if out is not None:
        with files.atomic_file(Path(out) / CHOSEN_POLICY) as f:
            json.dump({"compile_policy": policy, "asked": cfg.compile_policy, "why": why}, f)
    return policy, why


def prepare(cfg: TrainConfig, device: torch.device, log, out: Path, resume_from, stop: threading.Event, *,
            writer: bool = True, barrier=lambda: None, load_checkpoint=None, agree_min=lambda n: n) -> Prepared:
    """Target on `device`, data, eval prompts, the initial drafter, the anchors a step uses. Ranks
    other than the writer wait (barrier) for the writer to make the synthetic data and eval prompts,
    then read them (a rank on another node makes the same data itself: same seed, same rows).
    load_checkpoint(resume_from) gives the checkpoint to resume from (default: that folder's);
    agree_min(n) is the least n over the ranks (every rank draws the same global batch)."""
    choices.configure(fp32_wgrad=cfg.fp32_wgrad == "on", flex_tiles=cfg.flex_tiles, ce_rows=cfg.ce_rows,
                      ce_kernel_on=cfg.ce_kernel == "on")
    if cfg.precision != "bf16" and (why := fp8.refusal(device, cfg.fp8_emulate)):
        raise UsageError(f"--precision {cfg.precision}: {why}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    objective = objective_of(cfg)
    target = load_target(cfg.target, device=device, dtype=dtype, layers=layer_ids(cfg), final_hidden=objective.distills)
    log.info(f"target {cfg.target}: {target.num_layers} layers, hidden {target.config.hidden_size}, "
             f"features from layers {list(target.layer_ids)}")
    if not writer:
        barrier()
    samples, eval_prompts, eval_overlap, held = _load_data(cfg, target, out, log, stop)
    if writer:
        if resume_from is None:
            (out / "eval_prompts.json").write_text(json.dumps(eval_prompts))
        barrier()
    pad_len = min(cfg.seq_len, max(len(s.input_ids) for s in samples))
    gamma = cfg.gamma or masks.default_gamma(cfg.block_size)
    # D-PACE weighs the loss mask's rows itself, in the loss; a batch's total is then their count
    pos_weights = (masks.flat_weights(cfg.block_size) if objective.dpace
                   else masks.position_weights(cfg.block_size, gamma))

    dcfg = target.drafter_config(num_layers=cfg.draft_layers, block_size=cfg.block_size,
                                 mask_token_id=None if cfg.mask_token_id < 0 else cfg.mask_token_id,
                                 own_norm=not cfg.freeze_draft_norm)
    torch.manual_seed(cfg.seed)
    drafter = Drafter(dcfg)
    drafter.init_norm(target.head_weights()[1].cpu())
    n_params = sum(p.numel() for _, p in drafter.trainable_parameters())
    ck = load_checkpoint(resume_from) if load_checkpoint else checkpoint.load(resume_from) if resume_from else None
    record = provenance.recorded(target, dcfg.mask_token_id)
    if ck is not None:      # before its weights meet a drafter of another target's shape
        _check_resumed_target(cfg, ck, record, log)
        _check_resumed_optimizer(cfg, ck)
    if ck is not None and drafter.load_trainable_state_dict(ck.model):
        # A checkpoint from before the drafter trained its own final norm: the norm starts from the
        # target's, and the optimizer gets a fresh state for it (the last trainable parameter).
        checkpoint.add_optimizer_params(ck.optimizer, len(drafter.trainable_parameters()))
        log.info("the checkpoint has no final norm of the drafter's own (an older trainer wrote it): "
                 "it starts from the target's norm")
    log.info(f"drafter: {dcfg.num_layers} layers, {n_params / 1e6:.2f}M trainable params, block {dcfg.block_size}, "
             f"mask token {dcfg.mask_token_id}, " + ("" if objective.dpace else f"gamma {gamma:g}, ")
             + f"objective {objective.described()}")
    if cfg.precision != "bf16":
        log.info(fp8.described(cfg.precision, cfg.fp8_emulate, fp8.use(drafter, cfg.precision, cfg.fp8_emulate)))
    muon = _muon(cfg, drafter, log)
    anchors = _anchors(cfg, device, dcfg, n_params, pad_len, samples, log, agree_min, ck, objective)
    return Prepared(out, ck, target, samples, eval_prompts, pad_len, pos_weights, dcfg, drafter,
                    flops_per_sample(dcfg, pad_len, anchors * cfg.block_size), record, eval_overlap, anchors, objective,
                    muon, *run_length(cfg, len(samples), bool(eval_prompts), log),
                    held_out=[s for s in held if len(s.input_ids) <= pad_len])


def run_length(cfg: TrainConfig, rows: int, evals: bool, log) -> tuple[int, int]:
    """(steps, eval_every): --steps, or with --epochs the steps that many passes over the training rows
    take; --eval-every, or with auto (-1) about 10 evals a run. Each derived value said once."""
    steps = cfg.steps
    if cfg.epochs:
        steps = max(1, math.ceil(cfg.epochs * rows / cfg.batch_size))
        log.info(f"--epochs {cfg.epochs:g}: {steps} steps ({rows} training rows, batch {cfg.batch_size}), not --steps")
    every = cfg.eval_every
    if every < 0:
        every = max(1, round(steps / 10)) if steps >= 10 else 0
        if evals:
            when = f"evals every {every} steps and at the end" if every else "evals at the end"
            log.info(f"{when} (--eval-every auto; {'the untrained baseline first; ' if cfg.eval_at_start else ''}"
                     "--eval-every N sets it, 0: at the end only)")
    return steps, every


def _muon(cfg: TrainConfig, drafter: Drafter, log) -> MuonSettings | None:
    """--optimizer muon's settings (None for adamw), said in one line."""
    if cfg.optimizer != "muon":
        return None
    muon = MuonSettings(lr=cfg.muon_lr or cfg.lr, momentum=cfg.muon_momentum, weight_decay=cfg.muon_weight_decay)
    named = drafter.trainable_parameters()
    n = sum(takes_muon(k, p) for k, p in named)
    log.info(f"optimizer muon: {n} weight matrices (peak lr {muon.lr:g}, momentum {muon.momentum:g}, weight decay "
             f"{muon.weight_decay:g}, {muon.ns_steps} Newton-Schulz steps), AdamW for the other {len(named) - n} "
             f"parameters (peak lr {cfg.lr:g}); the update runs uncompiled")
    return muon


def _check_resumed_optimizer(cfg: TrainConfig, ck) -> None:
    """A resume continues with the optimizer whose state its checkpoint holds (an older trainer's: AdamW)."""
    then = (ck.meta.get("config") or {}).get("optimizer", "adamw")
    if then != cfg.optimizer:
        raise UsageError(f"--resume: {ck.path} holds {then}'s optimizer state, and this run asks for --optimizer "
                         f"{cfg.optimizer}; resume with --optimizer {then}, or start a new --out")


def _check_resumed_target(cfg: TrainConfig, ck, now: dict, log) -> None:
    """A resume continues against the target its checkpoint was trained with: one whose weights,
    config, layers read or mask token changed is refused unless --target-changed-ok (and then still
    when its shape or layers cannot take the drafter)."""
    then = ck.meta.get("target")
    if not then:    # an older trainer wrote it: nothing to compare
        return
    changed = provenance.changes(then, now)
    what = f"--resume: the target {cfg.target} is not the one {ck.path} was trained against"
    provenance.check(then, changed, cfg.target, now["num_layers"], cfg.target_changed_ok, refused=what,
                     anyway="to continue against it anyway")
    if changed:
        log.info(f"{what} ({', '.join(changed.values())}); continuing (--target-changed-ok)")


def _anchors(cfg: TrainConfig, device: torch.device, dcfg: DrafterConfig, n_params: int, pad_len: int, samples,
             log, agree_min, ck=None, objective: Objective = Objective()) -> int:
    """--anchors, or fewer where the rows or the device's free memory cannot take them: one line then.
    A resume keeps what its checkpoint recorded (sizing.resumed), said in one line."""
    seqs = max(1, cfg.batch_size // (cfg.n_devices * cfg.nnodes))
    # distilling, the target's final hidden state rides with its features: one layer's more
    shape = sizing.Shape(hidden=dcfg.hidden_size, intermediate=dcfg.intermediate_size, layers=dcfg.num_layers,
                         kv_dim=dcfg.num_kv_heads * dcfg.head_dim,
                         feature_layers=dcfg.num_target_layers + (1 if objective.distills else 0),
                         trainable=n_params, block=cfg.block_size, pad_len=pad_len, seqs=seqs,
                         room=most_anchors(samples, cfg.block_size))
    if device.type == "cuda":
        sharing = cfg.n_devices // cfg.gpus if cfg.topology == "threads" else 1
        dev = sizing.Device("cuda", str(device), free=torch.cuda.mem_get_info(device)[0], workers=sharing)
    else:
        dev = sizing.Device("cpu", "cpu")
    fit = sizing.fit_anchors(cfg.anchors, shape, dev,
                             lambda n: seqs * flops_per_sample(dcfg, pad_len, n * cfg.block_size))
    anchors = agree_min(fit.anchors)       # on every rank, resumed or not: it is a collective
    line = fit.line
    if anchors != fit.anchors:
        asked = cfg.anchors or sizing.auto_anchors(dev.kind)
        line = f"anchors {anchors} instead of {asked}: another rank's device has less free memory"
    kept = sizing.resumed(ck.meta.get("anchors"), cfg.anchors, sizing.Fit(anchors, line)) if ck else None
    if kept is not None:
        anchors, line = kept.anchors, kept.line
    if line:
        log.info(line)
    return anchors


def devices_for(cfg: TrainConfig) -> list[torch.device]:
    """One device per worker: cuda:0..N-1, or with --workers K > N, worker i on cuda:(i mod N)."""
    if cfg.gpus == 0:
        return [torch.device("cpu")] * cfg.workers
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < cfg.gpus:
        raise UsageError(f"--gpus {cfg.gpus}: this machine has {have} CUDA device(s)")
    return [torch.device(f"cuda:{i % cfg.gpus}") for i in range(cfg.n_devices)]


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


def _load_data(cfg, target, out, log, stop):
    """Training rows and the eval prompts held out from them: the last --eval-prompts rows, synthetic
    data included (it makes that many rows more). An eval prompt that is also a training row's
    prompt measures what the drafter trained on: refused unless --eval-overlap-ok."""
    path = cfg.data
    if cfg.data == "synthetic":
        t = time.time()
        n = cfg.synthetic_samples + cfg.eval_prompts
        with heartbeat(log, f"generating synthetic data ({cfg.synthetic_samples} + {cfg.eval_prompts} held-out rows)"):
            made, reused = synthetic(target, folder=cache_root() / "synthetic", identity=provenance.identity(target),
                                     n=n, prompt_len=cfg.synthetic_prompt_len,
                                     new_tokens=cfg.synthetic_new_tokens, temperature=cfg.synthetic_temperature,
                                     seed=cfg.seed, min_new=cfg.block_size, should_stop=stop.is_set)
        path = str(made)
        log.info(f"synthetic data (for tests: random-token prompts continued by the target): {path} "
                 + ("(reused: the same target, seed and sizes made it before)" if reused else
                    f"(generated in {time.time() - t:.1f}s; kept for runs with the same target, seed and sizes)"))
    rows, skipped = _read_samples(path, cfg, target)
    samples, prompts, held_out = split_eval(rows, cfg.eval_prompts)
    shared = overlap(prompts, samples)
    if shared and not cfg.eval_overlap_ok:
        why = "" if held_out else f" (fewer than {2 * cfg.eval_prompts} usable rows: nothing could be held out)"
        raise UsageError(f"--data {cfg.data}: {shared} of {len(prompts)} eval prompts are also training rows' "
                         f"prompts{why}; add rows with other prompts, lower --eval-prompts, or pass "
                         "--eval-overlap-ok to measure tau on them anyway")
    log.info(f"data {cfg.data}: {len(samples)} rows for training"
             + (f", {skipped} skipped (no room for a block in the loss mask)" if skipped else "")
             + (f"; {shared} of {len(prompts)} eval prompts are training rows' prompts (--eval-overlap-ok)"
                if shared else f"; {len(prompts)} eval prompts held out" if prompts else ""))
    return samples, prompts, shared, rows[len(samples):] if held_out else []


def _read_samples(path: str, cfg, target):
    rows = encode_rows(read_rows(path), target.tokenizer, path, template_kwargs=chat_template_options(cfg),
                       train_thinking=cfg.train_thinking)
    vocab = target.model.get_input_embeddings().weight.shape[0]
    return check_samples(rows, path=path, block_size=cfg.block_size, seq_len=cfg.seq_len, vocab_size=vocab)
