"""What a decoding step costs under each engine, at a small target recipe's shape, with random weights.

    python benchmarks/decode_costs.py [--size gpu] [--prompts 8] [--prompt-len 200] [--new 128] [--dtype bfloat16]
                                      [--engines graphs,eager]   # and `compiled`: graphs with inductor first

A step's cost depends on the shapes, not the weights: this builds the small real target's architecture
(trainer/run/small_target.py's recipe) with random weights and a 3-layer block-16 drafter, and decodes random
prompts with both engines (trainer/run/decode_graphs.py and the eager one), timing the target alone per
token and a round with the drafter by part. A random drafter's drafts are rejected, so every round
verifies a full block: the round's cost at any tau. The speedup then follows from the model
speedup = tau * (ms per token alone) / (ms per round), printed for the taus given (--tau), with the tau
that 2x needs. No build, no data, seconds on a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


ENGINES = {"graphs", "compiled", "eager"}


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import Qwen3ForCausalLM

    from trainer.model.drafter import Drafter
    from trainer import specdec
    from trainer.run import small_target as small_lm
    from trainer.run.decode_graphs import GraphDecoder
    from trainer.run.target import Target, default_layer_ids

    p = argparse.ArgumentParser(prog="python benchmarks/decode_costs.py", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="gpu", choices=sorted(small_lm.RECIPES))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--draft-layers", type=int, default=3)
    p.add_argument("--tau", type=float, nargs="*", default=[3.25], help="taus to turn the costs into speedups")
    p.add_argument("--engines", default="graphs,eager",
                   help="comma-separated, in order: graphs, compiled (graphs with inductor-fused steps), eager")
    a = p.parse_args(argv)
    names = [n for n in a.engines.split(",") if n]
    if not names or set(names) - ENGINES:
        p.error(f"--engines: each of {', '.join(sorted(ENGINES))}, got '{a.engines}'")
    dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype)
    recipe = small_lm.RECIPES[a.size]
    torch.manual_seed(0)
    cfg = small_lm.model_config(recipe, recipe.vocab_size)
    cfg.eos_token_id = None  # random weights: never stop early
    model = Qwen3ForCausalLM(cfg).to(dev, dtype).eval()
    for prm in model.parameters():
        prm.requires_grad_(False)
    target = Target(model, None, default_layer_ids(cfg.num_hidden_layers), f"random {a.size}", "random")
    d = Drafter(target.drafter_config(num_layers=a.draft_layers, block_size=16, mask_token_id=None))
    d.init_norm(target.head_weights()[1])
    d.borrow_target_head(*target.head_weights())
    d = d.to(dev, dtype).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, recipe.vocab_size, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    out = {"size": a.size, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "dtype": a.dtype, "prompts": a.prompts, "prompt_len": a.prompt_len, "new_tokens": a.new}
    build = {"graphs": lambda: GraphDecoder(target, d, a.prompt_len + a.new),
             "compiled": lambda: GraphDecoder(target, d, a.prompt_len + a.new, compile=True),
             "eager": lambda: specdec.EagerDecoder(target, d)}
    for name in names:
        dec = build[name]()
        dec.target_alone(prompts[0], min(16, a.new))
        dec.speculative(prompts[0], min(32, a.new))
        alone = [dec.target_alone(q, a.new) for q in prompts]
        spec = [dec.speculative(q, a.new) for q in prompts]
        tok = sum(len(r.tokens) - 1 for r in alone)
        t_token = 1e3 * sum(r.spent.total - r.spent.prefill for r in alone) / tok
        full = spec  # every round but the last of each prompt verifies a full block
        rounds = sum(len(s.produced) for s in full)
        part = {k: 1e3 * sum(getattr(s.spent, k) for s in full) / rounds for k in ("draft", "extend")}
        part["verify"] = 1e3 * sum(s.spent.verify - s.spent.prefill for s in full) / rounds
        t_round = 1e3 * sum(s.spent.total - s.spent.prefill for s in full) / rounds
        part["host"] = t_round - part["verify"] - part["draft"] - part["extend"]
        out[name] = {"graphed": bool(getattr(dec, "graphed", False)), "target_ms_per_token": t_token,
                     "ms_per_round": {**part, "all": t_round},
                     "speedup_at_tau": {str(t): t * t_token / t_round for t in a.tau},
                     "tau_for_2x": 2 * t_round / t_token}
        print(f"{name}: graphed {out[name]['graphed']}; target alone {t_token:.3f} ms/token; a round "
              f"{t_round:.3f} ms (verify {part['verify']:.3f}, draft {part['draft']:.3f}, extend "
              f"{part['extend']:.3f}, host {part['host']:.3f}); tau for 2x {2 * t_round / t_token:.2f}; "
              + ", ".join(f"at tau {t}: {t * t_token / t_round:.2f}x" for t in a.tau), file=sys.stderr, flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
