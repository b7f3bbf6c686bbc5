#!/usr/bin/env bash
# What issue 14 still needs measured on two GPUs, in ONE device call (docs/benchmarks.md, "Not
# measured yet", Two H200s), on nvidia-h200-x2:
#
#     OUT=$OUT bash scripts/speed_check.sh                      # ~7 minutes from a cold compile cache
#     OUT=/tmp/sc EXTRA="--tiny --policy eager" PYTHON=.venv/bin/python bash scripts/speed_check.sh  # CPU
#
# 1. one GPU, threads: the trainer's step now (it also warms the compile cache for the rest);
# 2. two GPUs, threads: the CUDA-graph target forward against the launched one (--graph-target);
# 3. two GPUs, processes: one torchrun rank per GPU (no interpreter shared).
# Each with the look-ahead (the next step's target forward during the gradient sum) on and off, in
# blocks of 8 steps (the host runs ahead within a block, as the trainer's loop). Then the per-GPU
# throughput of each two-GPU case against the one-GPU step (look-ahead on) of this same call.
# First, the tests that only a GPU runs (the Triton cross-entropy kernel, the fp32 weight gradients; ~40 s).
set -u
OUT=${OUT:-out/speed_check}
EXTRA=${EXTRA:-}
export PYTHONUNBUFFERED=1
bench() { timeout "$1" "${PYTHON:-python3}" benchmarks/train_step_bench.py $EXTRA "${@:2}" 2>&1 | grep -v '^USDT'; }
[ -z "$EXTRA" ] && timeout 150 "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider tests/test_ce_kernel.py tests/test_linear_grads.py 2>&1 | tail -3
bench 300 --out "$OUT/one" --target-mode compiled --lookahead on,off --steps 24 --warmup 8
bench 300 --out "$OUT/threads" --gpus 2 --workers 2 --target-mode graphed,compiled --lookahead on,off --steps 48 --warmup 16
bench 300 --out "$OUT/processes" --gpus 2 --workers 2 --topology processes --target-mode compiled --lookahead on,off --steps 24 --warmup 8
"${PYTHON:-python3}" - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def modes(name):
    try:
        return json.loads((out / name / "results.json").read_text()).get("modes") or {}
    except (OSError, ValueError):
        return {}
one = modes("one").get("compiled+on", {}).get("total_ms_per_sample")
print(f"one GPU, threads: {one} ms/sample")
for name in ("threads", "processes"):
    for mode, m in modes(name).items():
        two = m["total_ms_per_sample"]
        share = f"{100 * one / (2 * two):.1f}% per GPU" if one else "no one-GPU figure"
        print(f"two GPUs, {name}, {mode}: {two} ms/sample of the global batch: {share}")
PY
