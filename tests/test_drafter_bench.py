"""benchmarks/drafter_bench.py end to end on the CPU (tiny shape): each variant in its own process,
the results file, and the two update paths (--update) training the same steps."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "drafter_bench.py"


def test_both_updates_run_and_start_from_the_same_loss(tmp_path):
    got = {}
    for update in ("trainer", "clip+fused"):
        out = tmp_path / update.replace("+", "_")
        p = subprocess.run([sys.executable, str(BENCH), "--tiny", "--variants", "eager/sdpa/dense", "--steps", "2",
                            "--warmup", "1", "--update", update, "--out", str(out)],
                           capture_output=True, text=True, timeout=300, cwd=REPO)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        (r,) = json.loads((out / "results.json").read_text())
        assert r["ok"] and r["update"] == update and r["ms_per_sample"] > 0
        # the first timed step trains on step 0's batch again, after step 0's update: it moved
        assert r["step_losses"][0] != r["loss0"], "no update happened: the comparison below proves nothing"
        got[update] = (r["loss0"], r["gradnorm0"], r["step_losses"])
    # the same start; and on the CPU the trainer's update (clip_grad_norm_ + torch's AdamW, in
    # apply_update) is clip_grad_norm_ + AdamW: the same later losses, bit for bit
    assert got["trainer"] == got["clip+fused"]


def test_the_fp32_reference_runs_and_every_variant_is_compared_against_it(tmp_path):
    """fp32/sdpa/dense is the reference for the step-0 numbers: it runs as the eager policy, on the
    CPU (fp32 anyway, so this cannot tell autocast's absence: on a GPU the reference's numbers
    differ from eager's, docs/benchmarks.md) it gives the eager dense path's numbers exactly, and
    the summary gains a column of distances from it."""
    out = tmp_path / "ref"
    p = subprocess.run([sys.executable, str(BENCH), "--tiny", "--variants", "fp32/sdpa/dense,eager/sdpa/dense",
                        "--steps", "1", "--warmup", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    ref, dense = json.loads((out / "results.json").read_text())
    assert ref["ok"] and dense["ok"] and ref["policy"] == "eager"
    assert (ref["loss0"], ref["gradnorm0"]) == (dense["loss0"], dense["gradnorm0"])
    summary = (out / "summary.md").read_text()
    assert "vs fp32 (the reference)" in summary
    assert "| eager/sdpa/dense |" in summary and summary.count("0.0e+00 / 0.0e+00") == 2
