"""fp8's proof on the small real target: held-out tau of bf16 and fp8 drafters, 3 seeds each, and
their loss curves plotted together, from the `tau` stage of scripts/fp8_check.sh.

    python benchmarks/fp8_tau.py OUT/tau -o docs/fp8-tau-h200.png

Reads specdec-PRECISION-sSEED.json (tau on the held-out prompts) and metrics-PRECISION-sSEED.jsonl
(training loss) of each run; prints a markdown table and the verdict. The rule (docs/precision.md):
fp8 keeps tau when the mean of its seeds lies within bf16's run-to-run spread, i.e. its distance from
bf16's mean is at most bf16's range over the same seeds (max - min); only then may it become the
default on sm90+. Exit 2 with one line when the folder holds no such runs.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import _runs as runs  # noqa: E402
from _plot import save_png  # noqa: E402
from trainer.run.config import PRECISIONS  # noqa: E402
from trainer.run.log import tau_text  # noqa: E402

RUN = re.compile(rf"^(?P<precision>{'|'.join(map(re.escape, PRECISIONS))})-s(?P<seed>\d+)$")
SEEDS = 3   # seeds per precision the proof takes; fewer give a preliminary verdict
COLORS = {"bf16": "#27a", "fp8": "#d62", "fp8-rowwise": "#2a7", "fp8-lmhead": "#a3c"}


def load(folder: Path) -> tuple[dict, dict]:
    """{(precision, seed): specdec document}, {(precision, seed): [(step, loss)]} of the runs named
    PRECISION-sSEED."""
    def keyed(found: dict) -> dict:
        return {(m["precision"], int(m["seed"])): v for name, v in found.items() if (m := RUN.match(name))}

    docs, curves = runs.load(folder)
    return keyed(docs), keyed(curves)


def verdict(docs: dict, precision: str) -> tuple[str, dict]:
    """The rule applied to `precision` against bf16: (one line, figures)."""
    base = [d["tau"] for (p, _), d in sorted(docs.items()) if p == "bf16"]
    new = [d["tau"] for (p, _), d in sorted(docs.items()) if p == precision]
    if len(base) < 2 or not new:
        return f"{precision}: no verdict (bf16 {len(base)} seed(s), {precision} {len(new)}: bf16 needs 2 or more)", {}
    spread = max(base) - min(base)
    diff = statistics.mean(new) - statistics.mean(base)
    figures = {"bf16_mean": statistics.mean(base), "bf16_spread": spread, "mean": statistics.mean(new),
               "difference": diff, "seeds": [len(base), len(new)]}
    keeps = abs(diff) <= spread
    short = "" if min(len(base), len(new)) >= SEEDS else \
        f" (PRELIMINARY: {len(base)} and {len(new)} seed(s); the proof takes {SEEDS} each)"
    figures["complete"] = not short
    return (f"{precision}: held-out tau {statistics.mean(new):.3f} vs bf16 {statistics.mean(base):.3f} "
            f"({diff:+.3f}; bf16's spread over {len(base)} seeds {spread:.3f}): "
            + ("KEEPS tau (within bf16's spread)" if keeps else f"does NOT keep tau (costs {-diff:.3f})")
            + short), figures


def table(docs: dict, curves: dict) -> str:
    lines = ["| precision | seed | held-out tau | last training loss |", "| --- | --- | --- | --- |"]
    for (p, seed), d in sorted(docs.items()):
        last = curves.get((p, seed)) or []
        lines.append(f"| {p} | {seed} | {tau_text(d['tau'], d.get('tau_ci95'), d.get('rounds'))} | "
                     + (f"{last[-1][1]:.4f} |" if last else "|"))
    return "\n".join(lines)


def plot(docs: dict, curves: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for (p, seed), pts in sorted(curves.items()):
        if pts:
            steps, loss = zip(*pts)
            a.plot(steps, loss, color=COLORS[p], ls="-" if p == "bf16" else "--", lw=1,
                   marker="." if len(steps) < 20 else None, label=f"{p} seed {seed}")
    a.set_xlabel("step")
    a.set_ylabel("training loss")
    a.set_title("training loss, same data and steps")
    a.legend(fontsize=7)
    runs = sorted(docs)
    b.scatter(range(len(runs)), [docs[r]["tau"] for r in runs], color=[COLORS[p] for p, _ in runs])
    b.set_xticks(range(len(runs)), [f"{p}\nseed {s}" for p, s in runs], fontsize=7)
    b.set_ylabel("tau on held-out modules")
    b.set_title("held-out tau per run")
    fig.tight_layout()
    return save_png(fig, out)


def report(folder: Path, png: str | None, figures: str | None) -> str:
    """The table and a verdict line per fp8 recipe (and the plot, the figures where asked for)."""
    docs, curves = load(folder)
    if not docs:
        raise ValueError("no specdec-PRECISION-sSEED.json in it")
    found = {p: verdict(docs, p) for p in sorted({p for p, _ in docs} - {"bf16"})}
    if figures:
        Path(figures).write_text(json.dumps({p: fig for p, (_, fig) in found.items()}, indent=1))
    lines = [table(docs, curves), ""] + [line for line, _ in found.values()]
    return "\n".join(lines + ([str(plot(docs, curves, Path(png)))] if png else []))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="the tau stage's folder: OUT/tau of scripts/fp8_check.sh")
    ap.add_argument("-o", "--out", help="also write the plot here (PNG)")
    ap.add_argument("--json", help="also write the verdicts' figures here")
    a = ap.parse_args(argv)
    try:
        print(report(Path(a.folder), a.out, a.json))
        return 0
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"fp8_tau: {a.folder}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
