"""Speculative decoding's tau and speedup with per-prompt (cluster) bootstrap intervals, from a run's
saved output.

    python benchmarks/specdec_bootstrap.py SPECDEC.json [OTHER.json]  # documents with "per_prompt"
    python benchmarks/specdec_bootstrap.py SPECDEC.log --drop-tau 10   # the live lines; also without tau >= 10

Reads either `python -m trainer.specdec --json`'s document, whose "per_prompt" list holds each
prompt's "rounds" (tokens per round), "tokens", "alone_s" and "spec_s" (and "alone_tokens"), or the
stderr log of a run that saved no such list, whose lines read
`specdec: prompt I/N: L tokens, tau T, A -> S tokens/s`. Those lines count the prefill's token as
accepted (T = L / rounds, where the rounds produced L - 1 tokens), so the rounds are recovered as
round(L / T) and checked against T; the seconds are L / A and L / S (the rates' one decimal costs
under 0.2% on a prompt). A log holds each prompt's totals, not its rounds one by one; the bootstrap
needs no more (trainer/run/stats.py). --drop-tau says how much the easiest prompts carry: the same
figures without the prompts whose tau is at least that.

A document that keeps every prompt's output tokens (specdec's since the graphs engine) is read for
what its sample is made of (trainer/run/decode_sample.py), in this order: whether its outputs equal
the target alone's (that decides what its figures are worth), the one-token prompts and the outputs
that end in a loop, then tau and the speedup over all prompts, without the one-token prompts, and
without those and the loops. Several files print lossless ones first.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainer.run import decode_sample  # noqa: E402
from trainer.run.log import tau_text  # noqa: E402
from trainer.run.stats import RESAMPLES  # noqa: E402

LINE = re.compile(r"specdec: prompt (\d+)/\d+: (\d+) tokens, tau ([\d.]+), (?:([\d.]+) -> )?([\d.]+) tokens/s")
# specdec's lines since the graphs engine: the rounds counted, tau over them alone (the prefill's token not in it)
ROUNDS_LINE = re.compile(r"specdec: prompt (\d+)/\d+: (\d+) tokens, (\d+) rounds, [^,]+, (?:([\d.]+) -> )?([\d.]+) "
                         r"tokens/s")
SHORT_DTYPE = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


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
    """decode_sample.figures' block over the prompts (those of tau >= drop_tau left out, counted in
    "dropped"); the speedup only when every prompt has both timings."""
    def tau(p):
        return sum(p["rounds"]) / len(p["rounds"]) if p["rounds"] else None

    kept = [p for p in prompts if drop_tau is None or tau(p) is None or tau(p) < drop_tau]
    doc = decode_sample.figures(kept, resamples=resamples, seed=seed)
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


def agreement(dtype: str | None, block: dict, rows: list[dict]) -> str:
    """The lossless figure: `fp32, lossless (240/240 equal)`, or where outputs differ, how many are
    equal and the target alone's largest top-2 margin where one first differs (exact ties counted)."""
    name = SHORT_DTYPE.get(dtype or "", dtype or "dtype not given")
    n, equal = block["prompts"], block["equal_prompts"]
    if equal is None:
        return f"{name}, no lossless check (no baseline)"
    if block["lossless"]:
        return f"{name}, lossless ({equal}/{n} equal to the target alone)"
    ties = sum(1 for r in rows if not r["equal"] and r.get("margin") == 0)
    margin = "no margin known" if block["max_margin"] is None else f"max margin {block['max_margin']:.3g}"
    return f"{name}, {equal}/{n} equal ({margin} where they differ, {ties} exact ties)"


def render_sample(name: str, dtype: str | None, split: dict, rows: list[dict]) -> str:
    """A document's lossless figure, what its sample is made of, then tau and the speedup over all
    prompts, without the one-token prompts, and without those and the loops."""
    one, loops = split["one_token"], split["loops"]
    only_one, only_loops = split["only_one_token"], split["only_loops"]
    lines = [f"{name}: {agreement(dtype, split['all'], rows)}"]
    sp = f", speedup {_speedup(only_one)} among them" if only_one["speedup"] is not None else ""
    lines.append(f"  one-token prompts (the target alone ends the text at once; no rounds): {len(one)} of "
                 f"{split['prompts']}{sp}" + (f": prompts {', '.join(map(str, one))}" if one else ""))
    if loops:
        periods = ", ".join(f"{p}: {k}" for p, k in sorted(Counter(x["period"] for x in loops).items()))
        spans = [x["span"] for x in loops]
        rule = split["loop_rule"]
        outside = split["excluding_one_token_and_loops"]
        lines.append(f"  outputs ending in an exact loop (period <= {rule['max_period']}, at least "
                     f"{rule['min_repeats']} repeats and {rule['min_span']} tokens): {len(loops)} (by period "
                     f"{periods}; the loop covers the last {min(spans)}-{max(spans)} tokens); tau {_tau(only_loops)} "
                     f"in them, {_tau(outside)} in the rest (one-token prompts aside)")
    else:
        lines.append("  outputs ending in an exact loop: none")
    for key, what in (("all", "all prompts"), ("excluding_one_token", "without the one-token prompts"),
                      ("excluding_one_token_and_loops", "without the one-token prompts and the loops")):
        b = split[key]
        sp = f"; speedup {_speedup(b)}" if b["speedup"] is not None else ""
        lines.append(f"  {what} (n {b['prompts']}): tau {_tau(b)}{sp}")
    b = split["bootstrap"]
    lines.append(f"  (95%: per-prompt bootstrap, {b['resamples']} resamples, seed {b['seed']})")
    return "\n".join(lines)


def _tau(b: dict) -> str:
    return "none (no rounds)" if b["tau"] is None else tau_text(b["tau"], b["tau_ci95"], b["rounds"], digits=2)


def _speedup(b: dict) -> str:
    ci = b["speedup_ci95"]
    return f"{b['speedup']:.2f}x" + (f" (95% {ci[0]:.2f}-{ci[1]:.2f}x)" if ci else "")


def read(path: str) -> tuple[dict | None, list[dict]]:
    """A file's specdec document (None for a log) and its per-prompt records."""
    text = Path(path).read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    prompts = read_doc(doc) if doc is not None else read_log(text)
    if not prompts:
        raise ValueError("no per-prompt lines or records")
    return doc, prompts


def report(path: str, doc: dict | None, prompts: list[dict], a) -> list[str]:
    """What main prints for one file: text, or one JSON line per part."""
    out = []
    if doc is not None and all(isinstance(p.get("tokens"), list) for p in prompts):
        split = decode_sample.split_figures(prompts, resamples=a.resamples, seed=a.seed)
        label = agreement(doc.get("dtype"), split["all"], prompts)
        out.append(json.dumps({"file": path, "dtype": doc.get("dtype"), "agreement": label, **split}) if a.json
                   else render_sample(path, doc.get("dtype"), split, prompts))
    else:
        all_ = figures(prompts, resamples=a.resamples, seed=a.seed)
        out.append(json.dumps(all_) if a.json else render(all_))
    if a.drop_tau is not None:
        d = figures(prompts, drop_tau=a.drop_tau, resamples=a.resamples, seed=a.seed)
        out.append(json.dumps(d) if a.json else render(d))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", metavar="file",
                    help="specdec JSON documents with per_prompt, or specdec logs (lossless documents print first)")
    ap.add_argument("--drop-tau", type=float, help="also: the figures without the prompts of tau >= this")
    ap.add_argument("--resamples", type=int, default=RESAMPLES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the documents as JSON lines instead")
    a = ap.parse_args(argv)
    files = []
    for path in a.files:
        try:
            files.append((path, *read(path)))
        except (OSError, ValueError) as e:
            print(f"specdec_bootstrap: error: {path}: {e}", file=sys.stderr)
            return 2
    # A figure is worth what the outputs' agreement with the target is worth: the lossless runs first
    files.sort(key=lambda f: not all(p.get("equal") for p in f[2]))
    print("\n".join(line for path, doc, prompts in files for line in report(path, doc, prompts, a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
