"""Decode step costs at a model's shape, with random weights, and the speedup each tau would give there.

    python benchmarks/decode_shapes.py [--config configs/qwen3-8b.yaml] [--hidden N] [--layers N]
        [--heads N] [--kv-heads N] [--head-dim N] [--intermediate N] [--vocab N] [--draft-layers N]
        [--block-size N] [--dtype bfloat16] [--compile | --no-compile] [--prompt-len 128]
        [--new-tokens 256] [--taus 2.71,6.5,7.9,4.25] [--reps 100] [--json FILE] [--cpu-ok]
        [--wait-for FILE]

What carries over from the project's small target (100M parameters) to a user's model is tau, the
tokens a round yields, not the speedup: on a GPU the small target's step is launch-bound (its verify
of 16 tokens costs 1.2x its one-token step), a large model's is bound by reading its weights, so the
same tau buys another speedup there. A step's cost depends on the shapes, not the weights: this
builds the target (transformers' Qwen3ForCausalLM) and a drafter at the given shape with random
weights, replays each step of trainer/run/decode_graphs.py's GraphDecoder alone, times the prompt's
forward, and turns the costs into speedups with trainer/run/decode_model.py.

The target's shape is Qwen3-8B's (QWEN3_8B below) unless flags change it. A recipe (--config, e.g.
configs/qwen3-8b.yaml) names its target by path, not by shape, so it gives only the drafter's recipe:
draft_layers, block_size, target_layers. On a GPU each step is captured as a CUDA graph (compiled by
inductor first with --compile, the default there); on a CPU nothing is captured or compiled: the same
functions run eagerly, which is what the tests run at toy shapes.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.errors import EXIT_FAILED, EXIT_USAGE, UsageError  # noqa: E402 (torch-free)

# Qwen3-8B's config.json: the shape measured when no flag changes it.
QWEN3_8B: dict = dict(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=151936,
                rope_theta=1e6, rms_eps=1e-6)
SHAPE_FLAGS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab")
DRAFT_LAYERS, BLOCK_SIZE, TAPS = 5, 16, 5   # the DFlash recipe (configs/qwen3-8b.yaml)
# 2.71: the small target's lossless tau, both decodes compiled (docs/decoding.md); 6.5 GSM8K, 7.9
# MATH-500, 4.25 MT-Bench: the DFlash paper's Qwen3-8B drafter at block 16.
TAUS = "2.71,6.5,7.9,4.25"
SPEEDUPS = (2.0, 3.0)
CPU_LIMIT_GB = 2.0      # weights a CPU run builds without --cpu-ok
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float
    rms_eps: float

    def layer_params(self) -> int:
        """One Qwen3 decoder layer: q/k/v/o, the gated MLP, two norms and q/k norms."""
        H, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return H * q + 2 * H * kv + q * H + 3 * H * self.intermediate + 2 * H + 2 * self.head_dim

    def params(self, draft_layers: int, taps: int) -> tuple[int, int]:
        """(the target's parameters, the drafter's own): the drafter borrows the embedding and lm_head."""
        target = 2 * self.vocab * self.hidden + self.layers * self.layer_params() + self.hidden
        drafter = taps * self.hidden * self.hidden + draft_layers * self.layer_params() + 2 * self.hidden
        return target, drafter


def parser() -> argparse.ArgumentParser:
    from trainer.run.flags import OneLineParser  # torch-free: bad flags are one line, exit 2

    p = OneLineParser(prog="python benchmarks/decode_shapes.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", metavar="FILE", help="a trainer recipe (YAML): its draft_layers, block_size, "
                   "target_layers; the target's shape stays Qwen3-8B's unless the flags below change it")
    for name in SHAPE_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=int, metavar="N",
                       help=f"the target's {name.replace('_', ' ')} (Qwen3-8B: {QWEN3_8B[name]})")
    p.add_argument("--draft-layers", type=int, metavar="N", help=f"default: the recipe's, else {DRAFT_LAYERS}")
    p.add_argument("--block-size", type=int, metavar="N", help=f"default: the recipe's, else {BLOCK_SIZE}")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile each captured step with inductor first (default: on where CUDA is)")
    p.add_argument("--prompt-len", type=int, default=128, metavar="N",
                   help="the prompt's forward is timed at this length")
    p.add_argument("--new-tokens", type=int, default=256, metavar="N",
                   help="outputs of this length, the prompt's forward included, beside long outputs")
    p.add_argument("--taus", default=TAUS, metavar="T,T,...", help=f"taus to turn into speedups (default {TAUS})")
    p.add_argument("--reps", type=int, default=100, metavar="N", help="timed calls of each part, in 5 batches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the document here (atomically)")
    p.add_argument("--wait-for", metavar="FILE",
                   help="compile and capture, then wait until FILE exists before timing: the minutes of "
                        "compiling may overlap other work on the GPU, the timing must not")
    p.add_argument("--cpu-ok", action="store_true",
                   help=f"build on a CPU even when the weights exceed {CPU_LIMIT_GB:g} GB (Qwen3-8B's: ~18 GB in bf16)")
    return p


def settle(a: argparse.Namespace) -> tuple[Shape, dict, list[float]]:
    """Flags and the recipe -> (the shape, the drafter's recipe, the taus); any problem a UsageError."""
    recipe: dict = {}
    if a.config:
        from trainer.run.flags import load_yaml  # torch-free; checks every key and type

        recipe = load_yaml(a.config)
    given: dict = {k: getattr(a, k) for k in SHAPE_FLAGS if getattr(a, k) is not None}
    shape = Shape(**{**QWEN3_8B, **given})
    for name in SHAPE_FLAGS:
        if getattr(shape, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(shape, name)}")
    if shape.heads % shape.kv_heads:
        raise UsageError(f"--heads {shape.heads} is not a multiple of --kv-heads {shape.kv_heads}")
    if shape.head_dim % 2:
        raise UsageError(f"--head-dim must be even (RoPE rotates pairs), got {shape.head_dim}")
    draft = {"layers": a.draft_layers if a.draft_layers is not None else recipe.get("draft_layers", DRAFT_LAYERS),
             "block_size": a.block_size if a.block_size is not None else recipe.get("block_size", BLOCK_SIZE),
             "config": a.config}
    if draft["layers"] < 1:
        raise UsageError(f"--draft-layers must be >= 1, got {draft['layers']}")
    if draft["block_size"] < 2:
        raise UsageError(f"--block-size must be >= 2, got {draft['block_size']}")
    for flag, v in (("--prompt-len", a.prompt_len), ("--new-tokens", a.new_tokens), ("--reps", a.reps)):
        if v < 1:
            raise UsageError(f"{flag} must be >= 1, got {v}")
    taus = []
    for word in a.taus.split(","):
        try:
            t = float(word)
        except ValueError:
            raise UsageError(f"--taus: '{word.strip()}' is not a number (a comma-separated list, "
                             f"e.g. {TAUS})") from None
        if not math.isfinite(t) or not 1 <= t <= draft["block_size"]:
            raise UsageError(f"--taus: {word.strip()} is not a tau of block {draft['block_size']} "
                             f"(a round yields 1 to {draft['block_size']} tokens)")
        taus.append(t)
    draft["layer_ids"] = tap_ids(recipe.get("target_layers", ""), shape.layers, a.config)
    return shape, draft, taus


def tap_ids(spec: str, layers: int, config: str | None) -> tuple[int, ...]:
    """The recipe's target_layers, else the trainer's default choice (fewer than 5 in a shallow target)."""
    if not spec:
        from trainer.run.target import default_layer_ids  # imports torch: after every flag is checked

        return default_layer_ids(layers, TAPS)
    try:
        ids = tuple(int(x) for x in str(spec).split(","))
    except ValueError:
        raise UsageError(f"{config}: target_layers '{spec}': not comma-separated integers") from None
    bad = [i for i in ids if not 0 <= i < layers]
    if bad:
        raise UsageError(f"{config}: target_layers {spec}: layer {bad[0]} is not one of the target's {layers} "
                         f"(0-{layers - 1})")
    return ids


def note(msg: str) -> None:
    print(f"decode_shapes: {msg}", file=sys.stderr, flush=True)


def build(shape: Shape, draft: dict, dev, dtype, seed: int):
    """The target (a Target around a random Qwen3ForCausalLM, as trainer/run/target.py wraps a loaded
    one) and a random drafter borrowing its embedding and lm_head, both built on the device in dtype."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.model.drafter import Drafter
    from trainer.run.target import Target, _quiet_transformers

    _quiet_transformers()
    cfg = Qwen3Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, rope_theta=shape.rope_theta,
                      rms_norm_eps=shape.rms_eps, max_position_embeddings=40960, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no EOS: random weights never stop
    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in dtype on the device: an 8B model never exists in float32
    try:
        with torch.device(dev):
            model = Qwen3ForCausalLM(cfg).eval()
            for prm in model.parameters():
                prm.requires_grad_(False)
            target = Target(model, None, draft["layer_ids"], "random", "random")
            d = Drafter(target.drafter_config(num_layers=draft["layers"], block_size=draft["block_size"],
                                              mask_token_id=None))
    finally:
        torch.set_default_dtype(before)
    d.init_norm(target.head_weights()[1])
    d.borrow_target_head(*target.head_weights())  # as specdec.load_drafter does
    d = d.to(dev, dtype).eval()
    for prm in d.parameters():
        prm.requires_grad_(False)
    return target, d


def table(c, taus: list[float], new_tokens: int) -> dict:
    """What the costs predict (decode_model): the tau each speedup needs, the speedup at each tau."""
    from trainer.run.decode_model import speedup_at, tau_for

    return {"tau_for": [{"speedup": x, "long": tau_for(c, x), "at_new_tokens": tau_for(c, x, new_tokens)}
                        for x in SPEEDUPS],
            "speedup_at": [{"tau": t, "long": speedup_at(c, t), "at_new_tokens": speedup_at(c, t, new_tokens)}
                           for t in taus]}


def render(doc: dict) -> str:
    s, d, ms, n = doc["shape"], doc["drafter"], doc["costs_ms"], doc["new_tokens"]
    how = "CUDA graphs" if doc["graphed"] else "eager (nothing captured)"
    lines = [
        f"{s['name']}: hidden {s['hidden']}, {s['layers']} layers, {s['heads']}/{s['kv_heads']} heads of "
        f"{s['head_dim']}, intermediate {s['intermediate']}, vocab {s['vocab']}; drafter {d['layers']} layers, "
        f"block {d['block_size']}, taps {','.join(map(str, d['layer_ids']))}",
        f"{doc['device']}, {doc['dtype']}, {how}{', compiled' if doc['compile'] else ''}; "
        f"static caches of {doc['max_len']} positions",
        "",
        "ms     step    verify  draft   extend  host    round   prefill alone / with features "
        f"({doc['prompt_len']} tokens)",
        "       " + "".join(f"{ms[k]:<8.3f}" for k in ("step", "verify", "draft", "extend", "host", "round"))
        + f"{ms['prefill_alone']:.3f} / {ms['prefill_spec']:.3f}",
        f"verify / step: {doc['verify_over_step']:.2f} (near 1 where a step is bound by reading the weights)",
        "",
        f"tau needed   long outputs          {n} new tokens (with the prompt's forward)",
    ]
    B = d["block_size"]

    def fmt(v):  # a round yields at most a block: a tau past it is out of reach too
        return "unreachable" if v is None else f"{v:.2f}" + (f" (> block {B})" if v > B else "")
    for row in doc["table"]["tau_for"]:
        lines.append(f"  {row['speedup']:g}x{'':<9}{fmt(row['long']):<22}{fmt(row['at_new_tokens'])}")
    lines += ["", f"tau          speedup, long         at {n} new tokens"]
    for row in doc["table"]["speedup_at"]:
        lines.append(f"  {row['tau']:<11g}{row['long']:<22.2f}{row['at_new_tokens']:.2f}")
    return "\n".join(lines)


def wait_for(path: Path, every: float = 60.0) -> None:
    """Sleep until path exists, saying so once a minute."""
    import time

    start = said = time.monotonic()
    if not path.exists():
        note(f"built; waiting for {path} before timing")
    while not path.exists():
        time.sleep(1.0)
        if time.monotonic() - said >= every:
            said = time.monotonic()
            note(f"waiting for {path} before timing ({said - start:.0f} s)")
    note(f"{path} is there: timing")


def measure(a: argparse.Namespace, shape: Shape, draft: dict, taus: list[float]) -> dict:
    gb = sum(shape.params(draft["layers"], len(draft["layer_ids"]))) * DTYPE_BYTES[a.dtype] / 1e9
    import torch

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda:0" if cuda else "cpu")
    if not cuda and gb > CPU_LIMIT_GB and not a.cpu_ok:
        raise UsageError(f"no GPU here, and the target and drafter at this shape hold ~{gb:.1f} GB of weights: "
                         "run it on a GPU, pass a smaller shape (--hidden, --layers, --vocab, ...) or --cpu-ok")
    if cuda:
        free = torch.cuda.mem_get_info(dev)[0] / 1e9
        if gb > free:
            raise UsageError(f"the target and drafter at this shape hold ~{gb:.1f} GB of weights; "
                             f"{torch.cuda.get_device_name(dev)} has {free:.1f} GB free")
    if a.json:
        try:  # before minutes of measuring, not after
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--json {a.json}: {e.strerror or e}") from None
    if a.compile and not cuda:
        note("--compile: nothing is compiled on a CPU (nothing is captured there either)")
    compiled = bool(a.compile if a.compile is not None else cuda) and cuda
    dtype = getattr(torch, a.dtype)
    layer_ids = draft["layer_ids"]
    if len(layer_ids) < TAPS:
        note(f"a target of {shape.layers} layers: the drafter taps {len(layer_ids)} of them "
             f"({','.join(map(str, layer_ids))}), not {TAPS}")

    from trainer.run.decode_graphs import GraphDecoder

    note(f"building the target and the drafter with random weights (~{gb:.3g} GB in {a.dtype}) on {dev}")
    target, drafter = build(shape, draft, dev, dtype, a.seed)
    max_len = a.prompt_len + a.new_tokens
    note("compiling and capturing each step (minutes at 8B)" if compiled else
         "capturing each step as a CUDA graph" if cuda else "no GPU: nothing captured, the steps run eagerly")
    with torch.no_grad():
        dec = GraphDecoder(target, drafter, max_len, compile=compiled)
        if a.wait_for:
            wait_for(Path(a.wait_for))
        note("measuring in turn the one-token step, draft, verify, extend, the round and the prompt's forward "
             "(GraphDecoder.step_costs: a warm-up, then 5 batches each)")
        c = dec.step_costs(a.prompt_len, reps=a.reps)
    return {
        "shape": {"name": "Qwen3-8B" if all(getattr(shape, k) == v for k, v in QWEN3_8B.items()) else "custom",
                  **asdict(shape), "qk_norm": True},
        "drafter": {**draft, "layer_ids": list(layer_ids)},
        "weights_gb": gb,
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "dtype": a.dtype, "compile": compiled, "graphed": bool(getattr(dec, "graphed", False)),
        "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "max_len": max_len, "reps": a.reps,
        "torch": torch.__version__,
        "costs_ms": c.as_ms(),
        "verify_over_step": c.verify / c.step,
        "table": table(c, taus, a.new_tokens),
    }


def main(argv: list[str] | None = None) -> int:
    try:
        a = parser().parse_args(argv)
        shape, draft, taus = settle(a)
        doc = measure(a, shape, draft, taus)
        print(render(doc), flush=True)
        if a.json:
            from trainer.files import atomic_file

            try:
                with atomic_file(a.json) as f:
                    json.dump(doc, f, indent=1)
                    f.write("\n")
            except OSError as e:
                raise UsageError(f"--json {a.json}: {e.strerror or e}") from None
            note(f"wrote {a.json}")
        return 0
    except UsageError as e:
        print(f"decode_shapes: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("decode_shapes: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # noqa: BLE001 - only the GPU's memory running out is expected
        if type(e).__name__ != "OutOfMemoryError":
            raise
        print(f"decode_shapes: error: out of GPU memory at this shape ({str(e).splitlines()[0][:160]})",
              file=sys.stderr, flush=True)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
