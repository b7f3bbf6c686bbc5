"""benchmarks/flex_bench.py and the FlexAttention tile choice it measures (trainer/model/attention.py).

The timing needs a GPU (FlexAttention has no CPU backward); here: the choice's parsing, where it
applies, and the script's one-line refusals.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.model import attention

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import flex_bench  # noqa: E402


def test_choices_parse_to_backward_kernel_options_and_kv_expansion():
    assert attention.parse_tiles("default") == attention.FlexChoice(None, False)
    assert attention.parse_tiles("default+kv") == attention.FlexChoice(None, True)
    assert attention.parse_tiles("32-64-64-32-3-4").options == {
        "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 3, "bwd_num_warps": 4}
    assert attention.parse_tiles("32-64-64-32-3-4+kv").expand_kv
    both = attention.parse_tiles("32-64-64-32-3-4/64-128-2-8+kv")
    assert both.expand_kv and both.options == {
        "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 3, "bwd_num_warps": 4,
        "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_stages": 2, "fwd_num_warps": 8}
    assert attention.parse_tiles("default/128-64-3-8").options == {
        "fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 8}
    for bad in ("", "32-64", "32-64-64-32-3-x", "0-64-64-32-3-4", "default+gqa"):
        with pytest.raises(ValueError, match=r"M1-N1-M2-N2-STAGES-WARPS|only suffix is \+kv"):
            attention.parse_tiles(bad)
    for bad in ("default/", "default/64-64-3", "32-64-64-32-3-4/64-64-3-x", "default/0-64-3-4"):
        with pytest.raises(ValueError, match=r"the forward's as M-N-STAGES-WARPS"):
            attention.parse_tiles(bad)
    for choice in flex_bench.DEFAULT_CONFIGS.split(","):
        attention.parse_tiles(choice)


def test_the_tuned_choice_applies_to_cuda_only_and_the_option_overrides(monkeypatch):
    monkeypatch.setattr(attention, "TILES", None)
    assert attention.flex_choice(torch.device("cpu")) == attention.FlexChoice()
    for text in attention.TUNED_BWD_TILES.values():
        attention.parse_tiles(text)
    attention.configure("64-64-64-64-3-4+kv")
    got = attention.flex_choice(torch.device("cpu"))
    assert got.options["bwd_BLOCK_M1"] == 64 and got.expand_kv
    attention.configure("default")
    assert attention.flex_choice(torch.device("cpu")) == attention.FlexChoice()


@pytest.mark.parametrize("args, needle", [
    (["--configs", "default,1-2"], "flex_bench: FlexAttention tiles '1-2'"),
    (["--configs", "default+q"], "flex_bench: FlexAttention choice 'default+q'"),
    (["--configs", "default"], "flex_bench: needs a CUDA GPU"),
])
def test_the_script_refuses_in_one_line(args, needle, tmp_path):
    if needle.endswith("GPU") and torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would run")
    r = subprocess.run([sys.executable, "benchmarks/flex_bench.py", "--out", str(tmp_path), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and needle in r.stderr
