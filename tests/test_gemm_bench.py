"""benchmarks/gemm_bench.py: its list of GEMMs is the drafter step's matmuls (the timing needs CUDA)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from trainer.model.drafter import DrafterConfig, flops_needed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gemm_bench  # noqa: E402
from drafter_bench import SHAPES  # noqa: E402


def test_the_gemms_are_the_matmuls_that_flops_needed_counts():
    sh = SHAPES["8b"]
    cfg = DrafterConfig(hidden_size=sh["hidden"], vocab_size=sh["vocab"], mask_token_id=0, num_layers=sh["layers"],
                        num_heads=sh["heads"], num_kv_heads=sh["kv"], head_dim=sh["hd"],
                        intermediate_size=sh["inter"], block_size=sh["block"])
    per_sample = sum(gemm_bench.flops(g) * g["count"] for g in gemm_bench.gemms()) / sh["batch"]
    # attention's own FLOPs are not GEMMs of the step: count none of them
    want = flops_needed(cfg, sh["seq"], sh["anchors"] * sh["block"], attended_pairs=0)
    assert per_sample == pytest.approx(want, rel=1e-9)
    for chunk in (1024, 2048, 7680):  # every chunking covers the same lm_head rows
        rows = [g for g in gemm_bench.gemms(chunk) if g["name"].startswith("lm_head") and g["kind"] == "fwd"]
        assert sum(g["rows"] * g["count"] for g in rows) == gemm_bench.HEAD_ROWS


def test_without_cuda_it_says_so_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gemm_bench.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip() == "gemm_bench: needs CUDA"
