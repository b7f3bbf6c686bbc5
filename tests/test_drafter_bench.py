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
