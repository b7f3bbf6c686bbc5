"""benchmarks/decode_levers.py: each lever's speedup is the decode model's prediction with that one part
changed, recomputed here by hand from the saved costs of the best-against-best run; bad input is one line
and exit 2."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ENGINES_1205 = REPO / "docs/data/decode-engines-h200-2026-12-05/specdec-graphs-fp32.json"
SHAPES = REPO / "docs/data/decode-shapes-h200/qwen3-8b-bf16.json"


def _load():
    spec = importlib.util.spec_from_file_location("decode_levers", REPO / "benchmarks/decode_levers.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def by_hand(ms: dict, tau: float, n: int, *, verify=None, draft=None, extend=None, host=None) -> float:
    """alone / spec for a prompt of n tokens in (n - 1) / tau rounds, in milliseconds."""
    v = ms["verify"] if verify is None else verify
    d = ms["draft"] if draft is None else draft
    e = ms["extend"] if extend is None else extend
    h = ms["round"] - ms["draft"] - ms["verify"] - ms["extend"] if host is None else host
    alone = ms["prefill_alone"] + (n - 1) * ms["step"]
    return alone / (ms["prefill_spec"] + (n - 1) / tau * (v + d + e + h))


def test_each_lever_is_the_model_with_one_part_changed(capsys):
    r = _load().report(str(ENGINES_1205), str(SHAPES))
    doc = json.loads(ENGINES_1205.read_text())
    ms, tau, n = doc["model"]["costs_ms"], doc["tau"], doc["model"]["new_tokens"]
    rows = {row["lever"]: row["speedup"] for row in r["levers"]}
    assert rows["as measured"] == pytest.approx(doc["model"]["predicted"]["speedup"], rel=0.02)
    assert rows["as measured"] == pytest.approx(by_hand(ms, tau, n))
    assert rows["verify at the one-token step's cost"] == pytest.approx(by_hand(ms, tau, n, verify=ms["step"]))
    assert rows["drafter free (draft and extend)"] == pytest.approx(by_hand(ms, tau, n, draft=0, extend=0))
    assert rows["host free"] == pytest.approx(by_hand(ms, tau, n, host=0))
    assert rows["all three (tau alone limits)"] == pytest.approx(
        by_hand(ms, tau, n, verify=ms["step"], draft=0, extend=0, host=0))
    assert rows["tau one token higher"] == pytest.approx(by_hand(ms, tau + 1, n))
    # every lever helps, and none beats tau itself
    assert all(rows["as measured"] < s <= rows["all three (tau alone limits)"] for k, s in rows.items()
               if k not in ("as measured", "tau one token higher"))
    sd = json.loads(SHAPES.read_text())
    assert r["shape"]["speedup_at_tau"] == pytest.approx(by_hand(sd["costs_ms"], tau, sd["new_tokens"]))


@pytest.mark.parametrize("text, says", [("[1, 2]", "not a document"), ("{", "not JSON"),
                                        ('{"tau": 2.0}', "no `model` field"),
                                        ('{"tau": 2.0, "model": {"costs_ms": {"step": 1}}}', "no costs of each part")])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, text, says):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    assert _load().main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
