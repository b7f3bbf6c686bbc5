#!/usr/bin/env bash
# The paper's claims at the small target's scale, and the main drafter of docs/fidelity.md, in one
# GPU session: build the target, answer prompts from its training modules with it (regen), then
# train the drafters side by side on the one GPU, PARALLEL at a time (the main one, long; the
# claims' variants, short, each with one setting changed from the claims' baseline), export them,
# and decode the held-out prompts with each: the variants without the baseline decode, side by
# side (tau only; their tokens/s share the GPU and mean nothing), then the drafters in SPEED one at
# a time with the full measurement (lossless check, tokens/s, speedup).
#
#   SIZE=gpu scripts/small_target_claims.sh            # one H200, about 30 minutes
#   SIZE=gpu MAIN_STEPS=0 SPEED= scripts/small_target_claims.sh   # the claims' variants only
#   POLICY=inductor TRAIN_FLAGS="--adam-beta2 0.95" ...   # the main drafter compiled (eager again if
#                                         # that run fails), every run with extra trainer flags
#   SIZE=smoke MAIN_STEPS=6 CLAIM_STEPS=4 N_TRAIN=48 N_EVAL=3 NEW=24 BATCH=4 CLAIM_BATCH=4 \
#       REGEN_BATCH=16 GPUS=0 scripts/small_target_claims.sh    # a CPU dry run
#
# Writes $OUT (default out/small-target-claims): phases.log, each phase's and run's log, each run's
# metrics.jsonl, specdec-NAME.json; `python benchmarks/claims_table.py $OUT` turns them into the
# table and the plot. Work files in $WORK (default /tmp/small-target-claims).
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=${SIZE:-gpu}; OUT=${OUT:-out/small-target-claims}; WORK=${WORK:-/tmp/small-target-claims}
N_TRAIN=${N_TRAIN:-16000}; N_EVAL=${N_EVAL:-30}; NEW=${NEW:-128}; REGEN_BATCH=${REGEN_BATCH:-1024}
MAIN_STEPS=${MAIN_STEPS:-1600}; BATCH=${BATCH:-32}; CLAIM_STEPS=${CLAIM_STEPS:-400}; CLAIM_BATCH=${CLAIM_BATCH:-16}
CLAIM_EVAL=${CLAIM_EVAL:-$N_EVAL}; SPEED=${SPEED:-main layers1}; PARALLEL=${PARALLEL:-3}
VARIANTS=${VARIANTS-base block8 uniform layers1 layers5 anchors64}   # VARIANTS= (empty): none
# (kd, the baseline distilled from the target, and dpace and muon, the baseline with speculators' D-PACE
# position weights or Muon optimizer, are no claims of the paper: name them for their A/Bs, docs/recipe.md)
POLICY=${POLICY:-eager}; TRAIN_FLAGS=${TRAIN_FLAGS:-}
PY=${PY:-python3}
mkdir -p "$OUT" "$WORK"
export DFLASH_OPS_CACHE=${DFLASH_OPS_CACHE:-$WORK/cache} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
t0=$(date +%s)
phase() { echo "$(( $(date +%s) - t0 )) s: $*" | tee -a "$OUT/phases.log" >&2; }
# shellcheck source=scripts/small_target_data.sh
. scripts/small_target_data.sh

# Each variant is the claims' baseline with one setting changed.
flags() {
    local base="--draft-layers 3 --block-size 16 --anchors 512"
    case $1 in
        main) echo "--steps $MAIN_STEPS --batch-size $BATCH $base" ;;
        base) echo "--steps $CLAIM_STEPS --batch-size $CLAIM_BATCH $base" ;;
        block8) echo "--steps $CLAIM_STEPS --batch-size $CLAIM_BATCH --draft-layers 3 --block-size 8 --anchors 512" ;;
        uniform) echo "--steps $CLAIM_STEPS --batch-size $CLAIM_BATCH $base --gamma 1e9" ;;
        layers1) echo "--steps $CLAIM_STEPS --batch-size $CLAIM_BATCH --draft-layers 1 --block-size 16 --anchors 512" ;;
        layers5) echo "--steps $CLAIM_STEPS --batch-size $CLAIM_BATCH --draft-layers 5 --block-size 16 --anchors 512" ;;
        anchors64) echo "--steps $CLAIM_STEPS --batch-size $CLAIM_BATCH --draft-layers 3 --block-size 16 --anchors 64" ;;
        kd) echo "--steps $CLAIM_STEPS --batch-size $CLAIM_BATCH $base --objective kd" ;;
        dpace) echo "--steps $CLAIM_STEPS --batch-size $CLAIM_BATCH $base --position-weights dpace" ;;
        muon) echo "--steps $CLAIM_STEPS --batch-size $CLAIM_BATCH $base --optimizer muon" ;;
        *) echo "unknown variant $1" >&2; return 2 ;;
    esac
}

fit() {  # NAME POLICY: one training run of NAME under a compile policy
    local name=$1 policy=$2
    rm -rf "$WORK/run-$name" "$WORK/drafter-$name"
    # shellcheck disable=SC2046,SC2086
    $PY -m trainer --target "$target" --data "$WORK/regen.jsonl" --out "$WORK/run-$name" --gpus "${GPUS:-1}" \
        $(flags "$name") --seq-len 512 --lr 6e-4 --eval-prompts 0 --log-every 50 --checkpoint-every 0 \
        --compile-policy "$policy" $TRAIN_FLAGS > "$OUT/train-$name.log" 2>&1
}

train() {  # NAME: train (the main drafter under POLICY, eager again if that fails), export; logs into $OUT
    local name=$1 policy=eager
    [ "$name" = main ] && policy=$POLICY
    if ! fit "$name" "$policy"; then
        [ "$policy" != eager ] || return 1
        mv "$OUT/train-$name.log" "$OUT/train-$name-$policy.log"
        echo "$(( $(date +%s) - t0 )) s: $name under $policy FAILED ($(tail -n 1 "$OUT/train-$name-$policy.log" | cut -c1-200)); again eager" >> "$OUT/phases.log"
        fit "$name" eager || return 1
    fi
    cp "$WORK/run-$name/metrics.jsonl" "$OUT/metrics-$name.jsonl" 2>/dev/null || true
    $PY -m trainer.export --run "$WORK/run-$name" -o "$WORK/drafter-$name" --dtype float32 > "$OUT/export-$name.log"
}

specdec() {  # LABEL NAME [FLAGS...]: decode the held-out prompts with drafter NAME; log specdec-LABEL.log
    local label=$1 name=$2; shift 2
    $PY -m trainer.specdec --target "$target" --drafter "$WORK/drafter-$name" --prompts "$WORK/eval_prompts.jsonl" \
        --max-new-tokens "$NEW" --json "$OUT/specdec-$label.json" "$@" > "$OUT/specdec-$label.log" 2>&1
}

small_target_data

runs=$VARIANTS
[ "$MAIN_STEPS" -gt 0 ] && runs="main $runs"   # MAIN_STEPS=0: the variants only
phase "train, $PARALLEL at a time: $runs (main $MAIN_STEPS steps x $BATCH, variants $CLAIM_STEPS x $CLAIM_BATCH)"
declare -A pid
for name in $runs; do
    while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do sleep 2; done
    ( train "$name" && echo "$(( $(date +%s) - t0 )) s: $name trained and exported" >> "$OUT/phases.log" \
        || echo "$(( $(date +%s) - t0 )) s: $name FAILED (see train-$name.log)" >> "$OUT/phases.log" ) &
    pid[$name]=$!
done
for name in $VARIANTS; do wait "${pid[$name]}"; done
phase "variants trained; tau of each on the held-out prompts, side by side (main still training)"
# the untrained baseline is the claims' baseline freshly initialised
for name in $VARIANTS; do
    [ -d "$WORK/drafter-$name" ] && specdec "$name" "$name" --no-baseline --limit "$CLAIM_EVAL" &
done
[ -d "$WORK/drafter-base" ] && specdec untrained base --untrained --no-baseline --limit "$CLAIM_EVAL" &
wait
phase "main trained; decoding with the drafters of SPEED ($SPEED), one at a time, full measurement"
for name in $SPEED; do
    [ -d "$WORK/drafter-$name" ] || { phase "$name: no drafter"; continue; }
    specdec "$name-speed" "$name" || phase "$name: specdec failed"
done
phase "done"
