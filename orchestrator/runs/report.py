"""`report`: one PNG of a run's loss, acceptance length and throughput against step, and the last
eval's acceptance rate per block position; the last eval's tau with its rounds and 95% interval.

Pure rendering from the metric records (the trainer's JSON log lines: trainer/run/log.py; an eval
record holds acceptance_length, rounds, tau_ci95 and accept_rate_by_position); matplotlib's Agg
backend, so it works with no display. Returns the path or the numbers; never prints.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

# The trainer's throughput keys, best first (trainer/run/log.py writes tokens_per_s and
# samples_per_s).
THROUGHPUT_KEYS = (("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s"))


def series(metrics: Sequence[dict]) -> dict:
    """Metric records -> {"loss": [(step, v)], "heldout_loss": [(step, v)], "tau": [(step, v)],
    "throughput": [(step, v)], "throughput_label": str}. Records without a step, and null values, are
    skipped."""
    loss, thr = [], []
    key, label = next(((k, lab) for k, lab in THROUGHPUT_KEYS
                       if any(m.get(k) is not None for m in metrics)), (None, "throughput"))
    for m in metrics:
        step = m.get("step")
        if not isinstance(step, (int, float)):
            continue
        if m.get("event") is None and isinstance(m.get("loss"), (int, float)):
            loss.append((step, m["loss"]))
        if key and isinstance(m.get(key), (int, float)):
            thr.append((step, m[key]))
    if not loss:   # a log with only summary records still has a last loss
        loss = [(m["step"], m["loss"]) for m in metrics
                if isinstance(m.get("step"), (int, float)) and isinstance(m.get("loss"), (int, float))]
    measured = evals(metrics)      # each eval's step once, a resume's re-measure the one kept
    tau = [(e["step"], e["tau"]) for e in measured]
    held = [(e["step"], e["heldout_loss"]) for e in measured if e.get("heldout_loss") is not None]
    return {"loss": loss, "heldout_loss": held, "tau": tau, "throughput": thr, "throughput_label": label}


def last_eval(metrics: Sequence[dict]) -> dict | None:
    """The last record with a tau (an eval, or the run's end): {"step", "tau", "rounds", "ci95",
    "by_position"}; rounds, ci95 and by_position are None / [] where the trainer logged none."""
    m = next((m for m in reversed(metrics) if isinstance(m.get("acceptance_length"), (int, float))), None)
    if m is None:
        return None
    ci = m.get("tau_ci95")
    return {"step": m.get("step"), "tau": m["acceptance_length"], "rounds": m.get("rounds"),
            "ci95": ci if isinstance(ci, list) and len(ci) == 2 and None not in ci else None,
            "by_position": list(m.get("accept_rate_by_position") or [])}


def evals(metrics: Sequence[dict]) -> list[dict]:
    """Every measured tau in step order, a resumed run's re-measured steps once (the later wins):
    [{"step", "tau", "heldout_loss"}] (the loss on the held-out rows, None where the trainer logged
    none); step 0 is the untrained baseline (the trainer's --eval-at-start, on by default)."""
    by_step: dict = {}
    for m in metrics:
        if isinstance(m.get("step"), (int, float)) and isinstance(m.get("acceptance_length"), (int, float)):
            held = m.get("heldout_loss")
            by_step[m["step"]] = {"step": m["step"], "tau": m["acceptance_length"],
                                  "heldout_loss": held if isinstance(held, (int, float)) else None}
    return [by_step[s] for s in sorted(by_step)]


def resumes(metrics: Sequence[dict]) -> list:
    """The steps a run was resumed from (the trainer's `resume` records), in order."""
    return [m["step"] for m in metrics if m.get("event") == "resume" and isinstance(m.get("step"), (int, float))]


def summary_lines(metrics: Sequence[dict]) -> list[str]:
    """What `report` prints under the PNG's path: the tau measured at each eval from the untrained
    baseline on, the last eval's interval and acceptance by position, and the resumes."""
    lines = []
    taus = evals(metrics)
    if len(taus) > 1 or (taus and taus[0]["step"] == 0):
        first = taus[0]
        said = ("untrained " if first["step"] == 0 else f"at step {first['step']} ") + f"{first['tau']:.3f}"
        lines.append("tau at each eval: " + said + "".join(f" -> {e['tau']:.3f} (step {e['step']})"
                                                          for e in taus[1:]))
    held = [e for e in taus if e["heldout_loss"] is not None]
    if held:
        first = held[0]
        said = ("untrained " if first["step"] == 0 else f"at step {first['step']} ") + f"{first['heldout_loss']:.4f}"
        lines.append("held-out loss at each eval: " + said + "".join(
            f" -> {e['heldout_loss']:.4f} (step {e['step']})" for e in held[1:]))
    ev = last_eval(metrics)
    if ev:
        lines.append(eval_line(ev))
    if resumes(metrics):
        lines.append("resumed from step " + ", ".join(str(s) for s in resumes(metrics)))
    return lines


def eval_line(ev: dict) -> str:
    """`tau 2.345 (95% 2.201-2.489, 812 rounds), at step 200; acceptance by block position 1..3: ...`"""
    from trainer.controller_view import tau_text     # the trainer's own way of writing it (stdlib only)

    line = f"tau {tau_text(ev['tau'], ev['ci95'], ev['rounds'])}, at step {ev['step']}"
    if ev["by_position"]:
        rates = " ".join("-" if r is None else f"{r:.2f}" for r in ev["by_position"])
        line += f"; acceptance by block position 1..{len(ev['by_position'])}: {rates}"
    return line


def figure(metrics: Sequence[dict], *, title: str = ""):
    """The report's matplotlib Figure: loss, tau and throughput against step, and a bar per block
    position of the last eval's acceptance rate. Raises ValueError when there is nothing to plot."""
    data = series(metrics)
    if not (data["loss"] or data["tau"] or data["throughput"]):
        raise ValueError("no metrics to plot (no JSON lines with a step)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(8, 12), constrained_layout=True,
                             gridspec_kw={"height_ratios": [1, 1, 1, 0.9]})
    for ax in axes[1:3]:   # the step panels share their x axis; the positions panel has its own
        ax.sharex(axes[0])
    for ax in axes[:2]:
        ax.tick_params(labelbottom=False)
    panels = [("loss", "loss", "tab:blue"), ("tau", "acceptance length (tau)", "tab:green"),
              ("throughput", data["throughput_label"], "tab:orange")]
    ev = last_eval(metrics)
    taus = evals(metrics)
    for ax, (key, label, colour) in zip(axes, panels):
        for i, s in enumerate(resumes(metrics)):    # where a stopped run continued
            ax.axvline(s, color="grey", linestyle="--", linewidth=0.8, label="resumed" if i == 0 else None)
        points = data[key]
        if points:
            xs, ys = zip(*points)
            style = "o-" if len(points) < 30 else "-"
            ax.plot(xs, ys, style, color=colour, markersize=4, linewidth=1.2,
                    label="training batches" if key == "loss" and data["heldout_loss"] else None)
            if key == "loss" and data["heldout_loss"]:
                hx, hy = zip(*data["heldout_loss"])
                ax.plot(hx, hy, "s:", color="tab:red", markersize=4, linewidth=1, label="held-out rows, at each eval")
                ax.legend(loc="best", fontsize=8)
            if key == "tau":
                if ev and ev["step"] is not None and ev["ci95"]:
                    ci = ev["ci95"]
                    ax.errorbar([ev["step"]], [ev["tau"]], yerr=[[ev["tau"] - ci[0]], [ci[1] - ev["tau"]]],
                                fmt="none", ecolor=colour, capsize=4)
                note = f"{ys[-1]:.3f}" + (f" ({ev['rounds']} rounds)" if ev and ev["rounds"] is not None else "")
                ax.annotate(note, (xs[-1], ys[-1]), textcoords="offset points", xytext=(4, 4), fontsize=9)
                if taus and taus[0]["step"] == 0:
                    ax.annotate(f"untrained {taus[0]['tau']:.3f}", (0, taus[0]["tau"]), textcoords="offset points",
                                xytext=(4, -12), fontsize=9, color="grey")
            if resumes(metrics):
                ax.legend(loc="best", fontsize=8)
        else:
            _no_data(ax)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[2].set_xlabel("step")
    _by_position(axes[3], ev)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _by_position(ax, ev: dict | None) -> None:
    """Bars: the share of rounds that accepted block position k (1..B-1), at the last eval."""
    if not ev or not ev["by_position"]:
        _no_data(ax)
    else:
        rates = ev["by_position"]
        ks = range(1, len(rates) + 1)
        ax.bar(ks, [r or 0.0 for r in rates], color="tab:green", alpha=0.8)
        ax.set_xticks(list(ks))
        ax.set_ylim(0, 1.05)
        ax.set_title(eval_line({**ev, "by_position": []}), fontsize=9)
    ax.set_xlabel("block position")
    ax.set_ylabel("acceptance rate")
    ax.grid(True, axis="y", alpha=0.3)


def _no_data(ax) -> None:
    ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")


def render(metrics: Sequence[dict], out: str | Path, *, title: str = "") -> Path:
    """Write the PNG; returns its path. Raises ValueError when there is nothing to plot."""
    import matplotlib.pyplot as plt

    fig = figure(metrics, title=title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
