"""Intervals for speculative decoding's figures that take the prompt, not the round, as the unit.

A round's acceptance length depends mostly on the text being continued, so the rounds of one prompt
are strongly correlated (on the small code target, per-prompt tau runs from under 2 to 14). An
interval that treats every round as an independent draw is then far too narrow: it describes the
rounds of these prompts, not what another sample of prompts would give. This resamples whole prompts
with replacement (a cluster bootstrap: Davison and Hinkley, "Bootstrap Methods and their
Application", 1997, on hierarchical data) and recomputes each figure as the same ratio of sums that
the point estimate is; the interval is the resamples' 2.5th to 97.5th percentile.

    from trainer.run.stats import cluster_bootstrap
    doc = cluster_bootstrap(produced_per_prompt, alone_s=..., spec_s=..., tokens=...)
    doc["tau"], doc["tau_ci95"], doc["speedup"], doc["speedup_ci95"], doc["speedup_median"]

Pure and torch-free: numpy only (a dependency of transformers on a target and of matplotlib on the
controller), so a benchmark script can recompute a saved run's figures anywhere.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

RESAMPLES = 10_000
PERCENTILES = (2.5, 97.5)  # the 95% percentile interval


def cluster_bootstrap(rounds_per_prompt: Sequence[Sequence[int]], *, alone_s: Sequence[float] | None = None,
                      spec_s: Sequence[float] | None = None, tokens: Sequence[int] | None = None,
                      tokens_alone: Sequence[int] | None = None, resamples: int = RESAMPLES,
                      seed: int = 0) -> dict:
    """tau and the speedup of speculative decoding with 95% intervals from resampling prompts.

    rounds_per_prompt: for each prompt, the tokens each round produced (accepted drafts + 1, as
    `speculative_generate` returns them); a prompt that stopped at its first token has no rounds.
    alone_s, spec_s: for each prompt, the seconds the target alone and the speculative decode took;
    both or neither. tokens: the tokens the speculative decode wrote per prompt (default: the rounds'
    sum plus the prefill's token); tokens_alone: the target alone's (default: `tokens`, as a lossless
    decode writes the same tokens).

    Returns a dict: tau (all rounds' tokens / number of rounds), tau_ci95, speedup ((tokens / spec
    seconds) / (tokens_alone / alone seconds), each summed over prompts), speedup_ci95, the median
    and mean of the per-prompt speedups, prompts, rounds, resamples and seed. Intervals are [low,
    high] or None (fewer than two prompts); the speedup fields are None without timings, tau is None
    without rounds. Deterministic for a seed; vectorised, so 10,000 resamples are cheap.
    """
    produced = np.array([sum(r) for r in rounds_per_prompt], dtype=np.float64)
    counts = np.array([len(r) for r in rounds_per_prompt], dtype=np.float64)
    n = len(produced)
    doc: dict[str, Any] = {"prompts": n, "rounds": int(counts.sum()), "tau": None, "tau_ci95": None,
                           "speedup": None, "speedup_ci95": None, "speedup_median": None, "speedup_mean": None,
                           "resamples": resamples, "seed": seed}
    timed = alone_s is not None or spec_s is not None
    if timed and (alone_s is None or spec_s is None):
        raise ValueError("alone_s and spec_s go together: the speedup needs both sides' seconds")
    cols = [produced, counts]
    if timed:
        spec_tok = np.array(tokens if tokens is not None else produced + 1, dtype=np.float64)
        alone_tok = np.array(tokens_alone, dtype=np.float64) if tokens_alone is not None else spec_tok
        a_s, s_s = np.array(alone_s, dtype=np.float64), np.array(spec_s, dtype=np.float64)
        if not len(spec_tok) == len(alone_tok) == len(a_s) == len(s_s) == n:
            raise ValueError(f"{n} prompts' rounds but {len(a_s)} alone_s, {len(s_s)} spec_s, {len(spec_tok)} "
                             f"tokens and {len(alone_tok)} tokens_alone: one value per prompt each")
        if n and (min(a_s) <= 0 or min(s_s) <= 0):
            raise ValueError("every prompt's seconds must be positive")
        cols += [spec_tok, s_s, alone_tok, a_s]
    if n == 0:
        return doc
    sums = np.stack(cols, axis=1)  # (n, k): the per-prompt sums every figure is a ratio of
    if counts.sum():
        doc["tau"] = float(produced.sum() / counts.sum())
    if timed:
        doc["speedup"] = float(_speedup(sums.sum(axis=0)[None, 2:])[0])
        per_prompt = _speedup(sums[:, 2:])
        doc["speedup_median"], doc["speedup_mean"] = float(np.median(per_prompt)), float(per_prompt.mean())
    if n < 2 or resamples < 1:
        return doc
    boot = resample_counts(n, resamples, seed) @ sums  # (resamples, k): each resample's sums
    with np.errstate(invalid="ignore", divide="ignore"):  # a resample of prompts without rounds has no tau
        doc["tau_ci95"] = _interval(boot[:, 0] / boot[:, 1])
    if timed:
        doc["speedup_ci95"] = _interval(_speedup(boot[:, 2:]))
    return doc


def resample_counts(n: int, resamples: int, seed: int = 0) -> np.ndarray:
    """(resamples, n) float64: how often each of n prompts is drawn in each resample of n prompts with
    replacement; a matrix so that every figure's resampled sums are one product with the per-prompt sums."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n)) + (np.arange(resamples) * n)[:, None]
    return np.bincount(idx.ravel(), minlength=resamples * n).reshape(resamples, n).astype(np.float64)


def _speedup(s: np.ndarray) -> np.ndarray:
    """Columns spec tokens, spec seconds, alone tokens, alone seconds -> tokens/s ratio."""
    return (s[:, 0] / s[:, 1]) / (s[:, 2] / s[:, 3])


def _interval(values: np.ndarray) -> list[float] | None:
    values = values[np.isfinite(values)]
    if not len(values):
        return None
    lo, hi = np.percentile(values, PERCENTILES)
    return [float(lo), float(hi)]
