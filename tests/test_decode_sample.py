"""trainer/run/decode_sample.py: the one-token prompts and looping outputs of a specdec sample, and its
figures with and without them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.run.decode_sample import figures, loop_period, loop_span, one_token, split_figures, structure
from trainer.run.stats import cluster_bootstrap

ENGINES_1203B = Path(__file__).resolve().parent.parent / "docs" / "data" / "decode-engines-h200-2026-12-03b"
TEXT = [int(c) for c in "31415926535897932384626433832795028841971693993751058209749445923078164062862"]


def warmed(dtype: str) -> dict:
    return json.loads((ENGINES_1203B / f"specdec-graphs-{dtype}.json").read_text())


@pytest.mark.parametrize("period", [1, 3, 6])
def test_a_loop_is_flagged_with_its_period(period):
    cycle = [100 + k for k in range(period)]
    tokens = TEXT[:20] + cycle * (30 // period)
    assert loop_period(tokens) == period
    assert loop_span(tokens, period) == 30 // period * period


def test_the_smallest_period_is_given():
    assert loop_period(TEXT[:10] + [7, 8] * 20) == 2  # also periodic with 4, 6, ...


@pytest.mark.parametrize("tokens", [
    TEXT,                                      # digits of pi: no exact repetition at the end
    list(range(200)),
    TEXT[:20] + [7, 8, 9] * 5,                 # five repeats but 15 tokens, under min_span
    TEXT[:20] + list(range(100, 110)) * 2,     # 20 tokens but two repeats of period 10
    TEXT[:20] + [7, 8, 9] * 10 + [0],          # a loop the decode left (its end-of-text)
    TEXT[:20] + [7, 8, 9] * 10 + [1, 2, 3, 4],
    [],
], ids=["pi", "range", "too-short", "two-repeats", "then-eos", "then-text", "empty"])
def test_no_loop(tokens):
    assert loop_period(tokens) is None


def test_a_natural_warmed_output_is_not_a_loop():
    rows = warmed("fp32")["per_prompt"]
    assert len(rows[0]["tokens"]) == 128 and loop_period(rows[0]["tokens"]) is None


def test_the_rule_is_adjustable_and_checked():
    tokens = TEXT[:20] + [7, 8, 9] * 5
    assert loop_period(tokens, min_span=15) == 3 and loop_period(tokens, max_period=2, min_span=15) is None
    with pytest.raises(ValueError):
        loop_period(tokens, min_repeats=1)


def test_one_token_prompts():
    assert one_token({"tokens": [0], "alone_tokens": 1})
    assert one_token({"tokens": [0]})  # no baseline: the speculative output's length
    assert one_token({"tokens": 1})    # a log's row: the count
    assert not one_token({"tokens": [5, 0], "alone_tokens": 2})
    assert not one_token({"tokens": [5] * 128, "alone_tokens": 76})


def rows() -> list[dict]:
    """Eight prompts: 0 and 5 one-token, 2 and 6 ending in loops, 3 not equal to the target alone."""
    out = []
    for i in range(8):
        if i in (0, 5):
            tokens, rounds = [0], []
        elif i in (2, 6):
            tokens, rounds = TEXT[:8] + [40 + i, 41, 42] * 10, [8, 16, 7]
        else:
            tokens, rounds = TEXT[i:i + 30], [3, 2, 1, 4, 1][:i % 4 + 2]
        row = {"tokens": tokens, "rounds": rounds, "spec_s": 0.01 * (i + 1), "alone_s": 0.012 * (i + 1) + 0.003 * i,
               "alone_tokens": len(tokens), "equal": i != 3}
        if i == 3:
            row.update(target_tokens=tokens[:-1] + [9], first_diff=29, margin=0.0625)
        out.append(row)
    return out


def test_structure_names_the_prompts():
    doc = structure(rows())
    assert doc["prompts"] == 8 and doc["one_token"] == [0, 5]
    assert doc["loops"] == [{"prompt": 2, "period": 3, "span": 30}, {"prompt": 6, "period": 3, "span": 30}]


def test_each_subset_is_cluster_bootstrap_over_its_prompts():
    rs = rows()
    doc = split_figures(rs, resamples=500, seed=3)
    for key, keep in (("all", range(8)), ("excluding_one_token", [1, 2, 3, 4, 6, 7]),
                      ("excluding_one_token_and_loops", [1, 3, 4, 7]), ("only_one_token", [0, 5]),
                      ("only_loops", [2, 6])):
        sub = [rs[i] for i in keep]
        by_hand = cluster_bootstrap([r["rounds"] for r in sub], tokens=[len(r["tokens"]) for r in sub],
                                    spec_s=[r["spec_s"] for r in sub], alone_s=[r["alone_s"] for r in sub],
                                    tokens_alone=[r["alone_tokens"] for r in sub], resamples=500, seed=3)
        assert {k: doc[key][k] for k in by_hand} == by_hand, key
        assert doc[key]["prompts"] == len(keep)
    assert doc["only_one_token"]["tau"] is None and doc["only_one_token"]["speedup"] is not None
    assert doc["all"]["equal_prompts"] == 7 and doc["all"]["lossless"] is False and doc["all"]["max_margin"] == 0.0625
    assert doc["only_loops"]["lossless"] is True and doc["only_loops"]["max_margin"] is None


def test_without_a_baseline_there_is_no_speedup_and_no_check():
    rs = [{k: v for k, v in r.items() if k in ("tokens", "rounds", "spec_s")} for r in rows()]
    block = figures(rs, resamples=100)
    assert block["speedup"] is None and block["equal_prompts"] is None and block["lossless"] is None
    assert block["tau"] == figures(rows(), resamples=100)["tau"]
    assert figures([], resamples=100)["prompts"] == 0


@pytest.mark.parametrize("dtype, one, loops, equal", [("bf16", 39, 45, 137), ("fp32", 36, 47, 240)])
def test_the_warmed_documents(dtype, one, loops, equal):
    doc = warmed(dtype)
    got = split_figures(doc["per_prompt"])  # specdec's own resamples and seed
    assert len(got["one_token"]) == one and len(got["loops"]) == loops
    assert all(len(doc["per_prompt"][x["prompt"]]["tokens"]) == 128 for x in got["loops"])  # they ran to the budget
    for key in ("tau", "tau_ci95", "speedup", "speedup_ci95", "speedup_median", "prompts", "rounds"):
        assert got["all"][key] == doc[key], key  # the block of all prompts is specdec's document
    assert got["all"]["equal_prompts"] == equal == doc["equal_prompts"]
    assert got["all"]["max_margin"] == (0.125 if dtype == "bf16" else None)
    assert got["excluding_one_token"]["rounds"] == doc["rounds"]  # a one-token prompt has no round
    assert got["only_loops"]["tau"] > 4 > 3 > got["excluding_one_token_and_loops"]["tau"]
