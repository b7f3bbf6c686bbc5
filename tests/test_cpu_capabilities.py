"""The numerics tests hold on any x86 CPU: run under each of torch's CPU kernel sets this CPU can run.

torch picks its CPU kernels per machine (ATEN_CPU_CAPABILITY: default, avx2, avx512); they sum in
other orders and fuse other multiply-adds, so a tolerance read off one machine's output fails on
another. The comparisons take their bounds from tests/tolerance.py; this runs the comparisons of
formulations (training pass vs decoding, sparse vs dense, chunked vs whole, folded vs plain
update) in a subprocess per kernel set. inductor picks its vector ISA from ATEN_CPU_CAPABILITY but
compiles with -march=native unless TORCHINDUCTOR_CPP_MARCH says otherwise; a mismatch miscompiles
(avx2 kernels built for AVX-512 registers) or fails to build (default), so the march is set to the
kernel set's own x86-64 level, as on a machine of that level.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["default", "avx2", "avx512"]
MARCH = {"default": "x86-64", "avx2": "x86-64-v3", "avx512": "x86-64-v4"}
NUMERICS = [
    "tests/test_trainer_model.py::test_training_forward_equals_one_block_at_a_time",
    "tests/test_trainer_model.py::test_features_in_decoding_match_features_in_training",
    "tests/test_trainer_model.py::test_first_layer_on_the_distinct_rows_is_the_same_function",
    "tests/test_trainer_model.py::test_the_last_layer_on_the_predicted_rows_is_the_same_function",
    "tests/test_trainer_model.py::test_block_rows_linear_sums_the_repeated_rows_gradient",
    "tests/test_trainer_kernels.py::test_draft_loss_skips_only_the_anchor_rows_that_carry_no_loss",
    "tests/test_trainer_kernels.py::test_flex_equals_dense_sdpa_eager",
    "tests/test_trainer_kernels.py::test_chunked_ce_equals_unfused_in_value_gradient_and_counts",
    "tests/test_trainer_kernels.py::test_chunked_ce_gives_the_trainable_final_norm_its_gradient",
    "tests/test_trainer_kernels.py::test_chunked_ce_under_bf16_autocast_matches_unfused",
    "tests/test_update.py::test_folded_clip_equals_clip_then_step",
]


def _native() -> str:
    return torch.backends.cpu.get_cpu_capability().lower()


@pytest.mark.skipif(_native() not in ORDER, reason="not an x86 CPU: torch has no kernel sets to choose between")
@pytest.mark.parametrize("capability", ORDER)
def test_numerics_hold_under_each_cpu_kernel_set(capability):
    if ORDER.index(capability) > ORDER.index(_native()):
        pytest.skip(f"this CPU runs at most {_native()} kernels")
    if capability == _native():
        pytest.skip(f"{capability} is this CPU's own: the suite itself runs these tests with it")
    env = {"ATEN_CPU_CAPABILITY": capability, "TORCHINDUCTOR_CPP_MARCH": MARCH[capability],
           "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *NUMERICS],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and " failed" not in p.stdout
