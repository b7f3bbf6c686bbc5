"""Plot a `python -m trainer.specdec --json` result: tokens/s with and without the drafter, and the
acceptance rate per block position.

    python benchmarks/plot_specdec.py docs/data/small-target-h200/specdec.json -o docs/specdec-h200.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _plot import save_png  # noqa: E402
from trainer.run.log import tau_text  # noqa: E402


def plot(doc: dict, out: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = doc["accept_rate_by_position"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [1, 2.4]})
    speeds = [doc["target_tokens_per_s"], doc["spec_tokens_per_s"]]
    a.bar(["target alone", f"with the drafter\n({doc['draft_layers']} layers)"], speeds, color=["#999", "#2a7"])
    for i, v in enumerate(speeds):
        a.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    a.set_ylabel("tokens/s (batch 1, greedy)")
    a.set_title(f"{doc['speedup']:.2f}x, lossless" if doc.get("lossless") else f"{doc['speedup']:.2f}x")
    b.bar(range(1, len(rates) + 1), [r or 0 for r in rates], color="#27a")
    prompts = f"{doc['prompts']} prompts"
    b.set_title(f"tau {tau_text(doc['tau'], doc.get('tau_ci95'), doc['rounds'], prompts, digits=2)}")
    b.set_xlabel("block position")
    b.set_ylabel("rounds with the draft accepted")
    b.set_xticks(range(1, len(rates) + 1))
    b.set_ylim(0, 1)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return save_png(fig, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", help="specdec.json")
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    try:
        doc = json.loads(Path(a.result).read_text())
        plot(doc, Path(a.out), a.title)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"plot_specdec: {a.result}: {e}", file=sys.stderr)
        return 2
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
