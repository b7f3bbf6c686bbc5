"""A run's settings: one frozen dataclass (TrainConfig, each field a flag and a YAML key, its help beside
it) and its rules (validate: impossible values and combinations are UsageErrors, exit 2, one line that
names the flag; a field with choices is checked against them by one rule). flags.py fills it from
defaults < YAML `--config FILE` < flags. No torch here: `--help` and every config error stay fast.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TypeVar

from trainer.errors import UsageError
from trainer.model.objective import OBJECTIVES, POSITION_WEIGHTS, Objective  # torch-free
from trainer.policies import POLICY_NAMES, known as known_policies  # torch-free at import
from trainer.run import trackers  # torch-free at import


# The run's resolved settings (flags + YAML) in OUT, for --resume checks and `python -m trainer.eval`.
# Not config.json/config.yaml: `launch` puts the user's own config file in the same folder.
RUN_CONFIG = "trainer-config.json"
# the compile policy the run resolved and runs ({"compile_policy", "asked", "why"}), beside RUN_CONFIG in
# --out; the runs agent reads it for `dflash-ops status` (orchestrator/remote/runs/records.py)
CHOSEN_POLICY = "compile-policy.json"
# --precision: the default path, or the drafter's matmuls in fp8 (trainer/model/fp8.py RECIPES)
PRECISIONS = ("bf16", "fp8", "fp8-rowwise", "fp8-lmhead")
# --optimizer: torch's AdamW over every trainable parameter (the recipe), or Muon over the drafter's
# matrices and AdamW over the rest (trainer/engine/muon.py)
OPTIMIZERS = ("adamw", "muon")
EMULATE_ALONE = f"--fp8-emulate goes with --precision {'|'.join(PRECISIONS[1:])}"  # the trainer's and the probe's
# the values of the switches and of --topology (their fields' choices: validate checks them, add_trainer_options
# makes them the parser's choices)
ON_OFF = ("on", "off")
AUTO_ON_OFF = ("auto", "on", "off")
TOPOLOGIES = ("threads", "processes")

_V = TypeVar("_V")


def opt(default: _V, help: str, *, metavar: str | None = None, choices: tuple[str, ...] | None = None) -> _V:
    """A TrainConfig field: its default and, beside it, its flag's help (and metavar, when not N, X or S
    by its type; choices: the values validate allows, and the parsers of add_trainer_options offer), which
    flags.build_parser reads."""
    return dataclasses.field(default=default, metadata={"help": help, "metavar": metavar, "choices": choices})


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of a run. Each field is a flag (`--name-with-dashes`) and a YAML key, and carries its
    flag's help (opt(default, help, ...)): `python -m trainer --help` and the benchmarks' options are
    read from here (build_parser, add_trainer_options)."""

    # what to train on
    target: str = opt("tiny", "frozen target: a local Hugging Face model folder, small-code[-gpu] (a code LM built "
                      "here once), or tiny[:SEED]", metavar="PATH|small-code|tiny")
    data: str = opt("synthetic", "JSONL (input_ids+loss_mask, or chat messages: python -m trainer.regen writes rows "
                    "answered by the target), or synthetic, for tests only (random-token prompts the target continues, "
                    "no chat template); the last --eval-prompts rows are held out for the eval",
                    metavar="PATH|synthetic")
    target_layers: str = opt("", "comma-separated target layer ids to condition on (default: 5 evenly spaced in "
                             "1..L-3)", metavar="I,J,..")
    # run
    steps: int = opt(10000, "optimizer steps in total")      # the recipe's max_steps (docs/recipe.md)
    epochs: float = opt(0.0, "passes over the training rows instead of --steps: the steps become ceil(epochs x rows / "
                             "--batch-size) once the rows are read, said in one line (0 = --steps)", metavar="X")
    seed: int = opt(0, "seed for the drafter init, data order and anchors")
    out: str = opt("out", "output folder: checkpoints, metrics.jsonl", metavar="DIR")
    resume: bool = opt(False, "continue from the last complete checkpoint in --out")
    # devices and workers
    gpus: int = opt(0, "GPUs to use (0 = CPU)")
    workers: int = opt(1, "with --gpus 0: CPU workers (threads, or processes under --topology processes); with --gpus "
                       "N and --topology threads: a multiple of N worker threads sharing the GPUs")
    topology: str = opt("threads", "threads (one worker thread per device) or processes (one process per device: "
                        "torchrun + DDP)", metavar="threads|processes", choices=TOPOLOGIES)
    warmup_timeout: float = opt(900.0, "seconds each worker may take to build, compile and run its first step (one "
                                "worker at a time); past it the run fails naming the worker")
    checksum_every: int = opt(50, "compare the replicas' weights (bit for bit) every N steps and at the end; 0 = only "
                              "at the end")
    compile_policy: str = opt("eager", f"{' | '.join(POLICY_NAMES)} | auto (the probe's choice from "
                              "WORKDIR/probe.json)", metavar="NAME|auto")
    workdir: str = opt("", "the dflash-ops WORKDIR holding probe.json (default: $DFLASH_OPS_WORKDIR)", metavar="DIR")
    cpu_threads: int = opt(0, "torch intra-op threads on CPU (0 = auto: 1 for one CPU worker, cores / K for K workers)")
    skip_compile_guard: bool = opt(False, "skip the guard that checks each worker's first compiled step against an "
                                   "eager forward/backward on the same weights and batch (on by default for every "
                                   "policy but eager)")
    compile_target: str = opt("auto", "auto | on | off: run the frozen target's decoder layers compiled by inductor "
                              "(no CUDA graphs); auto = on a GPU whenever --compile-policy is not eager",
                              metavar="auto|on|off", choices=AUTO_ON_OFF)
    compile_update: str = opt("auto", "auto | on | off: run the gradient clip and the AdamW update as one function "
                              "compiled by inductor (same math and optimizer state as torch's AdamW); auto = on a GPU "
                              "whenever --compile-policy is not eager", metavar="auto|on|off", choices=AUTO_ON_OFF)
    graph_target: str = opt("off", "on | off: with the target compiled and several worker threads each on its own GPU, "
                            "replay the target's forward as a CUDA graph (the workers share one Python interpreter; a "
                            "graph spares each the launches of the target's layers). Same features bit for bit; off by "
                            "default: with the look-ahead (the next step's target forward during the gradient sum) it "
                            "measured no faster on two H200s (docs/decisions.md)", metavar="on|off", choices=ON_OFF)
    # how the drafter's step runs on a GPU (trainer/model/choices.py, model/fp8.py; the defaults are the measured best)
    fp32_wgrad: str = opt("on", "on | off: under CUDA bf16 autocast, the drafter's weight gradients leave cuBLAS in "
                          "fp32 (one pass less, no bf16 rounding); off = autocast's bf16 gradients",
                          metavar="on|off", choices=ON_OFF)
    flex_tiles: str = opt("", "FlexAttention's tiles, for an A/B: BWD[/FWD][+kv], BWD = default or "
                          "M1-N1-M2-N2-STAGES-WARPS, FWD = M-N-STAGES-WARPS, +kv = K/V expanded to the query heads; "
                          "empty = the tuned choice on Hopper, else torch's", metavar="TILES")
    ce_rows: int = opt(0, "rows per chunk of the fused cross-entropy, for an A/B; 0 = the most whose fp32 logits fit "
                       "in 1 GiB", metavar="N")
    ce_kernel: str = opt("on", "on | off: the cross-entropy core as one Triton kernel on a GPU (off = the torch core)",
                         metavar="on|off", choices=ON_OFF)
    precision: str = opt("bf16", "bf16 | fp8 | fp8-rowwise | fp8-lmhead: the drafter's Linear layers train with "
                         "torchao's float8 matmuls, tensorwise or rowwise scaled (opt-in: docs/precision.md); "
                         "fp8-lmhead: fp8, and the lm_head's matmuls in the loss too (the fastest at the 8B shape); "
                         "fp32 master weights and optimizer, target and loss unchanged; bf16 = the default path",
                         metavar="|".join(PRECISIONS), choices=PRECISIONS)
    fp8_emulate: bool = opt(False, "with --precision fp8*: the same fp8 rounding without FP8 hardware (slow; the CPU, "
                            "tests)")
    # several nodes (--topology processes): one DDP job joined by torchrun's c10d rendezvous
    nnodes: int = opt(1, "nodes in one --topology processes job (torchrun --nnodes); each node runs the same command "
                      "with its own --node-address, one with --rdzv-host")
    rdzv_endpoint: str = opt("", "HOST:PORT of the c10d rendezvous the nodes join (with --nnodes > 1)",
                             metavar="HOST:PORT")
    rdzv_id: str = opt("", "the job's rendezvous id, the same on every node (with --nnodes > 1)", metavar="ID")
    rdzv_host: bool = opt(False, "this node hosts the rendezvous store at --rdzv-endpoint (exactly one node)")
    node_address: str = opt("", "this node's address on the training network, which the other nodes reach (torchrun "
                            "--local-addr; with --nnodes > 1)", metavar="ADDR")
    # drafter and objective
    draft_layers: int = opt(5, "drafter layers")
    block_size: int = opt(16, "tokens per block: the anchor plus block_size-1 predicted tokens")
    anchors: int = opt(0, "anchors (blocks) per sequence per step, at most; 0 = auto: the recipe's 512 on a GPU, 16 on "
                          "the CPU (trainer/demo.yaml's), said in one line at start; the trainer uses fewer, and says "
                          "so, when rows are too short for them or the GPU's free memory is (docs/recipe.md)")
    # gamma 0: 7 for a block of 16, 5 for 10, 4 for 8; the objective's fields are read by trainer/model/objective.py
    gamma: float = opt(0.0, "loss decay w_k = exp(-(k-1)/gamma) (--position-weights exp); 0 = from the block size")
    position_weights: str = opt("exp", "how much each block position's loss counts: exp (the recipe's fixed decay, "
                                "--gamma) or dpace (D-PACE, as vLLM's speculators trains DFlash: each position "
                                "weighted, every step, by the drafter's own confidence in its block, the expected "
                                "accepted length it is worth; needs --objective ce); dpace is not yet measured on a "
                                "GPU (docs/recipe.md)", metavar="|".join(POSITION_WEIGHTS), choices=POSITION_WEIGHTS)
    dpace_alpha: float = opt(0.5, "D-PACE's confidence smoothing alpha, in (0, 1]: s = (1 - alpha) exp(-CE) + alpha",
                             metavar="X")
    objective: str = opt("ce", "what the drafter learns at each block position: ce (cross-entropy against the data's "
                         "token, the recipe's), kd (distillation: the KL from the target's own distribution there, at "
                         "--kd-temperature; the target then runs all its layers) or ce+kd (their mix, --kd-mix); kd is "
                         "not yet measured on a GPU (docs/recipe.md)", metavar="|".join(OBJECTIVES), choices=OBJECTIVES)
    kd_temperature: float = opt(1.0, "temperature T of the distillation (kd, ce+kd): T^2 * KL(softmax(target/T) || "
                                "softmax(drafter/T)); > 0", metavar="T")
    kd_mix: float = opt(0.5, "KD's share of --objective ce+kd, in [0, 1]: (1 - mix) * CE + mix * KD", metavar="X")
    mask_token_id: int = opt(-1, "token id of MASK (-1 = tokenizer's mask token, else the first unused embedding row)")
    freeze_draft_norm: bool = opt(False, "use the target's final norm, frozen, instead of training the drafter's own "
                                  "(initialised from the target's)")
    # chat data
    chat_template_kwargs: str = opt('{"enable_thinking": false}', "JSON object of template options for chat rows and "
                                    "their eval prompts, passed to apply_chat_template (a mapping in YAML)",
                                    metavar="JSON")
    train_thinking: bool = opt(False, "also train on the <think>...</think> block the chat template injects into "
                               "assistant turns (default: loss mask 0 there)")
    # optimisation (--optimizer muon: trainer/engine/muon.py)
    batch_size: int = opt(8, "sequences per step across all workers")
    seq_len: int = opt(3072, "maximum sequence length (longer rows are truncated)")
    lr: float = opt(6e-4, "peak learning rate (AdamW)")
    min_lr: float = opt(0.0, "learning rate at the end of the cosine")
    warmup: float = opt(0.04, "linear warmup as a fraction of --steps")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.999, "AdamW beta2 (the recipe's 0.999; short, high-lr runs adapt faster with 0.95)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "max global gradient norm")
    optimizer: str = opt("adamw", "adamw (torch's AdamW over every trainable parameter, the recipe) or muon (Muon, as "
                         "vLLM's speculators trains DFlash: momentum orthogonalised by 5 Newton-Schulz steps for the "
                         "drafter's weight matrices, at AdamW's update RMS; AdamW, --lr, for its norms); fp32 weights "
                         "and state either way; muon is not yet measured on a GPU (docs/recipe.md); a --resume keeps "
                         "the optimizer", metavar="|".join(OPTIMIZERS), choices=OPTIMIZERS)
    muon_lr: float = opt(0.0, "Muon's peak learning rate, scaled by the same warm-up and cosine as --lr (0 = --lr: "
                         "with Muon's AdamW-matched update size, AdamW's lr carries over)")
    muon_momentum: float = opt(0.95, "Muon's momentum (Nesterov), in [0, 1)")
    muon_weight_decay: float = opt(0.1, "Muon's decoupled weight decay (per step: weights x (1 - lr x decay))")
    # synthetic data
    synthetic_samples: int = opt(512, "rows of synthetic data to train on (--data synthetic, for tests only)")
    synthetic_prompt_len: int = opt(16, "random prompt length for synthetic data")
    synthetic_new_tokens: int = opt(240, "tokens the target continues each synthetic prompt by")
    synthetic_temperature: float = opt(0.0, "sampling temperature for synthetic continuations (0 = greedy)")
    # logging, checkpoints, eval
    log_every: int = opt(1, "print a metrics line every N steps")
    checkpoint_every: int = opt(100, "checkpoint every N steps (0 = at the end and on SIGTERM only)")
    keep_checkpoints: int = opt(2, "complete checkpoints kept (at least 2: the previous one survives a crash "
                                "mid-write)")
    eval_prompts: int = opt(8, "prompts of the last N rows, held out from training, for the acceptance-length eval "
                            "(0 = no eval; --data synthetic makes N rows more)")
    eval_new_tokens: int = opt(64, "tokens generated per eval prompt")
    eval_every: int = opt(-1, "measure acceptance length every N steps (-1 = auto: about 10 evals a run, every steps / "
                              "10; 0 = at the end only)")
    report_to: str = opt("auto", "where the metrics also go (metrics.jsonl always has them): tensorboard (event files "
                         "in OUT/tensorboard), wandb, both (tensorboard,wandb), none; auto: tensorboard when the "
                         "tensorboard package is installed", metavar="auto|none|tensorboard,wandb")
    eval_at_start: bool = opt(True, "also measure the untrained drafter's acceptance length before training, the "
                                    "baseline `dflash-ops report` shows (--no-eval-at-start: not)")
    eval_overlap_ok: bool = opt(False, "run even when eval prompts are also training rows' prompts (too few rows to "
                                "hold any out, or repeated prompts); without it the run refuses, as tau would not be "
                                "measured on held-out prompts")
    target_changed_ok: bool = opt(False, "with --resume: continue even when the target at --target is not the one the "
                                  "checkpoint was trained against (same shape, another model); without it the resume "
                                  "refuses")

    @property
    def n_devices(self) -> int:
        """Workers (replicas): one per GPU, or --workers of them (on the CPU, or sharing the GPUs)."""
        return max(self.gpus, self.workers)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def validate(c: TrainConfig, here: bool = True) -> None:
    """Every rule of a TrainConfig; here=False leaves out what needs the target's files or torch."""
    def need(cond: bool, msg: str):
        if not cond:
            raise UsageError(msg)

    for f in fields(c):     # every field with choices (opt(..., choices=)): one rule, one message
        value, allowed = getattr(c, f.name), f.metadata["choices"]
        need(not allowed or value in allowed,
             f"--{f.name.replace('_', '-')} {value!r}: expected one of {', '.join(allowed or ())}")
    need(c.steps >= 0, f"--steps must be >= 0, got {c.steps}")
    need(c.gpus >= 0, f"--gpus must be >= 0, got {c.gpus}")
    need(c.workers >= 1, f"--workers must be >= 1, got {c.workers}")
    need(c.gpus == 0 or c.workers == 1 or c.workers % c.gpus == 0,
         f"--workers {c.workers} with --gpus {c.gpus}: the trainer runs one worker per GPU (drop --workers), "
         f"or with --topology threads a multiple of {c.gpus} workers sharing the GPUs")
    need(c.topology == "threads" or c.gpus == 0 or c.workers in (1, c.gpus),
         f"--topology processes runs one process per GPU: drop --workers {c.workers} (or use --topology threads)")
    need(c.compile_policy in known_policies() + ("auto",),
         f"--compile-policy {c.compile_policy!r}: expected one of {', '.join(POLICY_NAMES)}, auto")
    trackers.parse(c.report_to)      # its own UsageError, naming the flag
    need(not c.fp8_emulate or c.precision != "bf16", EMULATE_ALONE)
    need(c.precision == "bf16" or c.gpus > 0 or c.fp8_emulate,
         f"--precision {c.precision} needs GPUs with FP8 matmuls (sm89+); --fp8-emulate runs its arithmetic "
         "on the CPU (slowly, for tests)")
    need(c.ce_rows >= 0,
         f"--ce-rows: expected a positive number of rows, e.g. 2048 (0 = sized to 1 GiB), got {c.ce_rows}")
    need(c.block_size >= 2, f"--block-size must be >= 2, got {c.block_size}")
    need(c.seq_len >= c.block_size, f"--seq-len {c.seq_len} is shorter than one block (--block-size {c.block_size})")
    need(c.anchors >= 0, f"--anchors must be >= 1 (or 0: auto), got {c.anchors}")
    need(c.draft_layers >= 1, f"--draft-layers must be >= 1, got {c.draft_layers}")
    need(c.batch_size >= 1, f"--batch-size must be >= 1, got {c.batch_size}")
    need(0 <= c.epochs < 1e6, f"--epochs must be >= 0 (0 = use --steps), got {c.epochs}")
    need(c.nnodes >= 1, f"--nnodes must be >= 1, got {c.nnodes}")
    if c.nnodes > 1:
        need(c.topology == "processes", f"--nnodes {c.nnodes} needs --topology processes (one DDP job over the nodes)")
        host, _, port = c.rdzv_endpoint.rpartition(":")
        need(bool(host) and port.isdigit() and 0 < int(port) < 65536,
             f"--rdzv-endpoint {c.rdzv_endpoint!r}: expected HOST:PORT, the hosting node's training address")
        need(bool(c.rdzv_id) and bool(c.node_address), "--nnodes > 1 needs --rdzv-id and --node-address")
    world = c.n_devices * c.nnodes
    need(c.batch_size % world == 0,
         f"--batch-size {c.batch_size} does not split over {world} workers; use a multiple of {world}")
    need(c.gamma >= 0, f"--gamma must be >= 0, got {c.gamma}")
    try:
        objective_of(c)
    except ValueError as e:
        raise UsageError(str(e)) from None
    need(c.gamma == 0 or c.position_weights != "dpace",
         f"--gamma {c.gamma:g} sets the fixed decay of --position-weights exp; dpace has none (drop --gamma)")
    need(c.lr > 0 and 0 <= c.min_lr <= c.lr, f"need 0 <= --min-lr <= --lr and --lr > 0 (got {c.min_lr}, {c.lr})")
    need(0 <= c.warmup < 1, f"--warmup is a fraction of --steps in [0, 1), got {c.warmup}")
    need(c.grad_clip > 0, f"--grad-clip must be > 0, got {c.grad_clip}")
    need(c.muon_lr >= 0, f"--muon-lr must be >= 0 (0 = --lr), got {c.muon_lr}")
    need(0 <= c.muon_momentum < 1, f"--muon-momentum must be in [0, 1), got {c.muon_momentum}")
    need(c.muon_weight_decay >= 0, f"--muon-weight-decay must be >= 0, got {c.muon_weight_decay}")
    need(c.optimizer != "muon" or c.compile_update != "on",
         "--compile-update on compiles the AdamW update; --optimizer muon steps its own, uncompiled "
         "(use --compile-update auto or off)")
    need(0 <= c.adam_beta1 < 1 and 0 <= c.adam_beta2 < 1,
         f"--adam-beta1 and --adam-beta2 must be in [0, 1), got {c.adam_beta1}, {c.adam_beta2}")
    need(c.keep_checkpoints >= 2,
         f"--keep-checkpoints must be >= 2 (the previous checkpoint must survive), got {c.keep_checkpoints}")
    need(c.log_every >= 1 and c.checkpoint_every >= 0 and c.eval_every >= -1,
         "--log-every must be >= 1; --checkpoint-every >= 0 and --eval-every >= 0 (or -1: auto)")
    need(c.eval_prompts >= 0 and c.eval_new_tokens >= 1, "--eval-prompts must be >= 0 and --eval-new-tokens >= 1")
    need(c.synthetic_samples >= 1 and c.synthetic_prompt_len >= 1 and c.synthetic_new_tokens >= c.block_size,
         f"--synthetic-new-tokens must be >= --block-size ({c.block_size}); samples and prompt length >= 1")
    need(c.synthetic_temperature >= 0, f"--synthetic-temperature must be >= 0, got {c.synthetic_temperature}")
    need(c.cpu_threads >= 0, f"--cpu-threads must be >= 0, got {c.cpu_threads}")
    need(c.warmup_timeout > 0, f"--warmup-timeout must be > 0 seconds, got {c.warmup_timeout}")
    need(c.checksum_every >= 0, f"--checksum-every must be >= 0, got {c.checksum_every}")
    if c.target_layers:
        need(all(x.strip().isdigit() for x in c.target_layers.split(",")),
             f"--target-layers {c.target_layers!r}: expected comma-separated layer ids, e.g. 1,9,17,25,33")
    chat_template_options(c)
    if not here:
        return
    if c.flex_tiles:  # attention imports torch: only when the option is set
        from trainer.model.attention import parse_tiles

        try:
            parse_tiles(c.flex_tiles)
        except ValueError as e:
            raise UsageError(f"--flex-tiles: {e}") from None
    if c.data != "synthetic":
        need(Path(c.data).is_file(), f"--data {c.data}: no such file")
    check_target_spec(c.target)


# Built-in real targets (trainer/run/small_target.py): a code LM trained here on the standard library,
# built on first use and cached; the value is its recipe's size.
SMALL_TARGETS = {"small-code": "cpu", "small-code-gpu": "gpu", "small-code-smoke": "smoke"}


def check_target_spec(spec: str) -> None:
    """Cheap checks before anything heavy is imported: `tiny[:SEED]`, a built-in small target, or a
    folder with config.json."""
    if spec in SMALL_TARGETS:
        return
    if spec == "tiny" or spec.startswith("tiny:"):
        if spec != "tiny" and not spec[5:].isdigit():
            raise UsageError(f"--target {spec}: expected tiny or tiny:SEED (SEED an integer)")
        return
    p = Path(spec)
    if not p.exists():
        raise UsageError(f"--target {spec}: no such folder")
    if not p.is_dir() or not (p / "config.json").is_file():
        raise UsageError(f"--target {spec}: not a Hugging Face model folder (no config.json)")


def chat_template_options(c: TrainConfig) -> dict:
    """--chat-template-kwargs as a dict (a UsageError when it is not a JSON object)."""
    return template_kwargs(c.chat_template_kwargs)


def template_kwargs(text: str) -> dict:
    """A --chat-template-kwargs JSON text as a dict (a UsageError when it is not a JSON object)."""
    try:
        opts = json.loads(text) if text.strip() else {}
    except ValueError as e:
        raise UsageError(f"--chat-template-kwargs {text!r}: not JSON ({e})") from None
    if not isinstance(opts, dict):
        raise UsageError(f"--chat-template-kwargs {text!r}: expected a JSON object, "
                         'e.g. {"enable_thinking": false}')
    return opts


def objective_of(c: TrainConfig) -> Objective:
    """--objective, --kd-temperature, --kd-mix, --position-weights and --dpace-alpha as the loss takes
    them (a ValueError when one is bad)."""
    return Objective(c.objective, c.kd_temperature, c.kd_mix, c.position_weights, c.dpace_alpha)


def layer_ids(c: TrainConfig) -> tuple[int, ...] | None:
    return tuple(int(x) for x in c.target_layers.split(",")) if c.target_layers else None
