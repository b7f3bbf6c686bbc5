#!/usr/bin/env bash
# `dflash-ops bench-decode` on a GPU, through the CLI, on the built-in `local` target: deploy, the small
# real target and its data (scripts/small_target_data.sh), a short run launched and followed, then
# bench-decode of that run on the held-out prompts. One device call (~7 minutes on one H200):
#
#     OUT=$OUT bash scripts/bench_decode_gpu.sh
#
# and its CPU dry run at the smallest size (small-code-smoke, the CPU slot, a few steps):
#
#     SIZE=smoke GPUS=0 PY=.venv/bin/python OUT=/tmp/bdg WORK=/tmp/bdgw bash scripts/bench_decode_gpu.sh
#
# What comes back in OUT: phases.log, the build/regen logs, the run's log (train.log), bench-decode's
# live lines (bench-decode.log) and its JSON (bench-decode.json), and `status --json`.
set -uo pipefail
cd "$(dirname "$0")/.."
SIZE=${SIZE:-gpu}; OUT=${OUT:-out/bench_decode_gpu}; WORK=${WORK:-/tmp/bench-decode-gpu}; GPUS=${GPUS:-1}
N_TRAIN=${N_TRAIN:-2000}; N_EVAL=${N_EVAL:-30}; NEW=${NEW:-128}; REGEN_BATCH=${REGEN_BATCH:-1024}
STEPS=${STEPS:-300}; BATCH=${BATCH:-16}; ANCHORS=${ANCHORS:-512}; SEQ=${SEQ:-512}; PY=${PY:-python3}
if [ "$SIZE" = smoke ]; then
    N_TRAIN=48; N_EVAL=3; NEW=24; REGEN_BATCH=16; STEPS=6; BATCH=4; ANCHORS=4
fi
mkdir -p "$OUT" "$WORK"
# The CLI's state in WORK (a fresh home: its releases, runs and slots), the caller's python for both sides
export DFLASH_OPS_HOME=${DFLASH_OPS_HOME:-$WORK/home} PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
t0=$(date +%s)
phase() { echo "$(( $(date +%s) - t0 )) s: $*" | tee -a "$OUT/phases.log" >&2; }
ops() { "$PY" -m orchestrator.cli "$@"; }

# shellcheck source=scripts/small_target_data.sh
. scripts/small_target_data.sh

phase "dflash-ops deploy local"
ops deploy local > "$OUT/deploy.log" 2>&1 || { tail -n 5 "$OUT/deploy.log"; exit 1; }
small_target_data || exit 1
phase "dflash-ops launch local --gpus $GPUS: $STEPS steps x $BATCH rows against $target"
run=$(ops launch local --gpus "$GPUS" --policy eager -- --target "$target" --data "$WORK/regen.jsonl" \
    --steps "$STEPS" --batch-size "$BATCH" --anchors "$ANCHORS" --seq-len "$SEQ" "${SMALL_DRAFTER[@]}" \
    --log-every 20) || exit 1
phase "run $run: dflash-ops logs --follow"
ops logs local "$run" --follow > "$OUT/train.log" 2>&1 || { tail -n 5 "$OUT/train.log"; exit 1; }
tail -n 1 "$OUT/train.log" >&2
phase "dflash-ops bench-decode local $run ($N_EVAL held-out prompts x $NEW tokens)"
ops bench-decode local "$run" --prompts "$WORK/eval_prompts.jsonl" --max-new-tokens "$NEW" --json \
    > "$OUT/bench-decode.json" 2> "$OUT/bench-decode.log"
rc=$?
tail -n 3 "$OUT/bench-decode.log" >&2
"$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); print({k: d.get(k) for k in
    ("device", "gpu", "tau", "lossless", "target_tokens_per_s", "spec_tokens_per_s", "speedup")})' \
    "$OUT/bench-decode.json" >&2
ops status local --json > "$OUT/status.json" 2>&1
phase "done, bench-decode exit $rc"
exit $rc
