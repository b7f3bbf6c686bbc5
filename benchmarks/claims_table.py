"""The paper's claims at the small target's scale: the table and the plot from one run of
scripts/small_target_claims.sh.

    python benchmarks/claims_table.py docs/data/small-target-claims-h200 -o docs/claims-h200.png

Reads specdec-NAME.json (tau on the held-out prompts) and metrics-NAME.jsonl (training loss) of each
drafter; prints the claims table as markdown. A claim holds when the drafter it favours has the
higher tau and the two 95% intervals do not overlap; "within noise" when the order is the claimed
one but the intervals overlap; "did not hold" otherwise.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _plot import save_png  # noqa: E402
from _runs import load  # noqa: E402
from trainer.run.log import tau_text  # noqa: E402

# (claim, the drafter it favours, the one it beats)
CLAIMS = (
    ("a trained drafter drafts better than an untrained one", "base", "untrained"),
    ("block 16 beats block 8", "base", "block8"),
    ("the decaying loss weights beat uniform weights", "base", "uniform"),
    ("3 draft layers beat 1 at equal steps", "base", "layers1"),
    ("5 draft layers beat 3 at equal steps", "layers5", "base"),
    ("512 anchors beat 64 at equal target forwards", "base", "anchors64"),
)
LABELS = {"main": "main (long)", "base": "baseline", "untrained": "untrained", "block8": "block 8",
          "uniform": "uniform weights", "layers1": "1 layer", "layers5": "5 layers", "anchors64": "64 anchors"}


def verdict(better: dict, worse: dict) -> str:
    if better["tau"] <= worse["tau"]:
        return "did not hold"
    a, b = better.get("tau_ci95"), worse.get("tau_ci95")
    return "held" if a and b and a[0] > b[1] else "within noise"


def table(docs: dict) -> str:
    lines = ["| claim | tau, favoured (95%) | tau, other (95%) | held? |", "| --- | --- | --- | --- |"]
    for claim, good, bad in CLAIMS:
        if good in docs and bad in docs:
            g, b = (tau_text(docs[n]["tau"], docs[n].get("tau_ci95"), digits=2) for n in (good, bad))
            held = verdict(docs[good], docs[bad])
            lines.append(f"| {claim} | {LABELS[good]}: {g} | {LABELS[bad]}: {b} | **{held}** |")
        else:
            missing = " and ".join(n for n in (good, bad) if n not in docs)
            lines.append(f"| {claim} | | | not run ({missing} missing) |")
    return "\n".join(lines)


def plot(docs: dict, curves: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in LABELS if n in docs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    taus = [docs[n]["tau"] for n in names]
    err = [[t - (docs[n].get("tau_ci95") or (t, t))[0] for n, t in zip(names, taus)],
           [(docs[n].get("tau_ci95") or (t, t))[1] - t for n, t in zip(names, taus)]]
    a.bar(range(len(names)), taus, yerr=err, capsize=3,
          color=["#2a7" if n == "main" else "#999" if n == "untrained" else "#27a" for n in names])
    a.set_xticks(range(len(names)), [LABELS[n] for n in names], rotation=30, ha="right")
    a.set_ylabel("tau on held-out modules (95%)")
    a.set_title("tau per drafter")
    for n, pts in curves.items():  # the variants' curves (the main run's is longer and its own)
        if pts and n in LABELS and n != "main":
            steps, loss = zip(*pts)
            b.plot(steps, loss, label=LABELS[n], lw=1)
    b.set_xlabel("step")
    b.set_ylabel("training loss")
    b.set_title("training loss (uniform weights: another sum)")
    b.legend(fontsize=7)
    fig.tight_layout()
    return save_png(fig, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="the OUT folder of scripts/small_target_claims.sh")
    p.add_argument("-o", "--out", help="also write the plot here (PNG)")
    a = p.parse_args(argv)
    try:
        docs, curves = load(Path(a.folder))
        if not docs:
            raise ValueError("no specdec-*.json in it")
        print(table(docs))
        for n in ("main", *(k for k in docs if k.endswith("-speed"))):
            if n in docs:
                d = docs[n]
                speed = f", {d['speedup']:.2f}x" if d.get("speedup") else ""
                tau = tau_text(d["tau"], d.get("tau_ci95"), d["rounds"], f"{d['prompts']} prompts", digits=2)
                print(f"\n{n}: tau {tau}{speed}")
        if a.out:
            print(plot(docs, curves, Path(a.out)))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"claims_table: {a.folder}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
