"""What a specdec sample of prompts is made of, and its figures with and without the parts that are
not ordinary text.

Two kinds of prompt move a sample's figures without saying anything about the drafter on ordinary
text. A prompt whose target ends the text at once (its continuation is the end-of-text token alone)
has no round: it adds nothing to tau, but its two decodes are one prompt's forward each, so it pulls
the speedup towards 1. An output that ends in an exact loop (greedy decoding that has fallen into a
cycle) is easy to draft: its rounds accept whole blocks and lift tau well above the rest. So specdec
and benchmarks/specdec_bootstrap.py report the figures three ways, computed here once:

    from trainer.run.decode_sample import split_figures
    doc = split_figures(per_prompt_rows, resamples=10_000, seed=0)
    doc["all"], doc["excluding_one_token"], doc["excluding_one_token_and_loops"]   # figure blocks
    doc["one_token"], doc["loops"]                                                 # which prompts

Each block is trainer.run.stats.cluster_bootstrap's document over its prompts (the prompt is the
unit, as specdec's own intervals) and whether those prompts' outputs equal the target alone's.
Rows are specdec's `per_prompt` records. Torch-free: the standard library and trainer.run.stats.
"""
from __future__ import annotations

from typing import Any, Sequence

from trainer.run.stats import RESAMPLES, cluster_bootstrap

# A top-2 logit margin up to this at the first difference is a near-tie that bf16's rounding can flip:
# two of bf16's steps at logits of 16-32 (0.125 each there; a verify and a step accumulate differently).
# Larger: a difference to look into, said without "near-ties"
NEAR_TIE = 0.25


MAX_PERIOD = 16
MIN_REPEATS = 3
MIN_SPAN = 16


def loop_period(tokens: Sequence[int], *, max_period: int = MAX_PERIOD, min_repeats: int = MIN_REPEATS,
                min_span: int = MIN_SPAN) -> int | None:
    """The smallest period p <= max_period with which the output's tail repeats exactly over at least
    max(min_repeats * p, min_span) tokens; None where it does not.

    The tokens are checked as given: an output that loops and then ends (its end-of-text token, or any
    other token that breaks the cycle) does not end in a loop, as the decode left the cycle. min_span
    keeps a short run of a repeated token or pair (`)))`, `0, 0, 0`) in ordinary text from counting."""
    if max_period < 1 or min_repeats < 2:
        raise ValueError("a loop needs a period of at least 1 and at least two repeats")
    for p in range(1, max_period + 1):
        if loop_span(tokens, p) >= max(min_repeats * p, min_span):
            return p
    return None


def loop_span(tokens: Sequence[int], period: int) -> int:
    """How many tokens at the end repeat with this period (tokens[i] == tokens[i - period] from the
    span's second period on); 0 where the last token breaks it."""
    n, i = len(tokens), len(tokens) - 1
    while i >= period and tokens[i] == tokens[i - period]:
        i -= 1
    matched = n - 1 - i
    return matched + period if matched else 0


def one_token(row: dict) -> bool:
    """Whether the prompt's continuation is one token: the target alone's (`alone_tokens`), or the
    speculative output's where the run had no baseline."""
    if row.get("alone_tokens") is not None:
        return row["alone_tokens"] == 1
    return _length(row["tokens"]) == 1


def structure(rows: Sequence[dict], *, max_period: int = MAX_PERIOD, min_repeats: int = MIN_REPEATS,
              min_span: int = MIN_SPAN) -> dict:
    """Which prompts are one-token and which outputs end in a loop.

    Returns {"prompts": n, "one_token": [indices], "loops": [{"prompt": i, "period": p, "span": tokens
    the loop covers at the end}], "loop_rule": the three settings}. Loops are looked for in the
    speculative output (`tokens`, whose rounds make tau), only where the row holds the token list (a
    log's rows hold counts)."""
    loops = []
    for i, r in enumerate(rows):
        tokens = r.get("tokens")
        if not isinstance(tokens, list):
            continue
        p = loop_period(tokens, max_period=max_period, min_repeats=min_repeats, min_span=min_span)
        if p is not None:
            loops.append({"prompt": i, "period": p, "span": loop_span(tokens, p)})
    return {"prompts": len(rows), "one_token": [i for i, r in enumerate(rows) if one_token(r)], "loops": loops,
            "loop_rule": {"max_period": max_period, "min_repeats": min_repeats, "min_span": min_span}}


def figures(rows: Sequence[dict], *, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """One block of figures over these prompts: cluster_bootstrap's document (prompts, rounds, tau,
    tau_ci95, speedup, speedup_ci95, speedup_median, speedup_mean, resamples, seed), with the same
    inputs specdec's document() gives it, so that the block of all prompts is specdec's own figures;
    and the lossless check over them: equal_prompts, lossless (every prompt equal) and max_margin (the
    largest top-2 margin of the target alone where an output first differs; None where none differ or
    no margin is known). The speedup needs every prompt's alone_s, the check every prompt's `equal`;
    otherwise those fields are None."""
    timed = bool(rows) and all(r.get("alone_s") is not None for r in rows)
    doc: dict[str, Any] = cluster_bootstrap(
        [r["rounds"] for r in rows], tokens=[_length(r["tokens"]) for r in rows], resamples=resamples, seed=seed,
        **({"spec_s": [r["spec_s"] for r in rows], "alone_s": [r["alone_s"] for r in rows],
            "tokens_alone": [r.get("alone_tokens", _length(r["tokens"])) for r in rows]} if timed else {}))
    checked = bool(rows) and all("equal" in r for r in rows)
    equal = sum(bool(r["equal"]) for r in rows) if checked else None
    margins = [r["margin"] for r in rows if checked and not r["equal"] and r.get("margin") is not None]
    return {**doc, "equal_prompts": equal, "lossless": equal == len(rows) if checked else None,
            "max_margin": max(margins) if margins else None}


def split_figures(rows: Sequence[dict], *, resamples: int = RESAMPLES, seed: int = 0, max_period: int = MAX_PERIOD,
                  min_repeats: int = MIN_REPEATS, min_span: int = MIN_SPAN) -> dict:
    """structure()'s document, and figures() over: "all" prompts, "excluding_one_token",
    "excluding_one_token_and_loops", and for what those leave out, "only_one_token" and "only_loops"
    (what a one-token prompt's speedup is, how high a loop's tau). Every block resamples with the same
    seed, each over its own prompts."""
    doc = structure(rows, max_period=max_period, min_repeats=min_repeats, min_span=min_span)
    one, loops = set(doc["one_token"]), {x["prompt"] for x in doc["loops"]}

    def block(keep) -> dict:
        return figures([r for i, r in enumerate(rows) if keep(i)], resamples=resamples, seed=seed)

    return {**doc, "all": block(lambda i: True), "excluding_one_token": block(lambda i: i not in one),
            "excluding_one_token_and_loops": block(lambda i: i not in one and i not in loops),
            "only_one_token": block(lambda i: i in one), "only_loops": block(lambda i: i in loops),
            "bootstrap": {"unit": "prompt", "resamples": resamples, "seed": seed}}


def _length(tokens) -> int:
    """A row's token count: specdec's rows hold the tokens, a log's rows their number."""
    return len(tokens) if isinstance(tokens, list) else int(tokens)


def agreement(doc: dict) -> str:
    """How the outputs compare with the target alone's, said first: "lossless (N/N equal ...)" only
    where every output is equal; otherwise "DTYPE, K/N equal (near-ties, max margin X)"."""
    n, eq = doc["prompts"], doc.get("equal_prompts")
    if eq is None:
        return "not checked against the target alone"
    if eq == n:
        return f"lossless ({n}/{n} equal to the target alone)"
    margin = doc.get("max_margin")
    why = (f"near-ties, max margin {margin:.3g}" if margin is not None and margin <= NEAR_TIE
           else f"max margin {margin:.3g}" if margin is not None else "margins unknown")
    return f"{doc.get('dtype') or 'not float32'}, {eq}/{n} equal ({why})"
