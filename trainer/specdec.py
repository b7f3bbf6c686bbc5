"""Decoding with the drafter, measured: speculative decoding at batch 1 against the target alone.

    python -m trainer.specdec --target T --drafter EXPORTED_DIR --prompts FILE [--max-new-tokens N]

Both sides keep KV caches: the target's is transformers' own cache (cropped to the accepted
prefix after each verification); the drafter's holds, per layer, the keys and values of the
context features it has seen (DraftCache), so a round computes only the new positions' K/V and
the block's 16 rows, not the whole context again. Greedy on both sides, so the output must be the
target's own greedy continuation token for token: every prompt is decoded both ways and compared,
and any difference fails the run (exit 1). The round structure is the reference's
(`dflash.model.dflash_generate`): verify min(B, budget) tokens, accept the longest matching prefix
plus the target's next token, stop at EOS.

Prints live lines per prompt and one JSON document: tokens/s of the target alone and with the
drafter (wall clock after warm-up, CUDA-synchronised), the speedup, tau (accepted + 1 per round)
with its 95% interval, the acceptance rate per block position, and where the time goes (target
verify, drafter, host).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from trainer import faults
from trainer.files import atomic_file
from trainer.model.drafter import Drafter, DrafterConfig
from trainer.run.decode_graphs import Decoded, GraphDecoder, prefill_bucket
from trainer.run.decode_model import RoundCosts, predict_prompt, tau_for
from trainer.run.decode_sample import agreement, one_token, split_figures
from trainer.run.acceptance import Timing, clock, speculative_generate, summarize
from trainer.run.log import tau_text
from trainer.writer_lock import output_lock


class NotLossless(RuntimeError):
    """Decoding with the drafter gave other tokens than the target alone."""


# --------------------------------------------------------------------------- the eager engine

@torch.no_grad()
def target_greedy(target, prompt: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], Timing]:
    """The target alone in eager code: one transformers-cached forward per token, greedy, stopping at EOS."""
    out, _, t = _eager_alone(target, prompt, max_new_tokens, eos)
    return out, t


def _eager_alone(target, prompt, max_new_tokens, eos):
    dev = target.device
    t = Timing()
    t0 = clock(dev)
    logits, _, cache = target.decode(torch.tensor([prompt], device=dev))
    margins = [_margin(logits)]
    tok = int(logits[0, -1].argmax())
    out = [tok]
    t.prefill = clock(dev) - t0
    while len(out) < max_new_tokens and tok not in eos:
        logits, _, cache = target.decode(torch.tensor([[tok]], device=dev), cache)
        margins.append(_margin(logits))
        tok = int(logits[0, -1].argmax())
        out.append(tok)
    t.total = t.verify = clock(dev) - t0
    return out, margins, t


def _margin(logits: torch.Tensor) -> float:
    top2 = logits[0, -1].float().topk(2).values
    return float(top2[0] - top2[1])


class EagerDecoder:
    """The eager engine behind GraphDecoder's two calls: transformers' own cache for the target,
    eval.py's DraftCache for the drafter, every step launched from Python."""

    graphed = False

    def __init__(self, target, drafter: Drafter):
        self.target, self.drafter, self.eos = target, drafter, target.eos_ids()

    def target_alone(self, prompt: list[int], max_new_tokens: int) -> Decoded:
        out, margins, t = _eager_alone(self.target, prompt, max_new_tokens, self.eos)
        return Decoded(out, t, margins=margins)

    def speculative(self, prompt: list[int], max_new_tokens: int) -> Decoded:
        t = Timing()
        out, produced, drafts = speculative_generate(self.target, self.drafter, prompt, max_new_tokens=max_new_tokens,
                                                     eos=self.eos, cached=True, timing=t)
        t.rounds = len(produced)
        return Decoded(out, t, produced, drafts)


def fastest_compile(device: torch.device) -> bool:
    """Whether the graphs engine's fastest mode compiles each captured step: on a GPU, where inductor's
    fused kernels shorten a launch-bound step; not on a CPU, where compiling costs minutes and nothing
    is captured. One choice for both decodes (measure() builds one decoder for the two), so the
    speedup is always the fastest decode with the drafter against the fastest decode alone."""
    return device.type == "cuda"


def decoder(engine: str, target, drafter: Drafter, prompts: list[list[int]], max_new_tokens: int, *,
            compile: bool = False):
    """The engine's decoder for these prompts, the same for the target alone and with the drafter:
    "graphs" (static caches, CUDA graphs on a GPU; compile: each captured step compiled by inductor
    first) or "eager"."""
    if engine == "eager":
        return EagerDecoder(target, drafter)
    return GraphDecoder(target, drafter, max(map(len, prompts), default=1) + max_new_tokens, compile=compile)


def mode_name(engine: str, graphed: bool, compiled: bool) -> str:
    """How a decode ran, in words: "graphs+compile", "graphs", "graphs (uncaptured)", "eager"."""
    if engine == "eager":
        return "eager"
    return "graphs" + ("+compile" if compiled else "") + ("" if graphed else " (uncaptured)")


# --------------------------------------------------------------------------- measuring

def load_drafter(path: str, target, device, dtype, *, untrained: bool = False) -> Drafter:
    """An exported DFlash draft folder (config.json + model.safetensors) as our Drafter, borrowing
    the target's embedding and lm_head; refuses a folder made for another target shape.
    untrained: the same drafter freshly initialised as the trainer starts it (seed 0), a baseline."""
    from safetensors.torch import load_file

    from trainer.errors import UsageError

    folder = Path(path)
    try:
        cfg = json.loads((folder / "config.json").read_text())
        weights = load_file(str(folder / "model.safetensors"))
    except (OSError, ValueError) as e:
        raise UsageError(f"--drafter {path}: not an exported drafter folder ({e})") from None
    dfl = cfg.get("dflash_config") or {}
    ids = tuple(dfl.get("target_layer_ids") or ())
    if not ids or "mask_token_id" not in dfl:
        raise UsageError(f"--drafter {path}: config.json has no dflash_config (target_layer_ids, mask_token_id)")
    if cfg.get("hidden_size") != target.config.hidden_size or cfg.get("num_target_layers") != target.num_layers:
        raise UsageError(f"--drafter {path}: made for a target with hidden size {cfg.get('hidden_size')} and "
                         f"{cfg.get('num_target_layers')} layers; this target has {target.config.hidden_size} and "
                         f"{target.num_layers}")
    target.layer_ids = ids
    dcfg = DrafterConfig(hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"],
                         mask_token_id=int(dfl["mask_token_id"]), num_target_layers=len(ids),
                         num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                         num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                         intermediate_size=cfg["intermediate_size"], rms_eps=cfg["rms_norm_eps"],
                         rope_theta=float(cfg["rope_theta"]), block_size=int(cfg["block_size"]))
    if untrained:
        torch.manual_seed(0)
        drafter = Drafter(dcfg)
        drafter.init_norm(target.head_weights()[1])
    else:
        with torch.device("meta"):
            drafter = Drafter(dcfg)
        drafter.to_empty(device=device)
        drafter.load_state_dict(weights, strict=False)
    drafter.borrow_target_head(*target.head_weights())
    return drafter.to(device=device, dtype=dtype).eval()


def measure(target, drafter: Drafter, prompts: list[list[int]], *, max_new_tokens: int, warmup: int = 1,
            baseline: bool = True, engine: str = "graphs", strict: bool | None = None, resamples: int = 10_000,
            seed: int = 0, compile: bool | None = None, cost_reps: int | None = None, log=print) -> dict:
    """Both decodes of every prompt with one decoder (so both in the same mode: compile None picks the
    fastest, fastest_compile), and the document.

    strict (default: when the models run in float32): any prompt whose output differs from the target's
    own greedy decode raises NotLossless. Otherwise (bf16, where a 16-token verify and a 1-token step
    may round a near-tie differently) each prompt says whether it is equal and, where not, the first new
    token that differs and the target's top-2 logit margin there. Every prompt's target-alone tokens are
    kept, so equality can be checked again from the document alone. baseline=False: only the
    speculative decode (tau and acceptance; no equality, no speedup). After the decodes, the graphs
    engine's steps are timed alone (cost_reps replays each; default 20 on a GPU, 3 on a CPU) for the
    model that predicts the decode (trainer/run/decode_model.py)."""
    if strict is None:
        strict = next(target.model.parameters()).dtype == torch.float32
    if compile is None:
        compile = engine == "graphs" and fastest_compile(target.device)
    dec = decoder(engine, target, drafter, prompts, max_new_tokens, compile=compile)
    for p in prompts[:warmup]:  # kernels, allocator, caches: not timed
        dec.target_alone(p, min(16, max_new_tokens))
        dec.speculative(p, min(32, max_new_tokens))
    alone, spec = Timing(), Timing()
    rows, drafts = [], []
    started = time.perf_counter()
    for i, p in enumerate(prompts):
        # Untimed, the prompt's forward once at its length for each decode: a length seen for the first
        # time costs a per-shape set-up (a bucket's graph capture, in the graphs engine), paid by
        # whichever decode came first (docs/decoding.md, "Per prompt")
        dec.speculative(p, 1)
        if baseline:
            dec.target_alone(p, 1)
        s = dec.speculative(p, max_new_tokens)
        row = {"prompt_tokens": len(p), "tokens": s.tokens, "rounds": s.produced,
               "accepted": [a for a, _ in s.drafts], "spec_s": s.spent.total, "spec_prefill_s": s.spent.prefill}
        spec.add(s.spent)
        drafts += s.drafts
        speed = f"{len(s.tokens) / s.spent.total:.1f} tokens/s"
        if baseline:
            r = dec.target_alone(p, max_new_tokens)
            ref = r.tokens
            if faults.value("specdec_differ") == str(i):     # a test's stand-in for a lossy drafter loop
                ref = ref[:-1] + [ref[-1] + 1]
            alone.add(r.spent)
            row.update(alone_s=r.spent.total, alone_prefill_s=r.spent.prefill, alone_tokens=len(ref),
                       target_tokens=ref, equal=s.tokens == ref)
            if s.tokens != ref:
                k = next((j for j, (x, y) in enumerate(zip(s.tokens, ref)) if x != y), min(len(s.tokens), len(ref)))
                margin = r.margins[k] if k < len(r.margins) else None
                if strict:
                    raise NotLossless(f"prompt {i}: speculative output differs from the target's greedy decode at new "
                                      f"token {k} ({s.tokens[k:k + 1]} vs {ref[k:k + 1]}; the target's top-2 margin "
                                      f"there {margin if margin is None else round(margin, 4)}): NOT lossless")
                row.update(first_diff=k, margin=margin)
            speed = f"{len(ref) / r.spent.total:.1f} -> {speed}"
        rows.append(row)
        tau = f"tau {sum(s.produced) / len(s.produced):.2f}" if s.produced else "no rounds (the prompt's token only)"
        differ = "" if row.get("equal", True) else f", DIFFERS from new token {row['first_diff']} (margin " \
                                                    f"{row['margin']:.3g})"
        left = (time.perf_counter() - started) / (i + 1) * (len(prompts) - i - 1)  # at this pace
        eta = f", eta {left:.0f}s" if i + 1 < len(prompts) else ""
        log(f"specdec: prompt {i + 1}/{len(prompts)}: {len(s.tokens)} tokens, {len(s.produced)} rounds, {tau}, "
            f"{speed}{differ}{eta}")
    costs = None
    if isinstance(dec, GraphDecoder) and rows:
        reps = cost_reps or (20 if dec.dev.type == "cuda" else 3)
        log(f"specdec: timing each step alone ({reps} replays each) for the model of the decode")
        lengths = sorted(len(p) for p in prompts)
        # the prompt's forward, timed once per bucket (at the longest prompt in it), by prompt length
        by_bucket = {b: dec.prefill_costs(n, reps=reps)
                     for b, n in {prefill_bucket(n, dec.room): n for n in lengths}.items()}
        costs = {"parts": dec.step_costs(lengths[len(lengths) // 2], reps=reps),
                 "prefill": {n: by_bucket[prefill_bucket(n, dec.room)] for n in lengths}}
    return document(rows, drafts, alone if baseline else None, spec, drafter.cfg.block_size, engine=engine,
                    graphed=dec.graphed, compiled=bool(getattr(dec, "compiled", False)), strict=strict,
                    resamples=resamples, seed=seed, costs=costs)


def document(rows: list[dict], drafts: list[tuple[int, int]], alone: Timing | None, spec: Timing, block_size: int, *,
             engine: str, graphed: bool, strict: bool, resamples: int, seed: int, compiled: bool = False,
             costs: dict | None = None) -> dict:
    """The result document of measure(). The headline tau and speedup leave out the prompts whose
    target alone ends the text at once (no round: they say nothing of the drafter); `sample` gives the
    figures for all prompts, without those, and without those and the outputs that end in a loop, each
    with per-prompt (cluster) bootstrap intervals (trainer/run/decode_sample.py). Then where the time
    went, the model of the decode against the measurement, and every prompt's tokens and rounds."""
    produced = [n for r in rows for n in r["rounds"]]
    summary = summarize(produced, drafts, block_size)
    tau, per_round_ci = summary.pop("acceptance_length"), summary.pop("tau_ci95")
    baseline = alone is not None
    sample = split_figures(rows, resamples=resamples, seed=seed)
    for loop in sample["loops"]:
        rows[loop["prompt"]]["loop_period"] = loop["period"]
    head = sample["excluding_one_token"] if sample["excluding_one_token"]["prompts"] else sample["all"]
    kept = [r for r in rows if not one_token(r)] if head is sample["excluding_one_token"] else rows
    s_rate = sum(len(r["tokens"]) for r in kept) / max(1e-12, sum(r["spec_s"] for r in kept))
    a_rate = sum(r["alone_tokens"] for r in kept) / max(1e-12, sum(r["alone_s"] for r in kept)) if baseline else None
    rounds = max(1, len(produced))
    # A round's cost and a token's, from the decodes' own totals: the decode after the prompt's forward
    t_round = (spec.total - spec.prefill) / rounds
    n_alone = sum(r["alone_tokens"] for r in rows) if baseline else 0
    t_token = (alone.total - alone.prefill) / max(1, n_alone - len(rows)) if alone is not None else None
    on_device = spec.verify - spec.prefill + spec.draft + spec.extend
    equal = sum(bool(r.get("equal")) for r in rows) if baseline else None
    differ = [r["margin"] for r in rows if baseline and not r["equal"] and r.get("margin") is not None]
    n = max(1, len(rows))
    return {"engine": engine, "graphed": graphed, "compiled": compiled,
            # both decodes ran on one decoder: the same mode, the fastest the engine has unless asked otherwise
            "mode": {"alone": mode_name(engine, graphed, compiled) if baseline else None,
                     "spec": mode_name(engine, graphed, compiled)},
            "strict": strict, "lossless": (equal == len(rows)) if baseline else None, "equal_prompts": equal,
            "max_margin": max(differ) if differ else None,
            "prompts": len(rows), "tokens": sum(len(r["tokens"]) for r in rows),
            "headline": "excluding_one_token" if head is sample["excluding_one_token"] else "all",
            "headline_prompts": head["prompts"], "one_token_prompts": len(sample["one_token"]),
            "loop_prompts": len(sample["loops"]),
            "tau": tau, **summary, "tau_ci95": head["tau_ci95"],
            # the interval that treats every round as independent (it is not: rounds within a prompt are
            # correlated), kept to compare with earlier figures
            "tau_ci95_rounds": per_round_ci,
            "target_tokens_per_s": a_rate, "spec_tokens_per_s": s_rate,
            "speedup": head["speedup"], "speedup_ci95": head["speedup_ci95"],
            "speedup_median": head["speedup_median"], "speedup_mean": head["speedup_mean"],
            "sample": sample,
            "bootstrap": {"unit": "prompt", "resamples": resamples, "seed": seed},
            "time_share": {"target_verify": spec.verify / spec.total,
                           "drafter": (spec.draft + spec.extend) / spec.total,
                           "host_other": max(0.0, 1 - (spec.verify + spec.draft + spec.extend) / spec.total)},
            "ms_per_round": {"verify": 1e3 * (spec.verify - spec.prefill) / rounds, "draft": 1e3 * spec.draft / rounds,
                             "extend": 1e3 * spec.extend / rounds,
                             "host": 1e3 * max(0.0, spec.total - spec.prefill - on_device) / rounds,
                             "all": 1e3 * t_round},
            "target_ms_per_token": 1e3 * t_token if t_token is not None else None,
            "prefill_ms_per_prompt": {"spec": 1e3 * spec.prefill / n,
                                      "alone": 1e3 * alone.prefill / n if alone is not None else None},
            "model": _model(rows, head, costs) if baseline else None,
            "per_prompt": rows}


def _model(rows: list[dict], head: dict, costs: dict | None) -> dict | None:
    """The decode predicted from each step's cost measured alone (trainer/run/decode_model.py), beside
    the measurement, over the headline's prompts; and the tau that 2x and 3x need at the sample's
    typical prompt (its median length, its mean output), the prompt's forward included."""
    if costs is None:
        return None
    parts: RoundCosts = costs["parts"]
    keep = [r for r in rows if not one_token(r)] or rows
    alone_s = spec_s = 0.0
    for r in keep:
        pa, ps = costs["prefill"][r["prompt_tokens"]]
        a, b = predict_prompt(replace(parts, prefill_alone=pa, prefill_spec=ps), r["alone_tokens"], len(r["rounds"]))
        alone_s, spec_s = alone_s + a, spec_s + b
    n_alone, n_spec = sum(r["alone_tokens"] for r in keep), sum(len(r["tokens"]) for r in keep)
    measured = {"alone_s": sum(r["alone_s"] for r in keep), "spec_s": sum(r["spec_s"] for r in keep)}
    new_tokens = round(n_alone / len(keep))
    return {"source": "each step replayed alone", "prompts": len(keep), "costs_ms": parts.as_ms(),
            "predicted": {"speedup": (n_spec / spec_s) / (n_alone / alone_s), "alone_s": alone_s, "spec_s": spec_s},
            "measured": {"speedup": (n_spec / measured["spec_s"]) / (n_alone / measured["alone_s"]), **measured},
            "new_tokens": new_tokens,
            "tau_for_2x": tau_for(parts, 2.0, new_tokens), "tau_for_3x": tau_for(parts, 3.0, new_tokens),
            "tau_for_2x_long_outputs": tau_for(parts, 2.0), "tau_for_3x_long_outputs": tau_for(parts, 3.0)}


# --------------------------------------------------------------------------- python -m trainer.specdec

def result_line(doc: dict) -> str:
    """The closing line: the agreement with the target alone first, then tau and the speedup with
    their per-prompt intervals over the headline's prompts, the mode both decodes ran in, and what
    the sample holds (one-token prompts left out, outputs ending in a loop)."""
    n = doc.get("headline_prompts", doc["prompts"])
    ci = doc.get("tau_ci95")
    tau = f"tau {tau_text(doc['tau'], ci, doc['rounds'], f'{n} prompts', digits=2)}"
    mode = (doc.get("mode") or {}).get("spec") or doc["engine"]
    left = (f"; {doc['one_token_prompts']} one-token prompt(s) left out" if doc.get("one_token_prompts") else "")
    loops = doc.get("loop_prompts")
    if loops:
        bare = doc["sample"]["excluding_one_token_and_loops"]
        left += (f"; {loops} output(s) end in a loop (without them: tau {bare['tau']:.2f}"
                 + (f", {bare['speedup']:.2f}x" if bare.get("speedup") is not None else "") + ")")
    if doc.get("speedup") is None:
        return (f"{mode}, {doc.get('dtype', '')}: {tau}; {doc['spec_tokens_per_s']:.1f} tokens/s drafted "
                f"(no baseline, no lossless check){left}")
    sci = doc.get("speedup_ci95")
    sp = f"speedup {doc['speedup']:.2f}x" + (f" (95% {sci[0]:.2f}-{sci[1]:.2f}x" if sci else " (") + \
        f"{', ' if sci else ''}median per prompt {doc['speedup_median']:.2f}x, {n} prompts)"
    slower = " (SLOWER than the target alone)" if doc["speedup"] < 1 else ""
    model = doc.get("model") or {}
    if model.get("predicted"):      # documents before the model predicted have none
        slower += f"; predicted {model['predicted']['speedup']:.2f}x from the steps timed alone"
    need = model.get("tau_for_2x")
    if doc["speedup"] < 2:     # what the drafter must reach at these costs, the prompt's forward included
        slower += f"; 2x needs tau {need:.2f}" if need else "; 2x is out of reach at these costs" if model else ""
    return (f"{agreement(doc)}; {tau}; {doc['target_tokens_per_s']:.1f} -> {doc['spec_tokens_per_s']:.1f} tokens/s, "
            f"{sp} against the target alone, both {mode}{slower}; drafter "
            f"{100 * doc['time_share']['drafter']:.0f}% of the time{left}")


def read_prompt_ids(path: str, tokenizer, *, limit: int | None = None,
                    template_kwargs: dict | None = None) -> list[list[int]]:
    """Prompts of a JSONL file (regen's input spellings) as token ids through the target's chat template
    with a generation prompt, as the trainer renders its eval prompts: with template_kwargs (a training
    run's --chat-template-kwargs), else thinking off, as regen renders them."""
    from trainer.run import data
    from trainer.regen import read_prompts

    kwargs = {"enable_thinking": False} if template_kwargs is None else template_kwargs
    return [data._render(tokenizer, [{"role": r, "content": c} for r, c in row.turns], True, kwargs)
            for row in read_prompts(path)[:limit]]


def main(argv: list[str] | None = None) -> int:
    from trainer.errors import UsageError
    from trainer.run.config import check_target_spec, template_kwargs
    from trainer.run.flags import OneLineParser

    p = OneLineParser(prog="python -m trainer.specdec",
                      description="Speculative decoding with an exported drafter against the target alone: "
                                  "lossless check, tokens/s, speedup, tau.")
    p.add_argument("--target", required=True, help="an HF folder, small-code or small-code-gpu")
    p.add_argument("--drafter", required=True, help="an exported DFlash draft folder (python -m trainer.export)")
    p.add_argument("--prompts", required=True, help="JSONL of prompts (the spellings regen reads)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, help="use only the first N prompts")
    p.add_argument("--engine", choices=("graphs", "eager"), default="graphs",
                   help="graphs (default): static KV caches, each step of the target, the verify and the drafter "
                        "replayed as a CUDA graph, as serving engines decode (on a CPU the same code runs "
                        "uncaptured); eager: transformers' own cache, every kernel launched from Python")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="both models' dtype (default auto: bfloat16 on a GPU, float32 on a CPU). In float32 every "
                        "output must equal the target's own greedy decode (exit 1 otherwise); in bfloat16 a "
                        "16-token verify and a 1-token step can round a near-tie apart, so each prompt reports "
                        "whether it is equal and, where not, the target's top-2 logit margin at the difference")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="graphs engine: compile each captured step with inductor first, for both decodes alike "
                        "(default auto: on a GPU, the fastest mode; off on a CPU, where compiling takes minutes)")
    p.add_argument("--bootstrap", type=int, default=10_000, metavar="N",
                   help="resamples of the per-prompt bootstrap behind tau's and the speedup's intervals")
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU is")
    p.add_argument("--untrained", action="store_true",
                   help="measure the same drafter freshly initialised instead (the baseline for tau)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="decode with the drafter only: tau and acceptance, no lossless check and no speedup "
                        "(for comparing drafters; several can then share one GPU)")
    p.add_argument("--chat-template-kwargs", metavar="JSON",
                   help="a JSON object of chat template options for the prompts, as a training run's (default: "
                        "thinking off, as regen renders them)")
    p.add_argument("--json", dest="json_out", help="also write the result document to this file")
    a = p.parse_args(argv)
    if a.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    check_target_spec(a.target)
    kwargs = None if a.chat_template_kwargs is None else template_kwargs(a.chat_template_kwargs)
    if a.bootstrap < 100:
        raise UsageError("--bootstrap must be at least 100")
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if not a.json_out:
        return _measure(a, kwargs, say)
    # One writer per output: a second specdec with the same --json FILE is refused at once, not after
    # its whole decode; the file appears whole or not at all.
    with output_lock(a.json_out, "--json", log=say):
        return _measure(a, kwargs, say)


def _measure(a, kwargs, say) -> int:
    from trainer.errors import UsageError
    from trainer.run.target import load_target

    dev = torch.device("cuda:0" if torch.cuda.is_available() and not a.cpu else "cpu")
    a.dtype = a.dtype if a.dtype != "auto" else "bfloat16" if dev.type == "cuda" else "float32"
    dtype = getattr(torch, a.dtype)
    target = load_target(a.target, device=dev, dtype=dtype)
    drafter = load_drafter(a.drafter, target, dev, dtype, untrained=a.untrained)
    if target.tokenizer is None:
        raise UsageError(f"--target {a.target}: no tokenizer to encode the prompts with")
    prompts = read_prompt_ids(a.prompts, target.tokenizer, limit=a.limit, template_kwargs=kwargs)
    say(f"specdec: {len(prompts)} prompts, {a.max_new_tokens} new tokens each, block {drafter.cfg.block_size}, "
        f"{drafter.cfg.num_layers} draft layers, {dev.type} {a.dtype}, engine {a.engine}")
    try:
        doc = measure(target, drafter, prompts, max_new_tokens=a.max_new_tokens, baseline=a.baseline, log=say,
                      engine=a.engine, resamples=a.bootstrap, seed=a.seed,
                      compile={"auto": None, "on": True, "off": False}[a.compile])
    except NotLossless as e:
        print(f"specdec: error: {e}", file=sys.stderr, flush=True)
        return 1
    doc = {"target": a.target, "drafter": a.drafter, "untrained": a.untrained, "device": dev.type, "dtype": a.dtype,
           "block_size": drafter.cfg.block_size, "draft_layers": drafter.cfg.num_layers, **doc}
    say(f"specdec: {result_line(doc)}")
    if a.json_out:      # whole or not at all: a specdec killed while writing leaves no half document under its name
        with atomic_file(a.json_out) as f:
            f.write(json.dumps(doc, indent=2))
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    from trainer.exits import exit_process, run
    exit_process(run(main))
