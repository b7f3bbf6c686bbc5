"""trainer/run/decode_model.py: the arithmetic that turns step costs into a predicted speedup, on hand
numbers (no torch)."""
from __future__ import annotations

from dataclasses import asdict

import pytest

from trainer.run.decode_model import RoundCosts, predict_prompt, speedup_at, tau_for

# Seconds, in the proportions of the small target on one H200 (docs/decoding.md): a 2 ms step, a 3.5 ms
# round of which 0.3 ms is the host's, ~20 ms prompts.
C = RoundCosts(step=0.002, draft=0.0005, verify=0.0025, extend=0.0002, round=0.0035,
               prefill_alone=0.020, prefill_spec=0.022)


def test_predict_prompt_adds_the_prefill_to_the_steps_and_rounds():
    alone, spec = predict_prompt(C, 129, 32)
    assert alone == pytest.approx(0.020 + 128 * 0.002)       # the prompt's forward gives the first token
    assert spec == pytest.approx(0.022 + 32 * 0.0035)
    assert predict_prompt(C, 0, 0) == pytest.approx((0.020, 0.022))  # no steps, no rounds


def test_host_is_what_the_round_adds_to_its_parts_and_never_negative():
    assert C.host == pytest.approx(0.0003)
    noisy = RoundCosts(step=1.0, draft=1.0, verify=1.0, extend=1.0, round=2.5)  # round timed below its parts
    assert noisy.host == 0.0
    ms = C.as_ms()
    assert set(ms) == {"step", "draft", "verify", "extend", "round", "prefill_alone", "prefill_spec", "host"}
    assert ms["round"] == pytest.approx(3.5) and ms["host"] == pytest.approx(0.3)


def test_long_outputs_leave_the_prompt_out():
    assert speedup_at(C, 2.9) == pytest.approx(2.9 * 0.002 / 0.0035)
    assert tau_for(C, 2.0) == pytest.approx(2 * 0.0035 / 0.002)
    # the finite-length prediction tends to the long one
    assert speedup_at(C, 2.9, 10**9) == pytest.approx(speedup_at(C, 2.9), rel=1e-6)
    assert tau_for(C, 2.0, 10**9) == pytest.approx(tau_for(C, 2.0), rel=1e-6)
    # and, the drafter's prompt costing more than the target's, sits below it
    assert speedup_at(C, 2.9, 256) < speedup_at(C, 2.9)


@pytest.mark.parametrize("new_tokens", [None, 2, 17, 256, 100_000])
@pytest.mark.parametrize("x", [1.0, 1.5, 2.0, 3.0])
def test_tau_for_and_speedup_at_are_inverses(new_tokens, x):
    tau = tau_for(C, x, new_tokens)
    if tau is None:     # out of reach at this length: the prompt's forward eats the gain
        assert new_tokens is not None
        return
    assert speedup_at(C, tau, new_tokens) == pytest.approx(x, rel=1e-9)
    assert tau_for(C, speedup_at(C, 4.25, new_tokens), new_tokens) == pytest.approx(4.25, rel=1e-9)


def test_none_where_the_prefill_makes_the_speedup_unreachable():
    n = 256
    alone = 0.020 + (n - 1) * 0.002
    ceiling = alone / 0.022     # any tau, however long, gives less than this at n new tokens
    assert speedup_at(C, 1e9, n) == pytest.approx(ceiling, rel=1e-6)
    assert tau_for(C, 0.999 * ceiling, n) is not None
    assert tau_for(C, ceiling, n) is None
    assert tau_for(C, 1.001 * ceiling, n) is None
    slow = RoundCosts(step=0.002, draft=0.0005, verify=0.0025, extend=0.0002, round=0.0035,
                      prefill_alone=0.020, prefill_spec=1.0)    # the drafter's prompt outweighs the decode
    assert tau_for(slow, 2.0, n) is None and tau_for(slow, 1.0, n) is None
    assert tau_for(slow, 2.0) == pytest.approx(tau_for(C, 2.0))  # long outputs: the prompt does not count
    assert tau_for(C, 2.0, 1) is None                            # one new token: no rounds to speed up


def test_costs_come_back_from_their_milliseconds_and_a_missing_part_is_named():
    back = RoundCosts.from_ms(C.as_ms())     # "host" is in as_ms() and derived again, not read
    assert asdict(back) == pytest.approx(asdict(C), rel=1e-12) and back.host == pytest.approx(C.host)
    ms = {k: v for k, v in C.as_ms().items() if k != "verify"}
    with pytest.raises(KeyError, match="verify"):
        RoundCosts.from_ms(ms)
