"""benchmarks/decode_engines.py on the stored H200 measurement (docs/data/decode-engines-h200-2026-12-03):
the figures docs/benchmarks.md section 16 and docs/decoding.md quote come out of it, recomputed."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from decode_engines import bar_scale, main  # noqa: E402

G7 = REPO / "docs" / "data" / "decode-engines-h200-2026-12-03"
G7B = REPO / "docs" / "data" / "decode-engines-h200-2026-12-03b"  # G7 again, prompts warmed


def test_the_stored_measurement_gives_the_documented_figures(capsys):
    assert main([str(G7), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    bf16, fp32, eager = rows["graphs-bf16"], rows["graphs-fp32"], rows["eager-fp32"]
    assert (bf16["prompts"], fp32["prompts"], eager["prompts"]) == (240, 240, 20)
    assert round(bf16["speedup"], 2) == 1.48 and [round(x, 2) for x in bf16["speedup_ci95"]] == [1.41, 1.55]
    assert round(bf16["tau"], 2) == 2.83 and round(bf16["model"]["tau_for_2x"], 2) == 3.14
    assert fp32["equal"] == 240 and bf16["equal"] == 132 and max(bf16["margins_where_differ"]) == 0.125
    assert round(eager["speedup"], 2) == 1.90 and round(rows["graphs-bf16@20"]["speedup"], 2) == 1.23
    # made before prefill was kept per prompt: what the rounds and the steps leave of the totals
    spec, alone = bf16["prefill_ms_per_prompt"]
    assert spec == pytest.approx(38.5, abs=0.05) and alone == pytest.approx(15.6, abs=0.05)


def test_a_bench_decode_document_reads_as_specdecs(tmp_path, capsys):
    """`dflash-ops bench-decode --json` keeps specdec's round-cost model as cost_model ("model" is the run's
    --target there): the table reads it from either."""
    doc = json.loads((G7 / "specdec-graphs-bf16.json").read_text())
    bench = {**doc, "model": "small-code-gpu", "cost_model": doc["model"], "target": "ct200"}
    (tmp_path / "specdec-bench.json").write_text(json.dumps(bench))
    assert main([str(tmp_path), "--json"]) == 0
    assert round(json.loads(capsys.readouterr().out)["bench"]["model"]["tau_for_2x"], 2) == 3.14


def test_a_folder_of_graphs_runs_alone_plots_on_a_linear_axis(tmp_path, capsys):
    """G7 again (2026-12-03b) made no eager run: the table and the plot come out of the two graphs documents,
    whose bars (~1.4 to ~2.3 ms) a log axis would cut off near the shortest; eager beside them keeps it."""
    pytest.importorskip("matplotlib")
    assert main([str(G7B), "-o", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines()[2:]] == ["| graphs-bf16",
                                                                                           "| graphs-fp32"]
    assert bar_scale([2.31, 1.36, 2.33, 1.67]) == "linear" and bar_scale([2.29, 1.55, 17.2, 9.1]) == "log"


def test_a_folder_without_documents_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no specdec-*.json" in capsys.readouterr().err


def test_the_closing_lines_say_what_tau_2x_needs_where_it_was_not_reached():
    """specdec's closing line and bench-decode's summary on the stored bf16 document (1.48x): the tau at
    which these round costs would give 2x; a document at 2x or more says nothing of it."""
    pytest.importorskip("torch")
    from orchestrator.runs.bench_decode import summary
    from trainer.run.specdec import result_line

    doc = json.loads((G7 / "specdec-graphs-bf16.json").read_text())
    # bench-decode's document: "model" is the run's --target, specdec's model of the costs "cost_model"
    bench = {**doc, "target": "ct200", "model": "small-code-gpu", "cost_model": doc["model"], "run": "R",
             "step": 5700, "prompts_source": "held-out"}
    for line in (result_line(doc), summary(bench)):
        assert "speedup 1.48x" in line and "; 2x needs tau 3.14" in line, line
    fast = {"speedup": 2.1}
    assert "needs tau" not in result_line({**doc, **fast}) and "needs tau" not in summary({**bench, **fast})
