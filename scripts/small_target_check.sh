#!/usr/bin/env bash
# The small real target end to end: build it, answer prompts from its training modules with it
# (regen), train a drafter on those answers, export it, and decode prompts from the held-out
# modules with and without the drafter (lossless check, tau, speedup). docs/fidelity.md.
#
#   SIZE=gpu scripts/small_target_check.sh          # one H200, ~17 min: R3's recipe (docs/fidelity.md)
#   SIZE=smoke STEPS=20 N_TRAIN=64 N_EVAL=4 NEW=32 scripts/small_target_check.sh   # a CPU dry run
#
# Writes $OUT (default out/small-target-check): each phase's log, phases.log (seconds per phase),
# specdec.json (the result). Work files in $WORK (default /tmp/small-target-check).
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=${SIZE:-gpu}; OUT=${OUT:-out/small-target-check}; WORK=${WORK:-/tmp/small-target-check}
N_TRAIN=${N_TRAIN:-20000}; N_EVAL=${N_EVAL:-30}; NEW=${NEW:-128}; STEPS=${STEPS:-1800}
LAYERS=${LAYERS:-3}; BLOCK=${BLOCK:-16}; GPUS=${GPUS:-1}; BATCH=${BATCH:-32}; REGEN_BATCH=${REGEN_BATCH:-1024}
# R3's optimiser (docs/fidelity.md): a short run at a high lr adapts faster with beta2 0.95 than the recipe's 0.999
TRAIN_FLAGS=${TRAIN_FLAGS:---adam-beta2 0.95}
PY=${PY:-python3}
mkdir -p "$OUT" "$WORK"
export DFLASH_OPS_CACHE=${DFLASH_OPS_CACHE:-$WORK/cache} PYTHONUNBUFFERED=1
t0=$(date +%s)
phase() { echo "$(( $(date +%s) - t0 )) s: $*" | tee -a "$OUT/phases.log" >&2; }
# shellcheck source=scripts/small_target_data.sh
. scripts/small_target_data.sh

small_target_data
phase "train a drafter: $LAYERS layers, block $BLOCK, $STEPS steps"
rm -rf "$WORK/run"
# shellcheck disable=SC2086
$PY -m trainer --target "$target" --data "$WORK/regen.jsonl" --out "$WORK/run" --gpus "$GPUS" \
    --steps "$STEPS" --batch-size "$BATCH" --anchors 512 --seq-len 512 --draft-layers "$LAYERS" \
    --block-size "$BLOCK" --lr 6e-4 --eval-prompts 0 --log-every 50 --checkpoint-every 0 $TRAIN_FLAGS 2>&1 \
    | tee "$OUT/train.log"
phase "export"
rm -rf "$WORK/drafter"
$PY -m trainer.export --run "$WORK/run" -o "$WORK/drafter" --dtype float32 | tee "$OUT/export.log"
phase "decode the held-out prompts with and without the drafter"
$PY -m trainer.specdec --target "$target" --drafter "$WORK/drafter" --prompts "$WORK/eval_prompts.jsonl" \
    --max-new-tokens "$NEW" --json "$OUT/specdec.json" 2>&1 | tee "$OUT/specdec.log"
phase "done"
