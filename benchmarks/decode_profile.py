"""Where a graphs-engine step's GPU time goes, kernel by kernel: the target's one-token step beside its
block verify, and the drafter's draft and extend, at a small target recipe's shape with random weights.

    python benchmarks/decode_profile.py [--size gpu] [--dtype bfloat16] [--context 300] [--top 12]

Each step is run uncaptured under torch.profiler (the same kernels a CUDA graph replays, launched one
by one), `--reps` times after a warm-up; per step it prints the GPU time per call summed over kernels
(what a replay costs when launches are free), the kernel count per call, and the kernels that take the
most time. A replayed step's measured time (benchmarks/decode_costs.py) above its kernel sum is the
gaps between kernels. JSON on stdout. Needs a GPU for kernel times (on a CPU it reports CPU op times).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import Qwen3ForCausalLM

    from trainer.model.drafter import Drafter
    from trainer.run import small_target as small_lm
    from trainer.run.decode_graphs import GraphDecoder
    from trainer.run.target import Target, default_layer_ids

    p = argparse.ArgumentParser(prog="python benchmarks/decode_profile.py", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="gpu", choices=sorted(small_lm.RECIPES))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--context", type=int, default=300, help="tokens before the step (its position)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--top", type=int, default=12, help="kernels listed per step")
    a = p.parse_args(argv)
    dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    recipe = small_lm.RECIPES[a.size]
    torch.manual_seed(0)
    cfg = small_lm.model_config(recipe, recipe.vocab_size)
    model = Qwen3ForCausalLM(cfg).to(dev, getattr(torch, a.dtype)).eval()
    target = Target(model, None, default_layer_ids(cfg.num_hidden_layers), f"random {a.size}", "random")
    d = Drafter(target.drafter_config(num_layers=3, block_size=16, mask_token_id=None))
    d.init_norm(target.head_weights()[1])
    d.borrow_target_head(*target.head_weights())
    d = d.to(dev, getattr(torch, a.dtype)).eval()
    g = GraphDecoder(target, d, a.context + 64 + 2 * a.reps, graphs=False)  # room for the replays of the step
    B = g.B
    g.anchor.fill_(1)
    g.p.fill_(a.context)
    steps = {"one-token step": g._step, "verify (block)": lambda: g._verify(B),
             "draft": lambda: g._draft(B), "extend": lambda: g._extend(B)}
    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = {"size": a.size, "dtype": a.dtype, "context": a.context, "reps": a.reps,
           "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "steps": {}}
    with torch.no_grad():
        for name, fn in steps.items():
            for _ in range(3):
                fn()
                g.p.fill_(a.context)
            if cuda:
                torch.cuda.synchronize()
            with profile(activities=acts) as prof:
                for _ in range(a.reps):
                    fn()
                    g.p.fill_(a.context)
                if cuda:
                    torch.cuda.synchronize()
            rows = []
            for e in prof.key_averages():
                t = e.device_time_total if cuda else e.self_cpu_time_total
                if t > 0 and (not cuda or e.device_type.name == "CUDA"):
                    rows.append((t / a.reps, e.count / a.reps, e.key))
            rows.sort(reverse=True)
            total = sum(r[0] for r in rows)
            kernels = sum(r[1] for r in rows)
            out["steps"][name] = {"us_per_call": total, "kernels_per_call": kernels,
                                  "top": [{"us": t, "per_call": c, "kernel": k[:120]} for t, c, k in rows[: a.top]]}
            print(f"{name}: {total:.0f} us of {'GPU' if cuda else 'CPU'} time per call, {kernels:.0f} kernels",
                  file=sys.stderr)
            for t, c, k in rows[: a.top]:
                print(f"    {t:8.1f} us  x{c:4.0f}  {k[:100]}", file=sys.stderr)
        if cuda:
            out["replay_ms"] = replays(g, B, a.context, a.reps)
    print(json.dumps(out))
    return 0


def replays(g, B: int, context: int, reps: int) -> dict:
    """Each step captured as a CUDA graph (as the engine captures it) and replayed `reps` times back to
    back, timed by CUDA events: ms per replay alone; then a round's three graphs in sequence without a
    host synchronisation, and with the engine's one (the accept decision's .tolist()) after each round."""
    import torch

    from trainer.run.decode_graphs import _Graph

    graphs = {"one-token step": _Graph(g._step, g.dev), "verify (block)": _Graph(lambda: g._verify(B), g.dev),
              "draft": _Graph(lambda: g._draft(B), g.dev), "extend": _Graph(lambda: g._extend(B), g.dev)}

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / reps

    out = {name: timed(gr.replay) for name, gr in graphs.items()}

    def round_graphs(sync: bool):
        g.p.fill_(context)
        graphs["draft"].replay()
        graphs["verify (block)"].replay()
        graphs["extend"].replay()
        if sync:
            torch.cat([g.drafted, g.choice]).tolist()
    out["round, no sync"] = timed(lambda: round_graphs(False))
    out["round, one sync"] = timed(lambda: round_graphs(True))
    for name, ms in out.items():
        print(f"replayed: {name}: {ms:.3f} ms", file=sys.stderr)
    return out


if __name__ == "__main__":
    sys.exit(main())
