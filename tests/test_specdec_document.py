"""specdec's document on hand-made rows: the headline leaves one-token prompts out, a looping output is
flagged, the agreement is said first and "lossless" only of equal outputs, and the model's prediction is
the arithmetic of decode_model over the steps' own costs (not the decode's totals)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from trainer import specdec  # noqa: E402
from trainer.run.decode_model import RoundCosts, predict_prompt  # noqa: E402
from trainer.run.decode_sample import figures  # noqa: E402
from trainer.run.acceptance import Timing  # noqa: E402

EOS = 9


def row(tokens, rounds, spec_s, alone_s, *, equal=True, margin=None, prompt_tokens=20):
    r = {"prompt_tokens": prompt_tokens, "tokens": tokens, "rounds": rounds, "accepted": [n - 1 for n in rounds],
         "spec_s": spec_s, "spec_prefill_s": 0.01, "alone_s": alone_s, "alone_prefill_s": 0.01,
         "alone_tokens": len(tokens), "target_tokens": list(tokens), "equal": equal}
    if not equal:
        r["target_tokens"] = tokens[:-1] + [tokens[-1] + 1]
        r.update(first_diff=len(tokens) - 1, margin=margin)
    return r


ROWS = [
    row([1, 2, 3, 4, 5, 6, 7, 8, 2, 3, 4, 5, 6], [3, 4, 2, 3], 0.05, 0.12),
    row([EOS], [], 0.011, 0.010),                                               # the target ends the text at once
    row([5, 1, 2, 3] + [7, 8, 4] * 8, [12, 12, 3], 0.03, 0.25),                 # ends in a loop of period 3
    row([4, 4, 3, 1, 6, 2, 8, 5, 1, 2, 7], [2, 2, 3, 1, 2], 0.06, 0.10, equal=False, margin=0.125),
    row([6, 1, 6, 2, 6, 3, 6, 4], [2, 2, 3], 0.045, 0.08, prompt_tokens=40),
]
COSTS = RoundCosts(step=0.008, draft=0.004, verify=0.006, extend=0.002, round=0.013, prefill_alone=0.01,
                   prefill_spec=0.012)


def document(rows=ROWS, costs=COSTS):
    rows = json.loads(json.dumps(rows))
    drafts = [(n - 1, 15) for r in rows for n in r["rounds"]]
    spec, alone = Timing(), Timing()
    for r in rows:
        spec.add(Timing(total=r["spec_s"], prefill=r["spec_prefill_s"], verify=r["spec_prefill_s"]))
        alone.add(Timing(total=r["alone_s"], prefill=r["alone_prefill_s"], verify=r["alone_s"]))
    c = {"parts": costs, "prefill": {20: (0.01, 0.012), 40: (0.02, 0.025)}}     # by prompt length
    doc = specdec.document(rows, drafts, alone, spec, 16, engine="graphs", graphed=True, compiled=True,
                           strict=False, resamples=300, seed=0, costs=c)
    return {"dtype": "bfloat16", "prompts": doc["prompts"], **doc}


def test_one_token_prompts_are_left_out_of_the_headline_and_counted():
    doc = document()
    assert doc["one_token_prompts"] == 1 and doc["sample"]["one_token"] == [1]
    assert doc["headline"] == "excluding_one_token" and doc["headline_prompts"] == 4
    rest = figures([r for i, r in enumerate(ROWS) if i != 1], resamples=300, seed=0)
    assert doc["speedup"] == pytest.approx(rest["speedup"]) and doc["speedup_ci95"] == rest["speedup_ci95"]
    assert doc["tau_ci95"] == rest["tau_ci95"]
    kept = [r for i, r in enumerate(ROWS) if i != 1]
    a = sum(r["alone_tokens"] for r in kept) / sum(r["alone_s"] for r in kept)
    s = sum(len(r["tokens"]) for r in kept) / sum(r["spec_s"] for r in kept)
    assert doc["target_tokens_per_s"] == pytest.approx(a) and doc["speedup"] == pytest.approx(s / a)
    # with them in, the figure is another: the headline is not the all-prompts block
    assert doc["sample"]["all"]["speedup"] != pytest.approx(doc["speedup"])


def test_a_looping_output_is_flagged_with_its_period_and_the_figures_without_loops_are_given():
    doc = document()
    assert doc["loop_prompts"] == 1 and doc["sample"]["loops"][0]["prompt"] == 2
    assert doc["per_prompt"][2]["loop_period"] == 3
    assert all("loop_period" not in r for i, r in enumerate(doc["per_prompt"]) if i != 2)
    bare = doc["sample"]["excluding_one_token_and_loops"]
    assert bare["prompts"] == 3 and bare["tau"] < doc["tau"]


def test_the_agreement_comes_first_and_lossless_is_said_only_of_equal_outputs():
    doc = document()
    assert doc["lossless"] is False and doc["equal_prompts"] == 4 and doc["max_margin"] == 0.125
    line = specdec.result_line(doc)
    assert line.startswith("bfloat16, 4/5 equal (near-ties, max margin 0.125); tau "), line
    assert "lossless" not in line and "against the target alone, both graphs+compile" in line
    assert "1 one-token prompt(s) left out" in line and "1 output(s) end in a loop (without them: tau" in line
    # the target alone's tokens are there for every prompt: equality is recomputed from the document
    assert [r["tokens"] == r["target_tokens"] for r in doc["per_prompt"]] == [r["equal"] for r in doc["per_prompt"]]
    equal = document([r if r["equal"] else row(r["tokens"], r["rounds"], r["spec_s"], r["alone_s"]) for r in ROWS])
    assert specdec.result_line(equal).startswith("lossless (5/5 equal to the target alone); tau ")
    far = document([{**r, "margin": 3.0} if not r["equal"] else r for r in ROWS])
    assert specdec.result_line(far).startswith("bfloat16, 4/5 equal (max margin 3); ")     # not a near-tie


def test_the_model_predicts_from_each_steps_own_cost_with_the_prompts_forward():
    doc = document()
    m = doc["model"]
    kept = [r for i, r in enumerate(ROWS) if i != 1]
    alone = spec = 0.0
    for r in kept:
        pa, ps = (0.01, 0.012) if r["prompt_tokens"] == 20 else (0.02, 0.025)
        c = RoundCosts(**{**COSTS.__dict__, "prefill_alone": pa, "prefill_spec": ps})
        a, s = predict_prompt(c, r["alone_tokens"], len(r["rounds"]))
        alone, spec = alone + a, spec + s
    n = sum(r["alone_tokens"] for r in kept)
    assert m["predicted"]["alone_s"] == pytest.approx(alone) and m["predicted"]["spec_s"] == pytest.approx(spec)
    assert m["predicted"]["speedup"] == pytest.approx((n / spec) / (n / alone))
    assert m["measured"]["speedup"] == pytest.approx(doc["speedup"])
    # the decode's own totals would have said otherwise: the prediction is not the measurement restated
    assert m["predicted"]["speedup"] != pytest.approx(m["measured"]["speedup"], rel=0.05)
    assert m["costs_ms"]["host"] == pytest.approx(1e3 * (0.013 - 0.004 - 0.006 - 0.002))
    assert m["tau_for_2x_long_outputs"] == pytest.approx(2 * 0.013 / 0.008)
    assert m["tau_for_2x"] > m["tau_for_2x_long_outputs"]      # the prompt's forward costs the drafter more


def test_both_decodes_are_timed_in_the_fastest_mode_chosen_once():
    """Best against best: one choice (compiled under graphs on a GPU, not on a CPU) for the one decoder
    both decodes run on; the document names each decode's mode, and they are the same."""
    import torch

    assert specdec.fastest_compile(torch.device("cuda", 0)) and not specdec.fastest_compile(torch.device("cpu"))
    assert specdec.mode_name("graphs", True, True) == "graphs+compile"
    assert specdec.mode_name("graphs", False, False) == "graphs (uncaptured)"
    doc = document()
    assert doc["mode"]["alone"] == doc["mode"]["spec"] == "graphs+compile"
