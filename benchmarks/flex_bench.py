"""The drafter's block-sparse FlexAttention alone, forward + backward, per choice of Triton tiles.

    python3 benchmarks/flex_bench.py --out OUT                      # the default list of choices
    python3 benchmarks/flex_bench.py --out OUT --configs default,64-64-64-64-3-4

A choice is `default` (torch's tiles) or the backward's tiles M1-N1-M2-N2-STAGES-WARPS (FlexAttention's
`bwd_BLOCK_M1`, `bwd_BLOCK_N1`, `bwd_BLOCK_M2`, `bwd_BLOCK_N2`, `bwd_num_stages`, `bwd_num_warps`),
optionally followed by `/M-N-STAGES-WARPS`, the forward's (`fwd_BLOCK_M`, `fwd_BLOCK_N`,
`fwd_num_stages`, `fwd_num_warps`; without it the forward keeps torch's). M and N must divide the
block mask's 128-row tiles. The shape is the drafter's at the 8B benchmark shape (batch 2, 32 query
heads over 8 KV heads of 128, 768 context tokens, 256 anchors x 16), with anchors drawn as the trainer draws
them, so the tiles skipped are the trainer's.

A `+kv` suffix (`default+kv`, `32-64-64-32-3-4+kv`) expands K/V to one head per query head in the
call (the expansion and the sum of its gradient are timed too). A choice is written as the trainer's
--flex-tiles takes it (trainer/model/attention.py parse_tiles). With grouped-query attention
the backward's dK/dV programs run per KV head, each looping over its 4 query heads: expanded, there
are 4x as many programs, each 4x shorter (the context tiles that every block attends to are where
the backward's time goes).

Each choice reports the median forward and forward + backward time, and its error against an fp32
dense-mask reference (SDPA over masks.attention_mask) on the same inputs: the largest |difference| of
the output and of dq, dk, dv, relative to the reference's largest |value|. The default's error is the
yardstick: a choice that is faster but less accurate than the default is not taken.
Needs CUDA (FlexAttention has no CPU backward).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The finalists of three sweeps (docs/benchmarks.md lists the rest), the same with K/V expanded, and
# the tuned backward with other forward tiles (128-64-3-8 is torch's own forward on sm90 at hd 128).
DEFAULT_CONFIGS = ("default,32-64-64-32-3-4,32-64-64-32-4-4,64-64-64-64-3-4,"
                   "default+kv,32-64-64-32-3-4+kv,64-128-128-64-3-8+kv,"
                   "32-64-64-32-3-4/128-64-3-8,32-64-64-32-3-4/64-64-3-4,32-64-64-32-3-4/128-128-3-8,"
                   "32-64-64-32-3-4/64-128-3-4,32-64-64-32-3-4/128-32-3-4")
SHAPE = dict(batch=2, heads=32, kv=8, hd=128, seq=768, anchors=256, block=16)


def run(configs: list[str], steps: int, seed: int = 0) -> list[dict]:
    import torch

    from trainer.model import attention, masks

    dev = torch.device("cuda")
    B, nh, nkv, hd = SHAPE["batch"], SHAPE["heads"], SHAPE["kv"], SHAPE["hd"]
    S, N, Bs = SHAPE["seq"], SHAPE["anchors"], SHAPE["block"]
    Tq, Tk = N * Bs, S + N * Bs
    g = torch.Generator().manual_seed(seed)
    anchors = torch.stack([masks.sample_anchors(torch.ones(S), S, Bs, N, g)[0] for _ in range(B)]).to(dev)
    q = torch.randn(B, nh, Tq, hd, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(B, nkv, Tk, hd, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(B, nkv, Tk, hd, generator=g).to(dev, torch.bfloat16)
    do = torch.randn(B, nh, Tq, hd, generator=g).to(dev, torch.bfloat16)
    sm = attention.sparse_mask(anchors, S, Bs)

    # fp32 reference: the trainer's dense path (SDPA over the bool mask) on the same inputs
    qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
    ref = attention.attend(qr, kr, vr, masks.attention_mask(anchors, S, Bs))
    ref.backward(do.float())
    want = {"out": ref.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}
    del qr, kr, vr, ref
    torch.cuda.empty_cache()

    args = (sm.anchors, sm.kv_num, sm.kv_idx, sm.full_num, sm.full_idx, S, Bs)
    results = []
    for name in configs:
        choice = attention.parse_tiles(name)
        torch._dynamo.reset()
        fn = torch.compile(lambda q, k, v: attention._flex_sparse(q, k, v, *args, choice=choice), dynamic=False)
        res = {"config": name, "kernel_options": choice.options, "expand_kv": choice.expand_kv}
        try:
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            out = fn(qg, kg, vg)
            out.backward(do)
            got = {"out": out.detach(), "dq": qg.grad, "dk": kg.grad, "dv": vg.grad}
            res["rel_err"] = {key: float((got[key].float() - want[key]).abs().max() / want[key].abs().max())
                              for key in want}
            # Back to back, events at the ends only: the host queues ahead, so the figure is GPU
            # time, not launch overhead (a single call is short enough for that to show).
            fwd, both = [], []
            for _ in range(max(1, steps // 10)):
                for timed, out_list in ((False, fwd), (True, both)):
                    e0, e1 = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    e0.record()
                    for _ in range(10):
                        qg.grad = kg.grad = vg.grad = None
                        out = fn(qg, kg, vg)
                        if timed:
                            out.backward(do)
                    e1.record()
                    e1.synchronize()
                    out_list.append(e0.elapsed_time(e1) / 10)
            res["fwd_ms"] = round(statistics.median(fwd), 3)
            res["fwd_bwd_ms"] = round(statistics.median(both), 3)
            res["ok"] = True
        except Exception as e:  # noqa: BLE001 - a choice the kernel cannot take (shared memory, shape): recorded
            res["ok"] = False
            res["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        print(json.dumps(res), flush=True)
        results.append(res)
    return results


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["config"] == "default" and r.get("ok")), None)
    lines = ["| backward tiles | fwd ms | fwd+bwd ms | vs default | rel. err out / dq / dk / dv |",
             "| --- | --- | --- | --- | --- |"]
    for r in results:
        if not r.get("ok"):
            lines.append(f"| {r['config']} | failed: {r.get('error', '')[:80]} | | | |")
            continue
        speed = f"{base['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x" if base else ""
        err = " / ".join(f"{r['rel_err'][k]:.1e}" for k in ("out", "dq", "dk", "dv"))
        lines.append(f"| {r['config']} | {r['fwd_ms']} | {r['fwd_bwd_ms']} | {speed} | {err} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/flex_bench")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="comma-separated: default or M1-N1-M2-N2-STAGES-WARPS, each optionally +kv")
    ap.add_argument("--steps", type=int, default=50, help="timed calls per choice, in runs of 10")
    args = ap.parse_args(argv)
    from trainer.model import attention

    try:
        configs = args.configs.split(",")
        for c in configs:
            attention.parse_tiles(c)
    except ValueError as e:
        print(f"flex_bench: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("flex_bench: needs a CUDA GPU (FlexAttention has no CPU backward)", file=sys.stderr)
        return 2
    results = run(configs, args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"shape": SHAPE, "torch": torch.__version__, "device": torch.cuda.get_device_name(), "results": results}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    print("\n" + table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
