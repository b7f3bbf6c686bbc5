"""Plot drafter_bench results: ms/sample per variant against the goal, and where the time goes.

    .venv/bin/python benchmarks/plot_drafter.py RESULTS.json [RESULTS.json ...] -o PNG

RESULTS.json is what drafter_bench.py writes (`OUT/results.json`, a list of variant records; it
also calls this at the end of a run). Left: ms per sample of every variant that ran, with the
goal (60), the dense floor and SpecForge's 105.6 marked. Right: CUDA kernel ms per sample by
category, for the variants that were profiled (`profile.by_category_ms` over `profile.steps`
steps of `batch` samples, or `profile.per_sample_ms` when a record carries it directly).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _plot import save_png  # noqa: E402

GOAL_MS = 60.0
SPECFORGE_MS = 105.6
ROOFLINE_MS = 50.0      # ~790 TFLOP/s practical bf16 roofline over the dense count: the drafter's goal


def per_sample_breakdown(record: dict) -> dict[str, float]:
    """{category: kernel ms per sample} of a profiled record, {} when it has no profile."""
    prof = record.get("profile") or {}
    if prof.get("per_sample_ms"):
        return dict(prof["per_sample_ms"])
    cats, steps, batch = prof.get("by_category_ms"), prof.get("steps"), record.get("batch")
    if not cats or not steps or not batch:
        return {}
    return {k: v / (steps * batch) for k, v in cats.items()}


def plot(records: list[dict], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = sorted((r for r in records if r.get("ok") and r.get("ms_per_sample")),
                 key=lambda r: -r["ms_per_sample"])
    if not ran:
        raise ValueError("no variant with a ms/sample figure to plot")
    profiled = [(r["variant"], per_sample_breakdown(r)) for r in ran]
    profiled = [(v, b) for v, b in profiled if b]
    fig, axes = plt.subplots(1, 2 if profiled else 1, figsize=(13 if profiled else 7, 0.6 * len(ran) + 3.2),
                             constrained_layout=True, squeeze=False)
    ax = axes[0][0]
    names = [r["variant"] for r in ran]
    values = [r["ms_per_sample"] for r in ran]
    colours = ["tab:green" if v <= GOAL_MS else "tab:blue" for v in values]
    ax.barh(names, values, color=colours)
    for y, v in enumerate(values):
        ax.text(v + 1, y, f"{v:.1f}", va="center", fontsize=9)
    for x, label, style in ((ROOFLINE_MS, f"practical roofline ~{ROOFLINE_MS:g}", "tab:olive"),
                            (GOAL_MS, f"goal {GOAL_MS:g}", "tab:red"),
                            (SPECFORGE_MS, f"SpecForge {SPECFORGE_MS:g}", "tab:gray")):
        ax.axvline(x, color=style, linestyle="--", linewidth=1, label=label)
    ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
    ax.set_xlabel("ms per sample (fwd + bwd + optimizer), lower is better")
    ax.set_xlim(0, max(max(values), SPECFORGE_MS) * 1.15)
    ax.set_title("step time per sample")
    if profiled:
        ax = axes[0][1]
        cats = sorted({c for _, b in profiled for c in b}, key=lambda c: -max(b.get(c, 0) for _, b in profiled))
        left = [0.0] * len(profiled)
        for c in cats:
            widths = [b.get(c, 0.0) for _, b in profiled]
            ax.barh([v for v, _ in profiled], widths, left=left, label=c)
            left = [a + w for a, w in zip(left, widths)]
        ax.axvline(GOAL_MS, color="tab:red", linestyle="--", linewidth=1)
        ax.set_xlabel("CUDA kernel ms per sample, by category")
        ax.set_title("where the time goes (profiled variants)")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
    if title:
        fig.suptitle(title)
    return save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="results.json files written by drafter_bench.py")
    ap.add_argument("-o", "--output", required=True, help="PNG to write")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    records: list[dict] = []
    for name in args.results:
        try:
            doc = json.loads(Path(name).read_text())
        except (OSError, ValueError) as e:
            print(f"plot_drafter: {name}: {e}", file=sys.stderr)
            return 2
        records.extend(doc if isinstance(doc, list) else [doc])
    try:
        print(plot(records, args.output, args.title))
    except ValueError as e:
        print(f"plot_drafter: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
