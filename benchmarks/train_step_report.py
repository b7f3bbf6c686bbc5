"""What comes out of train_step_bench.py: the cases it alternates, the medians per case, the
results file, the summary table, and the profile (kernel time by category, the timeline's gaps)."""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

# Measured on one H200, torch 2.11, batch 2 x 768 (docs/benchmarks.md): what this benchmark's
# figures are compared with.
REFERENCE_MS_PER_SAMPLE = {
    "plain Qwen3-8B forward, hidden states of 5 layers (transformers + sdpa, inference mode)": 25.9,
    "the same, stopping after layer 33": 24.9,
    "drafter step alone (benchmarks/drafter_bench.py, inductor/flex/chunked)": 67.1,
    "SpecForge 0.2.0, whole step": 112.8,
}

def profile_steps(engine, batches, args, sync, record: bool = True) -> dict:
    """Two more steps of the first case under torch.profiler: CUDA kernel time by category
    (drafter_bench's table; CUPTI sees every thread's kernels), per sample of the global batch.
    The target's attention is the `sdpa attention` row (the drafter's is flex). With --trace, the
    timeline goes to OUT/trace.json.gz and its idle gaps are attributed (benchmarks/gaps.py)."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    from drafter_bench import _kernel_table
    from gpu_idle_gaps import gap_report, load

    sync()
    # Started and stopped in worker 0's thread: the profiler records the CPU ops of the thread that
    # starts it (and the autograd threads it drives), so the trace can say which op made a gap.
    # With several ranks, only rank 0 records (`record`); the others run the same two steps.
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    if record:
        engine.on_primary(prof.start)
    try:
        ahead = args.cases[0]["lookahead"] == "on"
        for k in range(2):  # as the trainer's loop: the host queues the second step before the first has run
            following = batches[(k + 1) % len(batches)] if ahead else None
            engine.step(batches[k % len(batches)], k, 1e-5, 1.0, ahead=following)
        engine.settle()
        sync()
    finally:
        if record:
            engine.on_primary(prof.stop)
    if not record:
        return {}
    table = _kernel_table(prof)
    n = 2 * len(batches[0])
    table["steps"] = 2
    table["case"] = args.cases[0]["name"]
    table["per_sample_ms"] = {k: round(v / n, 2) for k, v in table["by_category_ms"].items()}
    if args.trace:
        raw = Path(args.out) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        table["gaps"] = gap_report(load(str(raw) + ".gz"))
    return table


def cases(**dims: list[str]) -> list[dict]:
    """One case per combination of the dimensions' values, in order; named by the first dimension's
    value and, joined by "+", each other dimension's that has several (compiled+own+fused, ...)."""
    import itertools

    keys = list(dims)
    out = []
    for values in itertools.product(*dims.values()):
        parts = [v for k, v in zip(keys, values) if k == keys[0] or len(dims[k]) > 1]
        out.append(dict(zip(keys, values), name="+".join(parts)))
    return out


def summarise(res: dict) -> None:
    """res["modes"][mode]: medians over that mode's timed steps, ms/sample (each column its own median)."""
    timed = [s for s in res["steps"] if s["timed"]]
    res["timed_steps"] = len(timed)
    B = res["global_batch"]
    res["modes"] = {}
    for mode in res["target_modes"]:
        mine = [s for s in timed if s["mode"] == mode]
        if not mine:
            continue
        m = res["modes"][mode] = {"timed_steps": len(mine)}
        for key in ("total", "features_mean", "drafter"):
            median_ms = statistics.median(s[f"{key}_ms"] for s in mine)
            m[f"{key.replace('_mean', '')}_ms_per_sample"] = round(median_ms / B, 2)
        if "peak_gb" in mine[0]:
            m["peak_gb"] = {d: round(max(s["peak_gb"][d] for s in mine), 2) for d in mine[0]["peak_gb"]}


def write(out: str, res: dict) -> None:
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "results.json.tmp"
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, path / "results.json")


def summary(res: dict) -> str:
    if not res.get("timed_steps"):
        return f"no timed step ({res.get('error', 'see the log')})"
    lines = [
        f"train step, {res['shape']} shape, policy {res['policy']}, "
        f"{res['workers']} {'rank(s)' if res.get('topology') == 'processes' else 'worker(s)'} on "
        f"{', '.join(dict.fromkeys(res['devices']))} ({res['device_name']}), "
        f"global batch {res['global_batch']} x {res['seq']}, {res['anchors']} anchors x block {res['block']}; "
        f"torch {res['torch']}, transformers {res.get('transformers', '?')}",
        f"medians of {res['timed_steps']} timed steps after {len(res['steps']) - res['timed_steps']} warm-up "
        f"(the first, with compile: {res.get('first_step_s')} s), each block of {res.get('case_steps', 1)} steps "
        f"timed whole; ms/sample, drafter = total - target forward; "
        f"truncated features == the whole forward's: {res.get('truncated_equals_full')}",
        "",
        "| target mode | steps | target forward | drafter step | total | peak GB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode, m in res["modes"].items():
        peak = ", ".join(f"{v:.1f}" for v in m["peak_gb"].values()) if m.get("peak_gb") else "-"
        lines.append(f"| {mode} | {m['timed_steps']} | {m['features_ms_per_sample']:.1f} | "
                     f"{m['drafter_ms_per_sample']:.1f} | **{m['total_ms_per_sample']:.1f}** | {peak} |")
    if res["shape"] == "8b":
        lines.append("reference, ms/sample on one H200: "
                     + "; ".join(f"{k}: {v}" for k, v in REFERENCE_MS_PER_SAMPLE.items()))
    return "\n".join(lines)
