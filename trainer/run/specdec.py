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
from pathlib import Path

import torch

from trainer import faults
from trainer.model.drafter import Drafter, DrafterConfig
from trainer.run.eval import Timing, clock, speculative_generate, summarize
from trainer.run.log import tau_text


class NotLossless(RuntimeError):
    """Decoding with the drafter gave other tokens than the target alone."""


# --------------------------------------------------------------------------- the target alone

@torch.no_grad()
def target_greedy(target, prompt: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], Timing]:
    """The target alone: one cached forward per token, greedy, stopping at EOS."""
    dev = target.device
    t = Timing()
    t0 = clock(dev)
    logits, _, cache = target.decode(torch.tensor([prompt], device=dev))
    tok = int(logits[0, -1].argmax())
    out = [tok]
    while len(out) < max_new_tokens and tok not in eos:
        logits, _, cache = target.decode(torch.tensor([[tok]], device=dev), cache)
        tok = int(logits[0, -1].argmax())
        out.append(tok)
    t.total = t.verify = clock(dev) - t0
    return out, t


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
            baseline: bool = True, log=print) -> dict:
    """Both decodes of every prompt; NotLossless at the first token that differs.
    baseline=False: only the speculative decode (tau and acceptance; no lossless check, no speedup)."""
    eos = target.eos_ids()
    for p in prompts[:warmup]:  # kernels, allocator, caches: not timed
        target_greedy(target, p, min(16, max_new_tokens), eos)
        speculative_generate(target, drafter, p, max_new_tokens=min(32, max_new_tokens), eos=eos, cached=True)
    alone, spec = Timing(), Timing()
    n_alone = n_spec = 0
    produced_all: list[int] = []
    drafts: list[tuple[int, int]] = []  # (drafts accepted, drafts offered) per round
    for i, p in enumerate(prompts):
        ts = Timing()
        out, produced, acc = speculative_generate(target, drafter, p, max_new_tokens=max_new_tokens, eos=eos,
                                                  cached=True, timing=ts)
        ref, ta = target_greedy(target, p, max_new_tokens, eos) if baseline else (out, None)
        if faults.value("specdec_differ") == str(i):     # a test's stand-in for a lossy drafter loop
            ref = ref[:-1] + [ref[-1] + 1]
        if out != ref:
            k = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
            raise NotLossless(f"prompt {i}: speculative output differs from the target's greedy decode at new "
                               f"token {k} ({out[k:k + 1]} vs {ref[k:k + 1]}): NOT lossless")
        spec.add(ts)
        n_spec += len(out)
        produced_all += produced
        drafts += acc
        speed = f"{len(out) / ts.total:.1f} tokens/s"
        if ta:
            alone.add(ta)
            n_alone += len(ref)
            speed = f"{len(ref) / ta.total:.1f} -> {speed}"
        log(f"specdec: prompt {i + 1}/{len(prompts)}: {len(out)} tokens, tau {len(out) / max(1, len(produced)):.2f}, "
            f"{speed}")
    summary = summarize(produced_all, drafts, drafter.cfg.block_size)
    s_rate = n_spec / spec.total
    a_rate = n_alone / alone.total if baseline else None
    return {"lossless": True if baseline else None, "prompts": len(prompts), "tokens": n_spec,
            "tau": summary.pop("acceptance_length"), **summary, "target_tokens_per_s": a_rate,
            "spec_tokens_per_s": s_rate, "speedup": s_rate / a_rate if baseline else None,
            "time_share": {"target_verify": spec.verify / spec.total, "drafter": spec.draft / spec.total,
                           "host_other": max(0.0, 1 - (spec.verify + spec.draft) / spec.total)},
            "ms_per_round": {"verify": 1e3 * spec.verify / max(1, len(produced_all)),
                             "draft": 1e3 * spec.draft / max(1, len(produced_all))},
            "target_ms_per_token": 1e3 * alone.total / max(1, n_alone) if baseline else None}


# --------------------------------------------------------------------------- python -m trainer.specdec

def read_prompt_ids(path: str, tokenizer, *, limit: int | None = None,
                    template_kwargs: dict | None = None) -> list[list[int]]:
    """Prompts of a JSONL file (regen's input spellings) as token ids through the target's chat template
    with a generation prompt, as the trainer renders its eval prompts: with template_kwargs (a training
    run's --chat-template-kwargs), else thinking off, as regen renders them."""
    from trainer.run import data
    from trainer.run.regen import read_prompts

    kwargs = {"enable_thinking": False} if template_kwargs is None else template_kwargs
    return [data._render(tokenizer, [{"role": r, "content": c} for r, c in row.turns], True, kwargs)
            for row in read_prompts(path)[:limit]]


def main(argv: list[str] | None = None) -> int:
    from trainer.errors import UsageError
    from trainer.run.config import OneLineParser, check_target_spec, template_kwargs
    from trainer.run.target import load_target

    p = OneLineParser(prog="python -m trainer.specdec",
                      description="Speculative decoding with an exported drafter against the target alone: "
                                  "lossless check, tokens/s, speedup, tau.")
    p.add_argument("--target", required=True, help="an HF folder, small-code or small-code-gpu")
    p.add_argument("--drafter", required=True, help="an exported DFlash draft folder (python -m trainer.export)")
    p.add_argument("--prompts", required=True, help="JSONL of prompts (the spellings regen reads)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, help="use only the first N prompts")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="both models' dtype (default float32: greedy choices then do not hang on the "
                        "rounding of a 1-token vs a 16-token forward, so lossless is checkable)")
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
    dev = torch.device("cuda:0" if torch.cuda.is_available() and not a.cpu else "cpu")
    dtype = getattr(torch, a.dtype)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    target = load_target(a.target, device=dev, dtype=dtype)
    drafter = load_drafter(a.drafter, target, dev, dtype, untrained=a.untrained)
    if target.tokenizer is None:
        raise UsageError(f"--target {a.target}: no tokenizer to encode the prompts with")
    prompts = read_prompt_ids(a.prompts, target.tokenizer, limit=a.limit, template_kwargs=kwargs)
    say(f"specdec: {len(prompts)} prompts, {a.max_new_tokens} new tokens each, block {drafter.cfg.block_size}, "
        f"{drafter.cfg.num_layers} draft layers, {dev.type} {a.dtype}")
    try:
        doc = measure(target, drafter, prompts, max_new_tokens=a.max_new_tokens, baseline=a.baseline, log=say)
    except NotLossless as e:
        print(f"specdec: error: {e}", file=sys.stderr, flush=True)
        return 1
    doc = {"target": a.target, "drafter": a.drafter, "untrained": a.untrained, "device": dev.type, "dtype": a.dtype,
           "block_size": drafter.cfg.block_size, "draft_layers": drafter.cfg.num_layers, **doc}
    tau = f"tau {tau_text(doc['tau'], doc['tau_ci95'], doc['rounds'], digits=2)}"
    if a.baseline:
        say(f"specdec: lossless; {tau}; {doc['target_tokens_per_s']:.1f} -> {doc['spec_tokens_per_s']:.1f} tokens/s, "
            f"speedup {doc['speedup']:.2f}x; drafter {100 * doc['time_share']['drafter']:.0f}% of the time")
    else:
        say(f"specdec: {tau}; {doc['spec_tokens_per_s']:.1f} tokens/s drafted (no baseline, no lossless check)")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc), flush=True)
    return 0
