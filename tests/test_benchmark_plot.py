"""benchmarks/plot_drafter.py: pure rendering of drafter_bench records."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "plot_drafter.py"
spec = importlib.util.spec_from_file_location("plot_drafter", SCRIPT)
plot_drafter = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_drafter)

RECORDS = [
    {"variant": "eager/sdpa/dense", "ok": True, "batch": 2, "ms_per_sample": 106.2},
    {"variant": "inductor/flex/chunked", "ok": True, "batch": 2, "ms_per_sample": 58.0,
     "profile": {"steps": 2, "by_category_ms": {"matmul": 183.2, "optimizer": 24.0}}},
    {"variant": "inductor/sdpa/dense", "ok": True, "batch": 2, "ms_per_sample": 81.7,
     "profile": {"per_sample_ms": {"matmul": 43.9}}},
    {"variant": "reduce-overhead/flex/chunked", "ok": False, "error": "PolicyError"},
]


def test_breakdown_is_per_sample():
    assert plot_drafter.per_sample_breakdown(RECORDS[1]) == pytest.approx({"matmul": 45.8, "optimizer": 6.0})
    assert plot_drafter.per_sample_breakdown(RECORDS[2]) == {"matmul": 43.9}
    assert plot_drafter.per_sample_breakdown(RECORDS[0]) == {}


def test_writes_a_png_of_what_ran(tmp_path):
    out = plot_drafter.plot(RECORDS, tmp_path / "r" / "bench.png", "title")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no variant"):
        plot_drafter.plot(RECORDS[3:], tmp_path / "none.png")


def test_cli_refuses_a_bad_file_in_one_line(tmp_path, capsys):
    assert plot_drafter.main([str(tmp_path / "missing.json"), "-o", str(tmp_path / "x.png")]) == 2
    assert "missing.json" in capsys.readouterr().err


TS_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "plot_train_step.py"
_ts_spec = importlib.util.spec_from_file_location("plot_train_step", TS_SCRIPT)
plot_train_step = importlib.util.module_from_spec(_ts_spec)
_ts_spec.loader.exec_module(plot_train_step)

TS_ONE = {"gpus": 1, "modes": {"compiled": {"features_ms_per_sample": 17.5, "drafter_ms_per_sample": 69.5,
                                            "total_ms_per_sample": 87.0}}}
TS_TWO = {"gpus": 2, "modes": {"compiled+nccl": {"features_ms_per_sample": 10.8, "drafter_ms_per_sample": 37.3,
                                                 "total_ms_per_sample": 48.1}}}


def test_train_step_bars_are_gpu_ms_per_sample():
    one, two = plot_train_step.bars([("a", TS_ONE), ("b", TS_TWO)])
    assert (one["target"], one["drafter"], one["total"]) == (17.5, 69.5, 87.0)
    # two GPUs: ms per sample of the global batch x 2 = what one sample costs a GPU
    assert (two["target"], two["drafter"], two["total"]) == pytest.approx((21.6, 74.6, 96.2))
    assert "per GPU" in two["label"] and "per GPU" not in one["label"]


def test_train_step_plot_writes_a_png(tmp_path):
    out = plot_train_step.plot([("a", TS_ONE), ("b", TS_TWO)], tmp_path / "ts.png", "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_step_cli_takes_chosen_modes_and_refuses_a_missing_one(tmp_path, capsys):
    import json

    f = tmp_path / "r.json"
    f.write_text(json.dumps({"gpus": 1, "modes": dict(TS_ONE["modes"], other=TS_ONE["modes"]["compiled"])}))
    assert [b["label"] for b in plot_train_step.bars([("a", json.loads(f.read_text()))], [["other"]])] == ["a\nother"]
    assert plot_train_step.main([f"{f}@other=x", "-o", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").exists()
    assert plot_train_step.main([f"{f}@nope", "-o", str(tmp_path / "q.png")]) == 2
    assert "no mode 'nope'" in capsys.readouterr().err


SD_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "plot_specdec.py"
sd_spec = importlib.util.spec_from_file_location("plot_specdec", SD_SCRIPT)
plot_specdec = importlib.util.module_from_spec(sd_spec)
sd_spec.loader.exec_module(plot_specdec)


def test_specdec_plot_of_the_recorded_result(tmp_path, capsys):
    data = Path(__file__).resolve().parent.parent / "docs" / "data" / "small-target-h200" / "specdec.json"
    assert plot_specdec.main([str(data), "-o", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_specdec.main([str(tmp_path / "missing.json"), "-o", str(tmp_path / "x.png")]) == 2
    assert "missing.json" in capsys.readouterr().err


_claims = importlib.util.spec_from_file_location("claims_table", SCRIPT.parent / "claims_table.py")
claims_table = importlib.util.module_from_spec(_claims)
_claims.loader.exec_module(claims_table)


def test_a_claim_holds_only_when_the_intervals_part():
    doc = lambda tau, lo, hi: {"tau": tau, "tau_ci95": [lo, hi]}  # noqa: E731
    assert claims_table.verdict(doc(1.5, 1.45, 1.55), doc(1.3, 1.25, 1.35)) == "held"
    assert claims_table.verdict(doc(1.5, 1.40, 1.60), doc(1.45, 1.38, 1.52)) == "within noise"
    assert claims_table.verdict(doc(1.3, 1.25, 1.35), doc(1.5, 1.45, 1.55)) == "did not hold"
    assert claims_table.verdict(doc(1.5, 1.45, 1.55), {"tau": 1.3, "tau_ci95": None}) == "within noise"


def test_claims_table_of_the_recorded_run(tmp_path, capsys):
    data = Path(__file__).resolve().parent.parent / "docs" / "data" / "small-target-claims-h200"
    assert claims_table.main([str(data), "-o", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "| the decaying loss weights beat uniform weights |" in out and "not run (block8 missing)" in out
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert claims_table.main([str(tmp_path)]) == 2
