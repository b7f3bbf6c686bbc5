#!/usr/bin/env bash
# What issue 14 still needs measured on ONE H200 (docs/benchmarks.md, "Not measured yet", One H200),
# in three device calls of under 10 minutes each (a cold compile of the drafter costs ~2 minutes):
#
#     git archive -o .scratch/old.tar BASE trainer benchmarks        # here first: the tree to compare with
#     STAGES="tests ab" OUT=$OUT OLD=.scratch/old.tar bash scripts/h200_check.sh    # device, carry .scratch
#     STAGES="reference step" OUT=$OUT bash scripts/h200_check.sh                    # device
#     STAGES=flex OUT=$OUT bash scripts/h200_check.sh                                # device, ~3 min
#
# On the CPU the same path runs at the tiny shape (the tests stage needs CUDA and is skipped there):
#
#     OUT=/tmp/hc OLD=/tmp/old.tar EXTRA=--tiny VARIANT=eager/sdpa/chunked PYTHON=.venv/bin/python \
#         bash scripts/h200_check.sh
#
# Stages (STAGES, default the first four, in this order):
#   tests      the tests only a GPU runs: the CE kernel, the fp32 weight gradients, the first layer's rows;
#   ab         the drafter step (VARIANT, default the trainer's inductor/flex/chunked), this tree
#              against OLD (an archive of trainer/ and benchmarks/), A/B/A, one process each;
#   reference  the fp32 reference and the bf16 dense path, for drafter_bench's "vs fp32" column;
#   step       the whole training step (target + drafter) in this tree;
#   flex       the FlexAttention call alone per tile choice (flex_bench.py's list: the forward's tiles
#              under the tuned backward's among them); needs CUDA.
# Every result lands in OUT/<stage...>/results.json; each stage's summary is printed.
set -u
OUT=${OUT:-out/h200_check}
STAGES=${STAGES:-tests ab reference step}
VARIANT=${VARIANT:-inductor/flex/chunked}
EXTRA=${EXTRA:-}
PY=${PYTHON:-python3}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac   # the A/B runs from another folder
export PYTHONUNBUFFERED=1
# one compile cache for every process of the call (the A/B's second "new" run starts warm)
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/h200_check_inductor}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)   # absolute: the A/B runs the old tree from its own folder

drafter() {  # drafter TREE NAME: the drafter step of the tree at TREE
    (cd "$1" && timeout 175 "$PY" benchmarks/drafter_bench.py $EXTRA --out "$OUT/$2" --profile "" \
        --timeout 170 --steps 12 --warmup 2 --variants "$VARIANT" 2>&1 | tail -4)
}

for stage in $STAGES; do
    echo "== $stage"
    case $stage in
    tests)
        if [ -n "$EXTRA" ]; then echo "(needs CUDA: skipped)"; continue; fi
        timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_ce_kernel.py tests/test_linear_grads.py 2>&1 | tail -3
        ;;
    ab)
        if [ ! -f "${OLD:-}" ]; then echo "h200_check: ab needs OLD=archive.tar (git archive -o F BASE trainer benchmarks)" >&2; exit 2; fi
        old=$(mktemp -d)
        tar -xf "$OLD" -C "$old"
        drafter . ab-new-1
        drafter "$old" ab-old
        drafter . ab-new-2
        rm -rf "$old"
        ;;
    reference)
        timeout 110 "$PY" benchmarks/drafter_bench.py $EXTRA --out "$OUT/reference" --profile "" --timeout 100 \
            --steps 3 --warmup 1 --variants fp32/sdpa/dense,eager/sdpa/dense 2>&1 | tail -5
        ;;
    step)
        if [ -n "$EXTRA" ]; then args="--policy eager --steps 4 --warmup 1"
        else args="--target-mode compiled --steps 24 --warmup 8"; fi
        timeout 260 "$PY" benchmarks/train_step_bench.py $EXTRA $args --out "$OUT/step" 2>&1 | tail -4
        ;;
    flex)
        if [ -n "$EXTRA" ]; then echo "(needs CUDA: skipped)"; continue; fi
        timeout 200 "$PY" benchmarks/flex_bench.py --out "$OUT/flex" 2>&1 | tail -16
        ;;
    *)
        echo "h200_check: unknown stage $stage (tests, ab, reference, step, flex)" >&2
        exit 2
        ;;
    esac
done
