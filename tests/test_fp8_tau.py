"""benchmarks/fp8_tau.py: the fp8 proof's verdict (the mean of fp8's seeds within bf16's run-to-run
spread over the same seeds), its table and its plot, from the files scripts/fp8_check.sh writes."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "fp8_tau.py"
spec = importlib.util.spec_from_file_location("fp8_tau", SCRIPT)
fp8_tau = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fp8_tau)


def _runs(folder: Path, taus: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for (precision, seed), tau in taus.items():
        name = f"{precision}-s{seed}"
        (folder / f"specdec-{name}.json").write_text(json.dumps({"tau": tau, "tau_ci95": [tau - 0.1, tau + 0.1],
                                                                  "rounds": 900}))
        (folder / f"metrics-{name}.jsonl").write_text("".join(
            json.dumps({"step": s, "loss": 5.0 - s / 100 + seed / 50}) + "\n" for s in (10, 20, 30))
            + json.dumps({"event": "done", "step": 30, "loss": 4.7}) + "\n")
    return folder


BF16 = {("bf16", 0): 1.45, ("bf16", 1): 1.50, ("bf16", 2): 1.47}


def test_fp8_keeps_tau_within_bf16s_spread_and_not_outside_it(tmp_path):
    docs, _ = fp8_tau.load(_runs(tmp_path / "a", {**BF16, ("fp8", 0): 1.44, ("fp8", 1): 1.47, ("fp8", 2): 1.46}))
    line, fig = fp8_tau.verdict(docs, "fp8")
    assert "KEEPS tau" in line and fig["bf16_spread"] == pytest.approx(0.05)
    assert fig["difference"] == pytest.approx((1.44 + 1.47 + 1.46) / 3 - (1.45 + 1.50 + 1.47) / 3)
    docs, _ = fp8_tau.load(_runs(tmp_path / "b", {**BF16, ("fp8", 0): 1.38, ("fp8", 1): 1.40, ("fp8", 2): 1.41}))
    line, fig = fp8_tau.verdict(docs, "fp8")
    assert "does NOT keep tau (costs 0.077)" in line and fig["complete"] and "PRELIMINARY" not in line
    docs, _ = fp8_tau.load(_runs(tmp_path / "c", {("bf16", 0): 1.45, ("bf16", 1): 1.50, ("fp8", 0): 1.46}))
    line, fig = fp8_tau.verdict(docs, "fp8")   # a call cut short: a verdict, said to be preliminary
    assert line.endswith("KEEPS tau (within bf16's spread) (PRELIMINARY: 2 and 1 seed(s); the proof takes 3 each)")
    assert not fig["complete"]
    line, fig = fp8_tau.verdict({("bf16", 0): {"tau": 1.5}, ("fp8", 0): {"tau": 1.5}}, "fp8")
    assert "no verdict" in line and fig == {}


def test_cli_prints_the_table_and_plots_the_curves_together(tmp_path, capsys):
    folder = _runs(tmp_path / "tau", {**BF16, ("fp8-rowwise", 0): 1.46, ("fp8-rowwise", 1): 1.48})
    assert fp8_tau.main([str(folder), "-o", str(tmp_path / "p.png"), "--json", str(tmp_path / "v.json")]) == 0
    out = capsys.readouterr().out
    assert "| bf16 | 0 | 1.450 (95% 1.350-1.550, 900 rounds) | 4.7000 |" in out
    assert "fp8-rowwise: held-out tau 1.470" in out
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "v.json").read_text())["fp8-rowwise"]["seeds"] == [3, 2]
    assert fp8_tau.main([str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.strip().endswith("no specdec-PRECISION-sSEED.json in it")
