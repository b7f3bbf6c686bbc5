#!/usr/bin/env bash
# --precision fp8 on one H200 (docs/precision.md): what it saves and what it costs, in device calls
# of under 10 minutes each. Here first: `make fp8-wheel` (the GPU machine reaches no package
# registry); each call carries .scratch, and the script installs the wheel with pip --no-deps.
#
#     STAGES=step  OUT=$OUT bash scripts/fp8_check.sh          # drafter step, A/B/C/A: 456 s
#     STAGES=tests OUT=$OUT bash scripts/fp8_check.sh          # fp8's tests on the GPU: 152 s
#     STAGES=tau   OUT=$OUT WORK=/tmp/fp8 bash scripts/fp8_check.sh   # data + 3 seeds x {bf16, fp8}: 628 s
#     STAGES=whole WHOLE_ORDER="bf16 fp8" OUT=$OUT bash scripts/fp8_check.sh   # the whole step: 265 s
#
# (one H200, 2026-12-02; tests and tau may share the GPU, step and whole must have it alone.)
#
# A CPU dry run of every stage at its smallest (fp8 emulated, the tiny shapes and small-code-smoke):
#
#     SIZE=smoke PY=.venv/bin/python OUT=/tmp/f8 WORK=/tmp/f8w bash scripts/fp8_check.sh
#
# Stages (STAGES, default all five, in this order):
#   tests  tests/test_fp8.py, whose torch._scaled_mm test needs FP8 tensor cores (skipped elsewhere);
#   step   benchmarks/drafter_bench.py's 8B drafter step (VARIANT, default the trainer's
#          inductor/flex/chunked in a worker thread), one process per precision in ORDER
#          (default bf16 fp8 fp8-rowwise bf16: A/B/C/A), each in OUT/step-K-PRECISION;
#   whole  benchmarks/train_step_bench.py, target + drafter, compiled target, per precision in
#          WHOLE_ORDER (default bf16 fp8 fp8-rowwise), each in OUT/whole-PRECISION;
#   data   the small real target's data (scripts/small_target_data.sh: build, prompts, regen) in WORK;
#   tau    SEEDS (default 0 1 2) x {bf16, TAU_PRECISION (default fp8)}: the same data and steps
#          (STEPS x BATCH rows), PARALLEL trainings at a time, each exported and decoded on the
#          held-out prompts (tau); then benchmarks/fp8_tau.py: the table, the verdict and the plot
#          of the loss curves together (OUT/tau/fp8-tau.png). It makes the data first when WORK
#          has none (the machine went back between the calls). TAU_RUNS="fp8:1 fp8:2 bf16:2" runs
#          just those (the rest of a proof a call left short; merge the folders for fp8_tau.py).
set -uo pipefail
cd "$(dirname "$0")/.."
status=0   # 1 when a stage failed; every stage still runs
SIZE=${SIZE:-gpu}; OUT=${OUT:-out/fp8_check}; WORK=${WORK:-/tmp/fp8-check}
STAGES=${STAGES:-tests step whole data tau}; VARIANT=${VARIANT:-inductor/flex/chunked}; BENCH_STEPS=(12 2 24 8)
ORDER=${ORDER:-bf16 fp8 fp8-rowwise bf16}; WHOLE_ORDER=${WHOLE_ORDER:-bf16 fp8 fp8-rowwise}
SEEDS=${SEEDS:-0 1 2}; TAU_PRECISION=${TAU_PRECISION:-fp8}; PARALLEL=${PARALLEL:-6}
N_TRAIN=${N_TRAIN:-8000}; N_EVAL=${N_EVAL:-30}; NEW=${NEW:-128}; REGEN_BATCH=${REGEN_BATCH:-1024}
STEPS=${STEPS:-400}; BATCH=${BATCH:-16}; LOG_EVERY=${LOG_EVERY:-10}; ANCHORS=${ANCHORS:-512}; SEQ=${SEQ:-512}; GPUS=${GPUS:-1}
PY=${PY:-python3}
WHEEL=.scratch/wheels/torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
EXTRA=(); EMULATE=()
if [ "$SIZE" = smoke ]; then   # the CPU: tiny shapes, fp8 emulated, a few steps
    EXTRA=(--tiny); EMULATE=(--fp8-emulate); GPUS=0; BENCH_STEPS=(3 1 4 2)
    [ "$VARIANT" = inductor/flex/chunked ] && VARIANT=eager/sdpa/chunked   # FlexAttention has no CPU backward
    N_TRAIN=48; N_EVAL=3; NEW=24; REGEN_BATCH=16; STEPS=6; BATCH=4; ANCHORS=4; LOG_EVERY=1
fi
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 DFLASH_OPS_CACHE=${DFLASH_OPS_CACHE:-$WORK/cache} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/fp8_check_inductor}
t0=$(date +%s)
phase() { echo "$(( $(date +%s) - t0 )) s: $*" | tee -a "$OUT/phases.log" >&2; }

if ! "$PY" -c "import torchao.float8" 2>/dev/null; then
    if [ -d .scratch/torchao/torchao ]; then   # make test-fp8's copy: on the path, never into the venv
        export PYTHONPATH="$PWD/.scratch/torchao${PYTHONPATH:+:$PYTHONPATH}"
    else
        [ -f "$WHEEL" ] || { echo "fp8_check: no torchao here and no $WHEEL: run make fp8-wheel, carry .scratch" >&2; exit 2; }
        "$PY" -m pip install -q --no-deps "$WHEEL" || exit 2
    fi
fi
phase "torchao $("$PY" -c 'from importlib.metadata import version; print(version("torchao"))' 2>/dev/null)"

# shellcheck source=scripts/small_target_data.sh
. scripts/small_target_data.sh

tau_run() {  # PRECISION SEED: train, export, decode the held-out prompts; files into $OUT/tau
    local name="$1-s$2" emulate=()
    [ "$1" != bf16 ] && emulate=("${EMULATE[@]}")
    rm -rf "$WORK/run-$name" "$WORK/drafter-$name"
    $PY -m trainer --target "$target" --data "$WORK/regen.jsonl" --out "$WORK/run-$name" --gpus "$GPUS" \
        --steps "$STEPS" --batch-size "$BATCH" --anchors "$ANCHORS" --seq-len "$SEQ" "${SMALL_DRAFTER[@]}" \
        --log-every "$LOG_EVERY" --seed "$2" --precision "$1" \
        "${emulate[@]}" > "$OUT/tau/train-$name.log" 2>&1 || return 1
    cp "$WORK/run-$name/metrics.jsonl" "$OUT/tau/metrics-$name.jsonl"
    $PY -m trainer.export --run "$WORK/run-$name" -o "$WORK/drafter-$name" --dtype float32 \
        > "$OUT/tau/export-$name.log" 2>&1 || return 1
    $PY -m trainer.specdec --target "$target" --drafter "$WORK/drafter-$name" --prompts "$WORK/eval_prompts.jsonl" \
        --max-new-tokens "$NEW" --json "$OUT/tau/specdec-$name.json" --no-baseline --limit "$N_EVAL" \
        > "$OUT/tau/specdec-$name.log" 2>&1
}

for stage in $STAGES; do
    phase "== $stage"
    case $stage in
    tests)
        # the whole report into OUT (a failure's text is what the next step needs), its end here
        timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_fp8.py > "$OUT/tests.log" 2>&1 || status=1
        tail -3 "$OUT/tests.log"
        ;;
    step)
        k=0
        for p in $ORDER; do
            k=$((k + 1))
            echo "-- $k: $p"
            emulate=(); [ "$p" != bf16 ] && emulate=("${EMULATE[@]}")
            timeout 200 "$PY" benchmarks/drafter_bench.py "${EXTRA[@]}" --out "$OUT/step-$k-$p" --profile "" \
                --timeout 190 --steps "${BENCH_STEPS[0]}" --warmup "${BENCH_STEPS[1]}" --variants "$VARIANT" --precision "$p" "${emulate[@]}" \
                2>&1 | tail -2 || status=1
        done
        ;;
    whole)
        for p in $WHOLE_ORDER; do
            emulate=(); [ "$p" != bf16 ] && emulate=("${EMULATE[@]}")
            echo "-- $p"
            timeout 200 "$PY" benchmarks/train_step_bench.py "${EXTRA[@]}" --out "$OUT/whole-$p" \
                --target-mode compiled --steps "${BENCH_STEPS[2]}" --warmup "${BENCH_STEPS[3]}" --precision "$p" "${emulate[@]}" 2>&1 | tail -4 || status=1
        done
        ;;
    data)
        small_target_data && touch "$WORK/data.done" || status=1
        ;;
    tau)
        [ -f "$WORK/data.done" ] || { small_target_data && touch "$WORK/data.done"; } || exit 1
        mkdir -p "$OUT/tau"
        runs=${TAU_RUNS:-}   # PRECISION:SEED ..., to finish a proof a call left short; else SEEDS x both
        [ -n "$runs" ] || for s in $SEEDS; do runs="$runs bf16:$s $TAU_PRECISION:$s"; done
        phase "train, export and decode, $PARALLEL at a time:$runs ($STEPS steps x $BATCH rows)"
        for r in $runs; do
            while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do sleep 2; done
            ( tau_run "${r%%:*}" "${r##*:}" && phase "${r%%:*} seed ${r##*:}: done" \
                || phase "${r%%:*} seed ${r##*:}: FAILED (see $OUT/tau/*-${r%%:*}-s${r##*:}.log)" ) &
        done
        wait
        "$PY" benchmarks/fp8_tau.py "$OUT/tau" -o "$OUT/tau/fp8-tau.png" --json "$OUT/tau/verdict.json" \
            | tee "$OUT/tau/summary.md" || status=1
        ;;
    *) echo "fp8_check: unknown stage $stage (tests, step, whole, data, tau)" >&2; exit 2 ;;
    esac
done
phase "done"
# one file to bring back: a device call returns a limited number of files
tar czf "$OUT.tgz" -C "$OUT" . && mv "$OUT.tgz" "$OUT/fp8_check.tgz"
exit $status
