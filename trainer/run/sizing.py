"""How many of the recipe's anchors a step can use here: a pure rule, and the one line that says so.

The recipe's 512 anchors x block 16 over 3072 tokens (docs/recipe.md) is sized for an 80-141 GB GPU.
The rule, applied once at start (trainer/train/setup.prepare), never changes a run silently:

1. Anchors past what the rows can hold are padding (computed, with no loss): an anchor is a loss
   position with a whole block after it (masks.anchor_candidates), so no row holds more than
   `room` of them (at most pad_len - block + 1), and more are cut to that. Every anchor a row has
   is still drawn, so the loss and its gradients are the same as with the padding.
2. On a GPU, the activations of one worker's sequences must fit the device's free memory once the
   target, the drafter's weights and optimizer state and a reserve are placed; if not, anchors drop
   to the most that fit (a multiple of 8). Lowering anchors changes neither the data nor the model
   (seq_len would truncate rows, batch_size would change the optimisation), so it is the one knob
   turned. If even one anchor does not fit, the config is kept and the line says what to lower.
3. --anchors 0 (auto, the default) is the recipe's 512 on a GPU, then fitted as above; on the CPU it is
   CPU_ANCHORS (trainer/demo.yaml's), said in one line with what the recipe's would cost. Anchors asked
   for on the CPU are kept; a step costing more than CPU_SLOW_FLOPS says it will be slow, and a step
   that took more than SLOW_STEP_S says so once, with the flag that would make it cheaper (slow_line).
4. A resumed run keeps the anchors its start chose (its checkpoints record them, `resumed`), so a
   resume on a device with more or less free memory does not change the step it continues; only a
   changed --anchors is fitted anew.

The memory estimate is documented with its calibration in docs/recipe.md#memory.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

GIB = 2 ** 30
# Bytes one block token keeps for the backward per draft layer, per unit of (hidden + intermediate),
# measured: the trainer's whole step at the recipe's shape (Qwen3-8B, 5 draft layers, 3072 tokens,
# 512 anchors x 16) on one H200 peaked at 54.2 GB with 2 sequences and 76.5 GB with 4 under the eager
# policy (68.3 GB with 4 under inductor): 11.15 GB a sequence, ~16.2 bytes per (H + I) per block token
# and layer once the context's share is taken off (docs/recipe.md#memory). 17 leaves ~5% for the
# allocator.
ACT_BYTES = 17
RESERVE = 3 * GIB          # CUDA context, the fused cross-entropy's 1 GiB chunk of logits, workspaces
TRAINABLE_BYTES = 16       # per trainable parameter: fp32 weight, gradient and two AdamW moments
CPU_SLOW_FLOPS = 1e12      # a worker's step past this takes seconds to minutes on a CPU
ROUND = 8                  # anchors cut for memory are a multiple of this (when at least this many fit)
RECIPE_ANCHORS = 512       # --anchors 0 (auto) on a GPU: the recipe's (docs/recipe.md)
CPU_ANCHORS = 16           # --anchors 0 (auto) on the CPU: trainer/demo.yaml's, a step of about a second there
SLOW_STEP_S = 3.0          # a CPU step past this is said once, with the flag that makes it cheaper


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of the drafter (trainer/model/drafter.DrafterConfig) and the run."""
    hidden: int
    intermediate: int
    layers: int              # draft layers
    kv_dim: int              # num_kv_heads * head_dim
    feature_layers: int      # target layers the drafter is conditioned on
    trainable: int           # trainable parameters of the drafter
    block: int
    pad_len: int             # tokens per sequence in a batch: min(seq_len, the longest row)
    seqs: int                # sequences one worker computes per step
    room: int = 0            # the most anchors any row holds (0: not counted, pad_len - block + 1)


@dataclass(frozen=True)
class Device:
    kind: str                # "cuda" or "cpu"
    name: str                # for the line: "cuda:0", "cpu"
    free: int = 0            # bytes free now, with the target loaded (GPU only)
    workers: int = 1         # workers sharing this device, each with its own drafter


@dataclass(frozen=True)
class Fit:
    anchors: int             # the anchors to use
    line: str | None         # the one line to log at start, None when the config is used as is


def sequence_bytes(s: Shape, anchors: int) -> int:
    """Activation bytes of one sequence's step: the block tokens through every draft layer, and the
    context's target features, projection and keys/values."""
    blocks = anchors * s.block * s.layers * ACT_BYTES * (s.hidden + s.intermediate)
    context = s.pad_len * (2 * s.feature_layers * s.hidden + 4 * s.hidden + 4 * s.layers * s.kv_dim)
    return blocks + context


def fit_anchors(anchors: int, s: Shape, d: Device, step_flops: Callable[[int], float] = lambda n: 0.0) -> Fit:
    """The anchors to use for `anchors` asked, and why when they differ (rules in the module doc).
    step_flops(n): one worker's training FLOPs per step with n anchors (for the CPU's line)."""
    auto = anchors == 0
    anchors = auto_anchors(d.kind) if auto else anchors
    fits = max(1, s.pad_len - s.block + 1)
    room = min(fits, s.room) if s.room > 0 else fits
    why = []
    use = anchors
    if use > room:
        use = room
        why.append(f"the longest row ({s.pad_len} tokens) holds at most {room} blocks of {s.block}; more are padding"
                   if room == fits else
                   f"no row has more than {room} loss positions with a whole block of {s.block} after them "
                   f"(the anchors a row can take); every one is drawn, more are padding")
    if d.kind == "cuda":
        spare = d.free - RESERVE - d.workers * s.trainable * TRAINABLE_BYTES
        per_seq = spare / max(1, d.workers * s.seqs)
        per_anchor = sequence_bytes(s, 1) - sequence_bytes(s, 0)
        most = int((per_seq - sequence_bytes(s, 0)) // per_anchor) if per_seq > 0 else 0
        need = d.workers * s.seqs * sequence_bytes(s, use)
        if most < 1:
            return Fit(use, f"warning: {_gib(need)} of activations for {use} anchors x block {s.block} "
                                f"(x{s.seqs * d.workers} sequences) will not fit {d.name}: {_gib(max(0, spare))} "
                                f"free after the target, the drafter's weights and optimizer state; anchors kept "
                                f"at {use}: lower --batch-size or --seq-len, or use more GPUs "
                                f"(docs/recipe.md#memory)")
        if most < use:
            cut = most - most % ROUND if most >= ROUND else most
            why.append(f"{use} anchors x block {s.block} x {s.seqs * d.workers} sequences need ~{_gib(need)} "
                       f"of activations and {d.name} has ~{_gib(spare)} free after the target, the drafter's "
                       f"weights and optimizer state (docs/recipe.md#memory)")
            use = cut
    line = f"anchors {use} instead of {anchors}: {'; and '.join(why)}" if use != anchors else None
    if auto and d.kind == "cpu":
        recipe = step_flops(min(RECIPE_ANCHORS, room)) / max(step_flops(use), 1.0)    # what the rows would take
        sized = (f"anchors {use} (--anchors auto on the CPU: trainer/demo.yaml's; the recipe's {RECIPE_ANCHORS} are "
                 f"a GPU's" + (f", ~{recipe:.0f}x the work of a step here" if recipe > 1.5 else "")
                 + "; --anchors N asks for others)")
        return Fit(use, sized if line is None else f"{sized}; {line}")
    if d.kind == "cpu" and step_flops(use) > CPU_SLOW_FLOPS:
        slow = (f"on the CPU: {use} anchors x block {s.block} over {s.pad_len} tokens is a GPU recipe, "
                f"~{step_flops(use) / 1e12:.1f} TFLOP per worker step; kept as configured, expect slow steps "
                f"(trainer/demo.yaml is a CPU-sized run)")
        line = slow if line is None else f"{line}; {slow}"
    return Fit(use, line)


def auto_anchors(kind: str) -> int:
    """What --anchors 0 (auto) asks for on a device of this kind ("cuda", "cpu"), before fitting."""
    return CPU_ANCHORS if kind == "cpu" else RECIPE_ANCHORS


def slow_line(step_s: float, steps_left: int, anchors: int, batch: int, workers: int) -> str:
    """The one line of a CPU step that took step_s (past SLOW_STEP_S): what the run will take at that
    pace, and the flag that makes a step cheaper (fewer anchors, else a smaller batch, else more workers)."""
    if anchors > CPU_ANCHORS:
        cure = f"--anchors {CPU_ANCHORS} (now {anchors}) makes each step cheaper"
    elif batch > workers:
        cure = f"--batch-size {max(workers, batch // 2)} (now {batch}) halves each step's work"
    else:
        cure = "--workers (CPU threads, one sequence each) or --gpus spread it"
    return (f"slow steps: {step_s:.1f} s a step on the CPU, ~{_span(step_s * steps_left)} for the {steps_left} steps "
            f"left; {cure} (trainer/demo.yaml is a CPU-sized run)")


def _span(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 5400 else f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"


def record(asked: int, used: int) -> dict:
    """What a checkpoint records of the anchors (meta "anchors")."""
    return {"asked": asked, "used": used}


def resumed(recorded, asked: int, fit: Fit) -> Fit | None:
    """The anchors a resumed run uses: those its checkpoint recorded (`record`) when it asked for the
    same --anchors, with the line that says so (and what this device would take now, when less);
    None without a record (an older trainer wrote it) or when --anchors changed: fit anew."""
    if not isinstance(recorded, dict) or recorded.get("asked") != asked or not recorded.get("used"):
        return None
    used = int(recorded["used"])
    line = f"anchors {used}{f' instead of {asked}' if used != asked else ''}: as the run chose at its start " \
           f"(recorded in its checkpoint), so the resumed steps are the same steps"
    if fit.anchors < used:
        line += f"; the device's free memory would take {fit.anchors} now"
    return Fit(used, line)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"
