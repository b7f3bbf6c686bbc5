"""benchmarks/specdec_bootstrap.py: a specdec run's per-prompt records, from its document or its log."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from specdec_bootstrap import figures, main, read_doc, read_log  # noqa: E402

SMALL_TARGET_RUN = REPO / "docs" / "data" / "small-target-r5-h200"


def test_a_logs_lines_give_each_prompts_rounds_without_the_prefills_token():
    rows = read_log("specdec: prompt 1/3: 23 tokens, tau 2.88, 70.3 -> 114.2 tokens/s\n"
                    "specdec: prompt 2/3: 1 tokens, tau 1.00, 58.3 -> 57.9 tokens/s\n"
                    "specdec: prompt 3/3: 3 tokens, tau 3.00, 12.5 tokens/s\n")
    assert [len(r["rounds"]) for r in rows] == [8, 0, 1]  # 23 / 2.88 = 8 rounds that produced 22 tokens
    assert [sum(r["rounds"]) for r in rows] == [22, 0, 2]
    assert rows[0]["alone_s"] == pytest.approx(23 / 70.3) and rows[0]["spec_s"] == pytest.approx(23 / 114.2)
    assert rows[2]["alone_s"] is None  # a run without the baseline


def test_a_line_of_another_format_is_refused():
    with pytest.raises(ValueError, match="no whole number of rounds"):  # 128 tokens, 60 rounds, tau without prefill
        read_log("specdec: prompt 1/1: 128 tokens, tau 2.12, 48.5 -> 74.4 tokens/s\n")


def test_the_small_target_runs_log_gives_its_documents_totals():
    rows = read_log((SMALL_TARGET_RUN / "specdec-main-speed.log").read_text())
    doc = json.loads((SMALL_TARGET_RUN / "specdec-main-speed.json").read_text())
    assert len(rows) == doc["prompts"] and sum(r["tokens"] for r in rows) == doc["tokens"]
    got = figures(rows, resamples=200)
    assert got["rounds"] == doc["rounds"] and got["tau"] == doc["tau"]
    assert got["speedup"] == pytest.approx(doc["speedup"], rel=2e-3)  # the log's rates have one decimal
    lo, hi = got["tau_ci95"]
    assert lo < doc["tau_ci95"][0] and hi > doc["tau_ci95"][1]  # wider than the per-round interval
    without = figures(rows, drop_tau=10, resamples=200)
    assert without["dropped"] == 5 and without["prompts"] == 25 and without["tau"] < 3


def test_a_document_with_per_prompt_records(tmp_path, capsys):
    per = [{"rounds": [3, 1, 2], "tokens": 7, "alone_s": 0.7, "spec_s": 0.3},
           {"rounds": [12, 12], "tokens": 25, "alone_s": 2.5, "spec_s": 0.25}]
    path = tmp_path / "specdec.json"
    path.write_text(json.dumps({"prompts": 2, "per_prompt": per}))
    assert main([str(path), "--json", "--drop-tau", "10", "--resamples", "100"]) == 0
    full, without = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert full["tau"] == 30 / 5 and full["speedup"] == pytest.approx((32 / 0.55) / (32 / 3.2))
    assert without["prompts"] == 1 and without["tau"] == 2 and without["speedup_ci95"] is None
    with pytest.raises(ValueError, match="per_prompt"):
        read_doc({"prompts": 2})


def test_an_old_document_is_refused_with_one_line(capsys):
    assert main([str(SMALL_TARGET_RUN / "specdec-main-speed.json")]) == 2
    assert "give its log instead" in capsys.readouterr().err


ENGINES_1203B = REPO / "docs" / "data" / "decode-engines-h200-2026-12-03b"


def test_the_warmed_documents_print_the_lossless_one_first_then_the_sample_then_the_subsets(capsys):
    bf16, fp32 = ENGINES_1203B / "specdec-graphs-bf16.json", ENGINES_1203B / "specdec-graphs-fp32.json"
    assert main([str(bf16), str(fp32), "--resamples", "200"]) == 0
    out = capsys.readouterr().out
    first, second = out.split(f"{bf16}:")
    assert first.startswith(f"{fp32}: fp32, lossless (240/240 equal")
    lines = second.splitlines()
    assert lines[0] == " bf16, 137/240 equal (max margin 0.125 where they differ, 48 exact ties)"
    assert lines[1].startswith("  one-token prompts") and ": 39 of 240" in lines[1]
    assert lines[2].startswith("  outputs ending in an exact loop") and "): 45 (by period 2: 5, 3: 7," in lines[2]
    assert [line.split(" (n ")[1].split(")")[0] for line in lines[3:6]] == ["240", "201", "156"]
    assert lines[3].startswith("  all prompts (n 240): tau 2.90 (95% ") and "speedup 1.70x" in lines[3]


def test_the_warmed_document_as_json_with_drop_tau(capsys):
    doc = ENGINES_1203B / "specdec-graphs-bf16.json"
    assert main([str(doc), "--json", "--resamples", "100", "--drop-tau", "10"]) == 0
    split, without = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert split["dtype"] == "bfloat16" and split["agreement"].startswith("bf16, 137/240 equal")
    assert split["all"]["prompts"] == 240 and len(split["one_token"]) == 39
    assert without["dropped"] > 0 and without["prompts"] == 240 - without["dropped"]
