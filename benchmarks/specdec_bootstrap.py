"""Speculative decoding's tau and speedup with per-prompt (cluster) bootstrap intervals, from a run's
saved output.

    python benchmarks/specdec_bootstrap.py SPECDEC.json              # a document with "per_prompt"
    python benchmarks/specdec_bootstrap.py SPECDEC.log --drop-tau 10 # the live lines; also without tau >= 10

Reads either `python -m trainer.specdec --json`'s document, whose "per_prompt" list holds each
prompt's "rounds" (tokens per round), "tokens", "alone_s" and "spec_s" (optional "tokens_alone"),
or the stderr log of a run that saved no such list, whose lines read
`specdec: prompt I/N: L tokens, tau T, A -> S tokens/s`. Those lines count the prefill's token as
accepted (T = L / rounds, where the rounds produced L - 1 tokens), so the rounds are recovered as
round(L / T) and checked against T; the seconds are L / A and L / S (the rates' one decimal costs
under 0.2% on a prompt). A log holds each prompt's totals, not its rounds one by one; the bootstrap
needs no more (trainer/run/stats.py). --drop-tau says how much the easiest prompts carry: the same
figures without the prompts whose tau is at least that.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainer.run.log import tau_text  # noqa: E402
from trainer.run.stats import RESAMPLES, cluster_bootstrap  # noqa: E402

LINE = re.compile(r"specdec: prompt (\d+)/\d+: (\d+) tokens, tau ([\d.]+), (?:([\d.]+) -> )?([\d.]+) tokens/s")
# specdec's lines since the graphs engine: the rounds counted, tau over them alone (the prefill's token not in it)
ROUNDS_LINE = re.compile(r"specdec: prompt (\d+)/\d+: (\d+) tokens, (\d+) rounds, [^,]+, (?:([\d.]+) -> )?([\d.]+) "
                         r"tokens/s")


def read_log(text: str) -> list[dict]:
    """Per prompt {"rounds", "tokens", "alone_s", "spec_s"} (alone_s None without a baseline) from
    the live lines of a run before the per-prompt tau was corrected; ValueError where a line's tau
    does not fit a whole number of rounds (a log of another format)."""
    out = []
    for m in ROUNDS_LINE.finditer(text):  # the current format: the rounds are given
        length, n, alone, spec = int(m[2]), int(m[3]), m[4], float(m[5])
        q, r = divmod(length - 1, n) if n else (0, 0)
        out.append({"rounds": [q + 1] * r + [q] * (n - r), "tokens": length, "spec_s": length / spec,
                    "alone_s": length / float(alone) if alone else None})
    if out:
        return out
    for m in LINE.finditer(text):
        i, length, tau, alone, spec = int(m[1]), int(m[2]), m[3], m[4], float(m[5])
        n = round(length / float(tau)) if length > 1 else 0  # one token: the prefill's alone, no round
        if f"{length / max(1, n):.{len(tau.split('.')[1])}f}" != tau:
            raise ValueError(f"prompt {i}: {length} tokens at tau {tau} is no whole number of rounds with the "
                             f"prefill's token counted; not a log this reads")
        q, r = divmod(length - 1, n) if n else (0, 0)
        out.append({"rounds": [q + 1] * r + [q] * (n - r),  # the prompt's sum and count: all the bootstrap uses
                    "tokens": length, "spec_s": length / spec, "alone_s": length / float(alone) if alone else None})
    return out


def read_doc(doc: dict) -> list[dict]:
    """The per-prompt records of a specdec document; ValueError when it has none."""
    rows = doc.get("per_prompt")
    if not isinstance(rows, list):
        raise ValueError("no \"per_prompt\" list (a document written before specdec saved each prompt's rounds; "
                         "give its log instead)")
    return rows


def figures(prompts: list[dict], *, drop_tau: float | None = None, resamples: int = RESAMPLES,
            seed: int = 0) -> dict:
    """cluster_bootstrap's document over the prompts (those of tau >= drop_tau left out, counted in
    "dropped"); the speedup only when every prompt has both timings."""
    def tau(p):
        return sum(p["rounds"]) / len(p["rounds"]) if p["rounds"] else None

    kept = [p for p in prompts if drop_tau is None or tau(p) is None or tau(p) < drop_tau]
    timed = all(p.get("alone_s") is not None and p.get("spec_s") is not None for p in kept)
    doc = cluster_bootstrap(
        [p["rounds"] for p in kept], resamples=resamples, seed=seed,
        **({"alone_s": [p["alone_s"] for p in kept], "spec_s": [p["spec_s"] for p in kept],
            "tokens": [p["tokens"] for p in kept],
            "tokens_alone": [p.get("tokens_alone", p["tokens"]) for p in kept]} if timed else {}))
    return {**doc, "dropped": len(prompts) - len(kept), "drop_tau": drop_tau}


def render(doc: dict) -> str:
    """Two lines: tau with its interval, rounds and prompts; the speedup with its interval, median and mean."""
    head = f"without the {doc['dropped']} prompts of tau >= {doc['drop_tau']:g}: " if doc["drop_tau"] else ""
    boot = f"per-prompt bootstrap, {doc['resamples']} resamples, seed {doc['seed']}"
    if doc["tau"] is None:
        return f"{head}no rounds in {doc['prompts']} prompts"
    prompts = f"{doc['prompts']} prompts"
    lines = [f"{head}tau {tau_text(doc['tau'], doc['tau_ci95'], doc['rounds'], prompts, boot, digits=2)}"]
    if doc["speedup"] is not None:
        ci = f"95% {doc['speedup_ci95'][0]:.2f}-{doc['speedup_ci95'][1]:.2f}x, " if doc["speedup_ci95"] else ""
        lines.append(f"  speedup {doc['speedup']:.2f}x ({ci}{prompts}); per prompt: median "
                     f"{doc['speedup_median']:.2f}x, mean {doc['speedup_mean']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help="a specdec JSON document with per_prompt, or a specdec log")
    ap.add_argument("--drop-tau", type=float, help="also: the figures without the prompts of tau >= this")
    ap.add_argument("--resamples", type=int, default=RESAMPLES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the documents as JSON lines instead")
    a = ap.parse_args(argv)
    try:
        text = Path(a.file).read_text()
        try:
            prompts = read_doc(json.loads(text))
        except json.JSONDecodeError:
            prompts = read_log(text)
        if not prompts:
            raise ValueError("no per-prompt lines or records")
    except (OSError, ValueError) as e:
        print(f"specdec_bootstrap: error: {a.file}: {e}", file=sys.stderr)
        return 2
    docs = [figures(prompts, resamples=a.resamples, seed=a.seed)]
    if a.drop_tau is not None:
        docs.append(figures(prompts, drop_tau=a.drop_tau, resamples=a.resamples, seed=a.seed))
    print("\n".join(json.dumps(d) if a.json else render(d) for d in docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
