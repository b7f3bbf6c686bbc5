"""Where the GPU waits: idle gaps on a profiler timeline, and who made each one.

    python3 benchmarks/gpu_idle_gaps.py TRACE.json[.gz] [--top 25]     # a trace from torch.profiler

A kernel profile adds kernel times; the step's wall time is larger by the time the GPU ran
nothing. This reads the Chrome trace that `torch.profiler.profile.export_chrome_trace` writes
and, per device, merges the kernels, copies and memsets into busy intervals. Every idle gap
between them is attributed through the launch of the kernel that ended it (the trace links a
kernel to its launch by `correlation`):
- `host`: the launch returned after the GPU had gone idle: the GPU waited for the host (Python,
  a compile wrapper, a synchronisation the host sat in before it could launch). The gap is
  charged to the CPU ops enclosing that launch on its thread (outermost and innermost names).
- `device`: the kernel had been launched before the gap began and still started late: it waited
  on something on the device (another stream, an event, a copy).
The report: busy and idle ms per device, idle ms by kind and by enclosing op, and the longest gaps
with the kernels before and after them.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
CPU_CATS = ("cpu_op", "user_annotation", "python_function")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def _contexts(events: list[dict]) -> dict[int, list[str]]:
    """correlation id -> names of the CPU ops enclosing its launch on the launching thread, outermost first."""
    per_tid: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and (e.get("cat") in CPU_CATS or e.get("cat") in LAUNCH_CATS):
            per_tid[(e.get("pid"), e.get("tid"))].append(e)
    out: dict[int, list[str]] = {}
    for evs in per_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[dict] = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) < e["ts"]:
                stack.pop()
            if e.get("cat") in LAUNCH_CATS:
                corr = (e.get("args") or {}).get("correlation")
                if corr is not None:
                    out[corr] = [s["name"] for s in stack]
            else:
                stack.append(e)
    return out


def gap_report(events: list[dict], min_gap_us: float = 2.0, top: int = 25) -> dict:
    """The idle time of every device on the timeline, attributed (see the module doc)."""
    launches = {(e.get("args") or {}).get("correlation"): e for e in events
                if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS}
    contexts = _contexts(events)
    gpu: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS:
            gpu[str((e.get("args") or {}).get("device", e.get("pid")))].append(e)
    devices, gaps = {}, []
    for dev, ks in sorted(gpu.items()):
        ks.sort(key=lambda e: e["ts"])
        busy, idle = 0.0, 0.0
        start, end = ks[0]["ts"], ks[0]["ts"] + ks[0].get("dur", 0)
        prev = ks[0]
        for k in ks[1:]:
            k_end = k["ts"] + k.get("dur", 0)
            if k["ts"] > end + min_gap_us:
                busy += end - start
                gap = k["ts"] - end
                idle += gap
                corr = (k.get("args") or {}).get("correlation")
                launch = launches.get(corr)
                ctx = contexts.get(corr, [])
                if launch is None:
                    kind = "unknown"
                else:
                    kind = "host" if launch["ts"] + launch.get("dur", 0) > end else "device"
                gaps.append({"device": dev, "at_us": round(end - ks[0]["ts"], 1), "us": round(gap, 1), "kind": kind,
                             "before": prev["name"][:90], "after": k["name"][:90],
                             "outer": ctx[0][:90] if ctx else "?", "inner": ctx[-1][:90] if ctx else "?"})
                start = k["ts"]
            if k_end > end:
                end, prev = k_end, k
        busy += end - start
        devices[dev] = {"span_ms": round((end - ks[0]["ts"]) / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
                        "idle_ms": round(idle / 1e3, 3), "kernels": len(ks)}
    by_kind: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for g in gaps:
        by_kind[g["kind"]] += g["us"] / 1e3
        key = f"{g['kind']}: {g['outer']} > {g['inner']}"
        by_op[key] += g["us"] / 1e3
        counts[key] += 1
    ops = sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
    return {"devices": devices, "min_gap_us": min_gap_us, "gaps": len(gaps),
            "idle_ms_by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "idle_ms_by_op": [{"where": k, "ms": round(v, 3), "gaps": counts[k]} for k, v in ops],
            "longest": sorted(gaps, key=lambda g: -g["us"])[:top]}


def render(rep: dict) -> str:
    lines = [f"{dev}: span {d['span_ms']:.1f} ms, busy {d['busy_ms']:.1f}, idle {d['idle_ms']:.1f} "
             f"({d['kernels']} kernels/copies)" for dev, d in rep["devices"].items()]
    lines.append(f"idle by kind (ms, gaps > {rep['min_gap_us']:g} us: {rep['gaps']}): "
                 + ", ".join(f"{k} {v:.2f}" for k, v in rep["idle_ms_by_kind"].items()))
    lines.append("idle by enclosing op (ms, gaps):")
    lines += [f"  {r['ms']:8.2f} {r['gaps']:5d}  {r['where']}" for r in rep["idle_ms_by_op"]]
    lines.append("longest gaps (us at, us, kind, before -> after | outer > inner):")
    lines += [f"  {g['at_us']:10.1f} {g['us']:8.1f} {g['kind']:6s} {g['before'][:40]} -> {g['after'][:40]} | "
              f"{g['outer'][:40]} > {g['inner'][:50]}" for g in rep["longest"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--min-gap-us", type=float, default=2.0)
    args = ap.parse_args(argv)
    try:
        events = load(args.trace)
    except (OSError, ValueError, KeyError) as e:
        print(f"gaps: error: cannot read {args.trace}: {e}", file=sys.stderr)
        return 2
    print(render(gap_report(events, args.min_gap_us, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
