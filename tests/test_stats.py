"""The per-prompt (cluster) bootstrap of speculative decoding's figures (trainer/run/stats.py).

The properties that make it the right interval are checked by `_check_cluster_properties`, and a
bootstrap that resamples rounds instead of prompts (the mistake it replaces) is shown to fail them.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from trainer.run.stats import cluster_bootstrap, resample_counts


def _rounds_bootstrap(rounds_per_prompt, **kw):
    """The wrong unit: every round resampled on its own (as if each were a prompt of one round)."""
    return cluster_bootstrap([[r] for rounds in rounds_per_prompt for r in rounds], **kw)


def _naive_width(rounds_per_prompt) -> float:
    """The width of the normal 95% interval of the mean over independent rounds."""
    xs = np.array([r for rounds in rounds_per_prompt for r in rounds], dtype=float)
    return 2 * 1.96 * xs.std(ddof=1) / math.sqrt(len(xs))


def _correlated(prompts=40, rounds=30):
    """Each prompt decodes at its own level (1..8 tokens a round), the same in every round."""
    return [[1 + i % 8] * rounds for i in range(prompts)]


def _check_cluster_properties(bootstrap):
    # Two prompts, tau 2 and 6: a quarter of the resamples draw one of them twice, so the 95%
    # interval runs exactly from one prompt's tau to the other's.
    two = bootstrap([[2] * 50, [6] * 50])
    assert two["tau"] == 4 and two["tau_ci95"] == [2, 6]
    # Correlated rounds: the interval is several times wider than the one over independent rounds.
    data = _correlated()
    lo, hi = bootstrap(data)["tau_ci95"]
    assert hi - lo > 3 * _naive_width(data)


def test_the_cluster_bootstrap_has_the_properties_of_a_per_prompt_interval():
    _check_cluster_properties(cluster_bootstrap)


def test_a_bootstrap_over_rounds_fails_those_properties():
    with pytest.raises(AssertionError):
        _check_cluster_properties(_rounds_bootstrap)


def test_independent_rounds_give_about_the_naive_width():
    rng = np.random.default_rng(3)
    flat = rng.permutation([r for rounds in _correlated() for r in rounds])
    shuffled = [list(flat[i: i + 30]) for i in range(0, len(flat), 30)]  # the same rounds, no prompt effect
    lo, hi = cluster_bootstrap(shuffled)["tau_ci95"]
    assert 0.7 < (hi - lo) / _naive_width(shuffled) < 1.4


def test_identical_prompts_give_a_zero_width_interval():
    doc = cluster_bootstrap([[3, 1, 4]] * 6, alone_s=[2.0] * 6, spec_s=[0.8] * 6, tokens=[9] * 6)
    assert doc["tau"] == 8 / 3 and doc["tau_ci95"] == pytest.approx([8 / 3, 8 / 3], abs=1e-12)
    assert doc["speedup"] == pytest.approx(2.5) and doc["speedup_ci95"] == pytest.approx([2.5, 2.5])
    assert doc["speedup_median"] == doc["speedup_mean"] == pytest.approx(2.5)
    assert (doc["prompts"], doc["rounds"], doc["resamples"], doc["seed"]) == (6, 18, 10_000, 0)


def test_tau_and_speedup_are_ratios_of_sums_and_the_prompts_speedups_summarise_apart():
    # Prompt A: 10 tokens in 1 s alone, 0.5 s speculative (2x); prompt B: 3 s both ways (1x).
    doc = cluster_bootstrap([[4, 5], [1, 1, 1, 1, 1, 1, 1, 1, 1]], alone_s=[1, 3], spec_s=[0.5, 3])
    assert doc["tau"] == 18 / 11  # not the mean of the prompts' taus (4.5 and 1)
    assert doc["speedup"] == pytest.approx(4 / 3.5)  # both wrote 10 tokens (rounds' sum + the prefill's)
    assert doc["speedup_median"] == doc["speedup_mean"] == pytest.approx(1.5)
    lo, hi = doc["speedup_ci95"]
    assert lo == pytest.approx(1) and hi == pytest.approx(2)


def test_different_token_counts_on_each_side():
    doc = cluster_bootstrap([[2], [2]], alone_s=[1, 1], spec_s=[1, 1], tokens=[20, 20], tokens_alone=[10, 10])
    assert doc["speedup"] == pytest.approx(2)


def test_a_seed_gives_the_same_figures_and_another_seed_others():
    data = _correlated(prompts=12, rounds=5)
    kw = {"alone_s": [1 + i / 10 for i in range(12)], "spec_s": [0.5 + i / 7 % 1 for i in range(12)]}
    a, b, c = (cluster_bootstrap(data, seed=s, **kw) for s in (7, 7, 8))
    assert a == b
    assert c["speedup_ci95"] != a["speedup_ci95"] and c["tau"] == a["tau"]
    assert (resample_counts(5, 3, seed=1) == resample_counts(5, 3, seed=1)).all()
    assert (resample_counts(5, 3).sum(axis=1) == 5).all()  # each resample draws n prompts


def test_degenerate_input_gives_no_interval_rather_than_an_error():
    none = cluster_bootstrap([])
    assert none["prompts"] == none["rounds"] == 0 and none["tau"] is None and none["tau_ci95"] is None
    one = cluster_bootstrap([[2, 3]], alone_s=[1.0], spec_s=[0.5])
    assert one["tau"] == 2.5 and one["tau_ci95"] is None
    assert one["speedup"] == 2 and one["speedup_ci95"] is None and one["speedup_median"] == 2
    no_rounds = cluster_bootstrap([[], []])  # both stopped at the prefill's token
    assert no_rounds["tau"] is None and no_rounds["tau_ci95"] is None
    some = cluster_bootstrap([[], [3]])  # resamples that draw only the first prompt have no tau
    assert some["tau"] == 3 and some["tau_ci95"] == [3, 3]
    untimed = cluster_bootstrap([[1], [2]])
    assert untimed["speedup"] is untimed["speedup_ci95"] is untimed["speedup_median"] is None


def test_timings_must_come_in_pairs_with_one_value_per_prompt():
    with pytest.raises(ValueError, match="go together"):
        cluster_bootstrap([[1]], alone_s=[1.0])
    with pytest.raises(ValueError, match="one value per prompt"):
        cluster_bootstrap([[1], [2]], alone_s=[1.0], spec_s=[1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        cluster_bootstrap([[1], [2]], alone_s=[1.0, 0.0], spec_s=[1.0, 2.0])


# vectorised, a moment; resampling prompt by prompt in Python would take minutes
@pytest.mark.timeout(60)
def test_ten_thousand_resamples_of_300_prompts_are_vectorised():
    rng = np.random.default_rng(0)
    data = [list(rng.integers(1, 9, size=40)) for _ in range(300)]
    out = cluster_bootstrap(data, alone_s=rng.uniform(1, 2, 300), spec_s=rng.uniform(0.3, 1, 300))
    assert out["speedup_ci95"][0] < out["speedup"] < out["speedup_ci95"][1]
