"""Plot train_step_bench results: ms per sample of the whole step, target forward and drafter step
stacked, one bar per (results file, target mode); per-GPU cost for multi-GPU runs.

    .venv/bin/python benchmarks/plot_train_step.py "docs/data/train-step-h200-x1.json=before" \\
        "docs/data/train-step-h200-compiled-target.json=after" "docs/data/train-step-h200-x2.json=before" \\
        "docs/data/train-step-h200-x2-nccl.json=after" -o docs/train-step-h200.png

Each argument is FILE[@MODE,MODE...][=LABEL] (default: every mode of the file; label: the file's
stem), so that one plot can take a few cases from each of several runs.

A run on G GPUs shows G x its ms/sample of the global batch: the GPU time one sample costs, which
equals the one-GPU figure when scaling is perfect.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _plot import save_png  # noqa: E402

GOAL_MS = 80.0          # the goal for the whole step on one H200 (docs/benchmarks.md)
SPECFORGE_MS = 112.8    # SpecForge 0.2.0's drafter step alone, same GPU and shape


def bars(results: list[tuple[str, dict]], only: list[list[str] | None] | None = None) -> list[dict]:
    """[(label, results.json)] -> one bar per target mode (those in only[i], if given): label,
    target and drafter GPU-ms/sample."""
    out = []
    for i, (label, res) in enumerate(results):
        gpus = max(1, int(res.get("gpus") or 1))
        modes = res.get("modes") or {}
        keep = (only or [None] * len(results))[i]
        for mode, m in ((k, modes[k]) for k in (keep or modes) if k in modes):
            out.append({"label": f"{label}\n{mode}" + (f"\n({gpus} GPUs, per GPU)" if gpus > 1 else ""),
                        "target": m["features_ms_per_sample"] * gpus,
                        "drafter": m["drafter_ms_per_sample"] * gpus,
                        "total": m["total_ms_per_sample"] * gpus})
    return out


def plot(results: list[tuple[str, dict]], out: Path, title: str, only: list[list[str] | None] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = bars(results, only)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(rows) + 2), 4.8))
    x = range(len(rows))
    ax.bar(x, [r["target"] for r in rows], label="target forward", color="#7f9fbf")
    ax.bar(x, [r["drafter"] for r in rows], bottom=[r["target"] for r in rows], label="drafter step",
           color="#d98c5f")
    for i, r in enumerate(rows):
        ax.text(i, r["total"] + 1, f"{r['total']:.1f}", ha="center", fontsize=9)
    ax.axhline(GOAL_MS, color="green", linestyle="--", linewidth=1, label=f"goal, whole step ({GOAL_MS:g})")
    ax.axhline(SPECFORGE_MS, color="grey", linestyle=":", linewidth=1,
               label=f"SpecForge 0.2.0, drafter step only ({SPECFORGE_MS:g})")
    ax.set_xticks(list(x), [r["label"] for r in rows], fontsize=8)
    ax.set_ylabel("GPU ms per sample")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, max([SPECFORGE_MS] + [r["total"] for r in rows]) * 1.3)
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.tight_layout()
    return save_png(fig, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="train_step_bench results.json files, FILE or FILE=LABEL")
    ap.add_argument("-o", "--out", default="train-step.png")
    ap.add_argument("--title", default="whole train step, Qwen3-8B shape, batch 2 x 768 per GPU")
    args = ap.parse_args(argv)
    results, only = [], []
    for arg in args.results:
        spec, _, label = arg.partition("=")
        p, _, modes = spec.partition("@")
        try:
            res = json.loads(Path(p).read_text())
        except (OSError, ValueError) as e:
            print(f"plot_train_step: {p}: {e}", file=sys.stderr)
            return 2
        want = modes.split(",") if modes else None
        missing = [m for m in want or () if m not in (res.get("modes") or {})]
        if missing:
            print(f"plot_train_step: {p}: no mode {missing[0]!r} (has {', '.join(res.get('modes') or {})})",
                  file=sys.stderr)
            return 2
        results.append((label or Path(p).stem, res))
        only.append(want)
    print(plot(results, Path(args.out), args.title, only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
