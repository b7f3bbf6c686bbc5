"""`report`: one PNG of a run's loss, acceptance length and throughput against step.

Pure rendering from the metric records (the trainer's JSON log lines); matplotlib's Agg backend,
so it works with no display. Returns the path; never prints.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

# The trainer's throughput keys, best first (trainer/run/log.py writes tokens_per_s and
# samples_per_s).
THROUGHPUT_KEYS = (("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s"))


def series(metrics: Sequence[dict]) -> dict:
    """Metric records -> {"loss": [(step, v)], "tau": [(step, v)], "throughput": [(step, v)],
    "throughput_label": str}. Records without a step, and null values, are skipped."""
    loss, tau, thr = [], [], []
    key, label = next(((k, lab) for k, lab in THROUGHPUT_KEYS
                       if any(m.get(k) is not None for m in metrics)), (None, "throughput"))
    for m in metrics:
        step = m.get("step")
        if not isinstance(step, (int, float)):
            continue
        if m.get("event") is None and isinstance(m.get("loss"), (int, float)):
            loss.append((step, m["loss"]))
        if isinstance(m.get("acceptance_length"), (int, float)):
            tau.append((step, m["acceptance_length"]))
        if key and isinstance(m.get(key), (int, float)):
            thr.append((step, m[key]))
    if not loss:   # a log with only summary records still has a last loss
        loss = [(m["step"], m["loss"]) for m in metrics
                if isinstance(m.get("step"), (int, float)) and isinstance(m.get("loss"), (int, float))]
    return {"loss": loss, "tau": tau, "throughput": thr, "throughput_label": label}


def render(metrics: Sequence[dict], out: str | Path, *, title: str = "") -> Path:
    """Write the PNG; returns its path. Raises ValueError when there is nothing to plot."""
    data = series(metrics)
    if not (data["loss"] or data["tau"] or data["throughput"]):
        raise ValueError("no metrics to plot (no JSON lines with a step)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True, constrained_layout=True)
    panels = [("loss", "loss", "tab:blue"), ("tau", "acceptance length (tau)", "tab:green"),
              ("throughput", data["throughput_label"], "tab:orange")]
    for ax, (key, label, colour) in zip(axes, panels):
        points = data[key]
        if points:
            xs, ys = zip(*points)
            style = "o-" if len(points) < 30 else "-"
            ax.plot(xs, ys, style, color=colour, markersize=4, linewidth=1.2)
            if key == "tau":
                ax.annotate(f"{ys[-1]:.3f}", (xs[-1], ys[-1]), textcoords="offset points",
                            xytext=(4, 4), fontsize=9)
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center",
                    color="grey")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    if title:
        fig.suptitle(title, fontsize=10)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
