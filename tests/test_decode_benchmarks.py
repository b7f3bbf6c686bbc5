"""The decode benchmarks run end to end on a CPU at the smallest recipe (their figures are GPU ones:
docs/benchmarks.md section 16): the JSON each writes holds what the docs read from it."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_costs_reports_each_engine_and_the_tau_that_2x_needs(capsys):
    costs = _load("decode_costs")
    assert costs.main(["--size", "smoke", "--prompts", "2", "--prompt-len", "20", "--new", "24",
                       "--dtype", "float32", "--engines", "graphs,eager", "--tau", "3.0"]) == 0
    out = json.loads(capsys.readouterr().out)
    for name in ("graphs", "eager"):
        e = out[name]
        assert e["graphed"] is False                      # a CPU captures nothing
        parts = e["ms_per_round"]
        assert parts["all"] == pytest.approx(parts["verify"] + parts["draft"] + parts["extend"] + parts["host"])
        assert e["tau_for_2x"] == pytest.approx(2 * parts["all"] / e["target_ms_per_token"])
        assert e["speedup_at_tau"]["3.0"] == pytest.approx(3.0 * e["target_ms_per_token"] / parts["all"])
    assert "compiled" not in out


def test_decode_costs_refuses_an_unknown_engine(capsys):
    with pytest.raises(SystemExit) as e:
        _load("decode_costs").main(["--engines", "graphs,warp"])
    assert e.value.code == 2 and "--engines" in capsys.readouterr().err


def test_decode_profile_lists_each_steps_time(capsys):
    prof = _load("decode_profile")
    assert prof.main(["--size", "smoke", "--reps", "2", "--top", "3", "--context", "24"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["steps"]) == {"one-token step", "verify (block)", "draft", "extend"}
    for step in out["steps"].values():
        assert step["us_per_call"] > 0 and 0 < len(step["top"]) <= 3
    assert "replay_ms" not in out                          # replays need a GPU
