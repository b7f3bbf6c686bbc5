"""The drafter step's matmuls one by one, at the 8B benchmark shape: where the matmul time goes.

    python3 benchmarks/gemm_bench.py --out OUT          # CUDA; OUT/results.json, the table on stdout

The drafter step's matmul kernels are ~47 of its ~61 ms/sample of kernel time (docs/benchmarks.md),
at ~740 TFLOP/s on average. This times each of the step's GEMMs alone, with the operands the step
gives them (bf16, the weight gradient written in fp32 as trainer.model.linear.Linear does), back to back,
and reports its TFLOP/s and its share of a step: a GEMM well below the others is a shape problem
(too few tiles for the SMs, too short a K) that a different grouping of the same math may fix.
It also times the groupings the drafter could use instead: k_proj + v_proj as one GEMM (they read
the same input), gate_proj + up_proj as one, and the lm_head's chunk of rows at other sizes.

Shapes (drafter_bench.py's 8B shape: batch 2, context 768, 256 anchors x 16): block tokens Tq = 8192,
keys Tk = 9728 (context + block), context rows 1536; the first layer's q/k/v on the block's 514
distinct rows (the anchors' and the MASK row, per sample); the last layer's o_proj and MLP, and the
lm_head, on the 7680 rows that have a loss (not the anchors'), the lm_head in chunks
(trainer/model/fused_ce.py chunk_rows: 1024). Together they are the matmul FLOPs that
trainer.model.drafter.flops_needed counts (tests/test_gemm_bench.py checks it).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafter_bench import SHAPES  # noqa: E402  (no torch at import)

_S = SHAPES["8b"]
# I is the intermediate size, as in the shapes (H, I) of the MLP weights.
H, I, V, LAYERS, BATCH = _S["hidden"], _S["inter"], _S["vocab"], _S["layers"], _S["batch"]  # noqa: E741
Q, KV, N_TARGET = _S["heads"] * _S["hd"], _S["kv"] * _S["hd"], 5  # DrafterConfig.num_target_layers
N_BLOCKS = BATCH * _S["anchors"]
TQ, TC = N_BLOCKS * _S["block"], BATCH * _S["seq"]     # block tokens, context rows
TK = TC + TQ                                         # keys: context + block
HEAD_ROWS = N_BLOCKS * (_S["block"] - 1)             # rows with a loss (not the anchors')
FIRST = BATCH + N_BLOCKS                             # the first layer's distinct block rows (anchors + MASK)


def gemms(head_chunk: int = 1024) -> list[dict]:
    """The step's GEMMs: name, kind (fwd: x @ W.T; dgrad: dy @ W; wgrad: dy.T @ x in fp32), rows,
    inputs, outputs, how many per step, and the group (what a fused alternative replaces). The first
    layer's q/k/v run on the block's distinct rows (trainer.model.linear block_rows_linear)."""
    out = []

    def linear(name, rows, n_in, n_out, count, kinds=("fwd", "dgrad", "wgrad"), group=None):
        for kind in kinds:
            out.append(dict(name=name, kind=kind, rows=rows, n_in=n_in, n_out=n_out, count=count, group=group))

    linear("fc", TC, N_TARGET * H, H, 1, kinds=("fwd", "wgrad"))  # the target's features need no gradient
    linear("q_proj", TQ, H, Q, LAYERS - 1)
    linear("k_proj", TK, H, KV, LAYERS - 1, group="kv")
    linear("v_proj", TK, H, KV, LAYERS - 1, group="kv")
    linear("q_proj, first layer", FIRST, H, Q, 1)
    linear("k_proj, first layer", TC + FIRST, H, KV, 1)
    linear("v_proj, first layer", TC + FIRST, H, KV, 1)
    linear("o_proj", TQ, Q, H, LAYERS - 1)
    linear("gate_proj", TQ, H, I, LAYERS - 1, group="gate_up")
    linear("up_proj", TQ, H, I, LAYERS - 1, group="gate_up")
    linear("down_proj", TQ, I, H, LAYERS - 1)
    linear("o_proj, last layer", HEAD_ROWS, Q, H, 1)
    linear("gate_proj, last layer", HEAD_ROWS, H, I, 1)
    linear("up_proj, last layer", HEAD_ROWS, H, I, 1)
    linear("down_proj, last layer", HEAD_ROWS, I, H, 1)
    full, rest = divmod(HEAD_ROWS, head_chunk)
    linear(f"lm_head x{head_chunk}", head_chunk, H, V, full, kinds=("fwd", "dgrad"))
    if rest:
        linear(f"lm_head x{rest}", rest, H, V, 1, kinds=("fwd", "dgrad"))
    return out


def alternatives() -> list[dict]:
    """Fused groupings of the same math, to set against the sum of the GEMMs they replace."""
    out = []
    for kind in ("fwd", "dgrad", "wgrad"):
        out.append(dict(name="kv fused", kind=kind, rows=TK, n_in=H, n_out=2 * KV, count=LAYERS - 1, replaces="kv"))
        out.append(dict(name="gate_up fused", kind=kind, rows=TQ, n_in=H, n_out=2 * I, count=LAYERS - 1,
                        replaces="gate_up"))
    return out


def flops(g: dict) -> float:
    return 2.0 * g["rows"] * g["n_in"] * g["n_out"]


def gemm_fn(g: dict):
    """The GEMM as a no-argument function on fresh bf16 operands (the weight gradient in fp32)."""
    import torch

    dev = torch.device("cuda")
    M, K, N = g["rows"], g["n_in"], g["n_out"]
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
    if g["kind"] == "fwd":
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        return lambda: torch.nn.functional.linear(x, w)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    if g["kind"] == "dgrad":
        return lambda: dy @ w
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    return lambda: torch.mm(dy.t(), x, out_dtype=torch.float32)


def time_all(rows: list[dict], reps: int, rounds: int) -> None:
    """Median ms of one call of each GEMM (r["ms"]), each timed over `reps` calls back to back (GPU
    time, not launch time). The rounds interleave the GEMMs, so the clock's drift as the GPU warms
    (a few percent over a run) falls on all of them alike instead of on the ones timed last."""
    import torch

    # operands are made per GEMM and round: all of them at once would not fit beside the lm_head's
    times: list[list[float]] = [[] for _ in rows]
    for _ in range(rounds):
        for i, r in enumerate(rows):
            fn = gemm_fn(r)
            for _ in range(2):
                fn()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(reps):
                fn()
            e1.record()
            e1.synchronize()
            times[i].append(e0.elapsed_time(e1) / reps)
    for r, t in zip(rows, times):
        t.sort()
        r["ms"] = t[len(t) // 2]


def table(rows: list[dict]) -> str:
    lines = ["| GEMM | set | kind | rows x in -> out | per step | ms each | TFLOP/s | ms/sample |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['set']} | {r['kind']} | {r['rows']} x {r['n_in']} -> {r['n_out']} | "
                     f"{r['count']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['ms_per_sample']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/gemm_bench")
    ap.add_argument("--reps", type=int, default=10, help="calls timed back to back")
    ap.add_argument("--rounds", type=int, default=5, help="times each GEMM is timed (interleaved); the median counts")
    ap.add_argument("--head-chunks", default="1024,1536,2048,2560,3840,7680",
                    help="lm_head rows per chunk to compare (the first is the step's)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gemm_bench: needs CUDA", file=sys.stderr)
        return 2
    chunks = [int(c) for c in args.head_chunks.split(",")]
    rows = [dict(g, set="step") for g in gemms(chunks[0])]
    for c in chunks[1:]:
        rows += [dict(g, set=f"lm_head x{c}") for g in gemms(c) if g["name"].startswith("lm_head")]
    rows += [dict(g, set=g["name"]) for g in alternatives()]
    time_all(rows, args.reps, args.rounds)
    for r in rows:
        r["tflops"] = flops(r) / (r["ms"] / 1e3) / 1e12
        r["ms_per_sample"] = r["ms"] * r["count"] / BATCH

    def ms(pick) -> float:
        return sum(r["ms_per_sample"] for r in rows if pick(r))

    step = [r for r in rows if r["set"] == "step"]
    total = ms(lambda r: r["set"] == "step")
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "step_ms_per_sample": total,
               "step_tflops": sum(flops(r) * r["count"] for r in step) / BATCH / (total / 1e3) / 1e12,
               "kv ms/sample, separate vs fused": [ms(lambda r: r.get("group") == "kv" and r["set"] == "step"),
                                                   ms(lambda r: r["set"] == "kv fused")],
               "gate_up ms/sample, separate vs fused": [
                   ms(lambda r: r.get("group") == "gate_up" and r["set"] == "step"),
                   ms(lambda r: r["set"] == "gate_up fused")],
               "lm_head ms/sample by chunk": {c: ms(lambda r, c=c: r["name"].startswith("lm_head") and
                                                    r["set"] == ("step" if c == chunks[0] else f"lm_head x{c}"))
                                              for c in chunks},
               "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    print(table(rows))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
