"""The decode engines side by side: a table and a plot from scripts/decode_engines_gpu.sh's output folder
(its specdec-LABEL.json documents, each with every prompt's rounds and timings).

    python benchmarks/decode_engines.py OUT [-o docs/decode-engines-h200.png] [--json]

For each document: the engine and dtype, prompts, the target alone's ms/token, tokens/s alone and with
the drafter, the speedup with its per-prompt bootstrap interval and median, tau with its interval, a
round's cost by part, the model's speedup (tau x ms/token / ms/round) against the measured one, the tau
that 2x would need, each decode's prompt forward (a fixed cost per prompt the model leaves out), and the
agreement (prompts equal; the largest margin where they differ). Where the
eager document covers fewer prompts, the graphs figures are recomputed on those same prompts too
(`graphs-...@N`), so the two engines are compared on identical text.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _plot import save_png  # noqa: E402
from trainer.run.stats import cluster_bootstrap  # noqa: E402


def figures(doc: dict, n: int | None = None) -> dict:
    """The row of one document, on its first n prompts (all by default)."""
    rows = doc["per_prompt"][:n]
    boot = cluster_bootstrap([r["rounds"] for r in rows], tokens=[len(r["tokens"]) for r in rows],
                             spec_s=[r["spec_s"] for r in rows], alone_s=[r["alone_s"] for r in rows],
                             tokens_alone=[r["alone_tokens"] for r in rows], seed=0)
    spec_tok, spec_s = sum(len(r["tokens"]) for r in rows), sum(r["spec_s"] for r in rows)
    alone_tok, alone_s = sum(r["alone_tokens"] for r in rows), sum(r["alone_s"] for r in rows)
    differ = [r for r in rows if not r.get("equal", True)]
    if all("spec_prefill_s" in r for r in rows):
        prefill = [1e3 * sum(r[k] for r in rows) / len(rows) for k in ("spec_prefill_s", "alone_prefill_s")]
    elif n is None:  # documents made before the per-prompt prefill: what the rounds and steps leave of the totals
        t_round, t_token = doc["ms_per_round"]["all"], doc["target_ms_per_token"]
        prefill = [(1e3 * spec_s - sum(len(r["rounds"]) for r in rows) * t_round) / len(rows),
                   (1e3 * alone_s - (alone_tok - len(rows)) * t_token) / len(rows)]
    else:
        prefill = None
    return {"engine": doc["engine"], "dtype": doc.get("dtype"), "graphed": doc.get("graphed"), "prompts": len(rows),
            "mode": (doc.get("mode") or {}).get("spec"),
            "target_ms_per_token": 1e3 * alone_s / alone_tok, "alone_tokens_per_s": alone_tok / alone_s,
            "spec_tokens_per_s": spec_tok / spec_s, "speedup": boot["speedup"], "speedup_ci95": boot["speedup_ci95"],
            "speedup_median": boot["speedup_median"], "tau": boot["tau"], "tau_ci95": boot["tau_ci95"],
            "ms_per_round": doc["ms_per_round"] if n is None else None,
            # specdec's model of the round costs: "model" in its own documents, "cost_model" in bench-decode's
            "model": cost if isinstance(cost := doc.get("cost_model", doc.get("model")), dict) and n is None else None,
            "prefill_ms_per_prompt": prefill, "equal": len(rows) - len(differ),
            "margins_where_differ": sorted(round(r["margin"], 4) for r in differ if r.get("margin") is not None)}


def table(rows: dict[str, dict]) -> str:
    head = ("| run | engine, dtype | prompts | target alone ms/token | tokens/s alone -> with | speedup (95%, median) "
            "| tau (95%) | ms/round: verify + draft + extend + host = all | model speedup, tau for 2x "
            "| prefill ms/prompt: with / alone | equal (largest margin where not; exact ties) |")
    out = [head, "|" + " --- |" * 11]
    for label, f in rows.items():
        ci, tci = f["speedup_ci95"] or (float("nan"),) * 2, f["tau_ci95"] or (float("nan"),) * 2
        margins = f["margins_where_differ"]
        prefill = " / ".join(f"{x:.1f}" for x in f["prefill_ms_per_prompt"] or ())
        m = f["ms_per_round"]
        parts = (f"{m['verify']:.2f} + {m['draft']:.2f} + {m['extend']:.2f} + {m['host']:.2f} = {m['all']:.2f}"
                 if m else "")
        # the speedup the model gives: predicted from the steps alone, or (documents before 2026-12-05)
        # recomputed from the decode's own totals
        said = ((f["model"] or {}).get("predicted") or {}).get("speedup") or (f["model"] or {}).get("speedup")
        model = f"{said:.2f}x, {f['model']['tau_for_2x']:.2f}" if said else ""
        # the mode the document names (graphs+compile since 2026-12-05), else the engine and whether it captured
        engine = f["mode"] or f"{f['engine']}{' (graphs captured)' if f['graphed'] else ''}"
        out.append(f"| {label} | {engine}, {f['dtype']} "
                   f"| {f['prompts']} | {f['target_ms_per_token']:.3f} "
                   f"| {f['alone_tokens_per_s']:.1f} -> {f['spec_tokens_per_s']:.1f} "
                   f"| **{f['speedup']:.2f}x** ({ci[0]:.2f}-{ci[1]:.2f}, {f['speedup_median']:.2f}) "
                   f"| {f['tau']:.2f} ({tci[0]:.2f}-{tci[1]:.2f}) | {parts} | {model} "
                   f"| {prefill} "
                   f"| {f['equal']}/{f['prompts']}"
                   + (f" ({max(margins)}; {margins.count(0.0)} ties)" if margins else "") + " |")
    return "\n".join(out)


def bar_scale(ms: list[float]) -> str:
    """The ms-per-token axis: log where the bars span 5x or more (eager beside graphs: ~17 against ~2 ms),
    else linear from zero, where a log axis would start near the shortest bar and overstate the gaps."""
    return "log" if max(ms) >= 5 * min(ms) else "linear"


def plot(docs: dict[str, dict], rows: dict[str, dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = list(rows)
    alone = [rows[k]["target_ms_per_token"] for k in labels]
    spec = [1e3 / rows[k]["spec_tokens_per_s"] for k in labels]
    x = range(len(labels))
    a.bar([i - 0.2 for i in x], alone, 0.4, label="target alone", color="#999")
    a.bar([i + 0.2 for i in x], spec, 0.4, label="with the drafter", color="#2a7")
    scale = bar_scale(alone + spec)
    a.set_yscale(scale)
    a.set_xticks(list(x), [f"{k}\n{rows[k]['speedup']:.2f}x" for k in labels], fontsize=8)
    a.set_ylabel("ms per token" + (" (log)" if scale == "log" else ""))
    a.set_title("a token's cost, batch 1")
    a.legend(fontsize=8)
    for k, doc in docs.items():
        sp = sorted(r["alone_s"] / r["alone_tokens"] / (r["spec_s"] / len(r["tokens"])) for r in doc["per_prompt"])
        b.plot(sp, [i / len(sp) for i in range(1, len(sp) + 1)], label=f"{k} ({len(sp)} prompts)")
    b.axvline(1.0, color="#c33", lw=0.8)
    b.set_xlabel("per-prompt speedup")
    b.set_ylabel("share of prompts")
    b.set_title("per-prompt speedup (cumulative)")
    b.legend(fontsize=8)
    fig.tight_layout()
    return save_png(fig, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/decode_engines.py", description=__doc__.splitlines()[0])
    p.add_argument("folder", help="scripts/decode_engines_gpu.sh's OUT (specdec-*.json)")
    p.add_argument("-o", "--out", help="write the plot here (PNG)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    a = p.parse_args(argv)
    docs = {}
    for f in sorted(Path(a.folder).glob("specdec-*.json")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            print(f"decode_engines.py: {f}: {e}", file=sys.stderr)
            return 2
        if "per_prompt" not in doc or doc.get("speedup") is None:
            print(f"decode_engines.py: {f}: no per_prompt records or no baseline (made before the graphs engine?)",
                  file=sys.stderr)
            return 2
        docs[f.stem.removeprefix("specdec-")] = doc
    if not docs:
        print(f"decode_engines.py: no specdec-*.json in {a.folder}", file=sys.stderr)
        return 2
    rows = {k: figures(d) for k, d in docs.items()}
    fewest = min(len(d["per_prompt"]) for d in docs.values())
    for k, d in docs.items():  # the engines on identical prompts: the longer runs cut to the shortest
        if len(d["per_prompt"]) > fewest:
            rows[f"{k}@{fewest}"] = figures(d, fewest)
    print(json.dumps(rows, indent=2) if a.json else table(rows))
    if a.out:
        print(f"plot: {plot(docs, {k: v for k, v in rows.items() if '@' not in k}, Path(a.out))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
