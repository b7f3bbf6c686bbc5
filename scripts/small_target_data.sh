# The small real target's data, shared by small_target_check.sh, small_target_claims.sh, fp8_check.sh and
# bench_decode_gpu.sh (sourced, not run): build the target, cut prompts from its training and held-out modules, and
# answer the training ones with the target itself (regen). Reads SIZE, N_TRAIN, N_EVAL, NEW,
# REGEN_BATCH, GPUS, PY, OUT, WORK and the caller's `phase`; sets `target` and `SMALL_DRAFTER`.

target=small-code-$SIZE
[ "$SIZE" = cpu ] && target=small-code
# The drafter the fp8 proof and the bench-decode check train on it: 3 layers, block 16, lr 6e-4, no
# in-run eval, the last checkpoint only; the caller adds steps, batch, anchors and seq-len.
SMALL_DRAFTER=(--draft-layers 3 --block-size 16 --lr 6e-4 --eval-prompts 0 --checkpoint-every 0)

small_target_data() {
    phase "build $target"
    $PY -m trainer.small_lm --size "$SIZE" > "$OUT/small_lm.log" 2>&1
    tail -n 2 "$OUT/small_lm.log" >&2
    phase "prompts: $N_TRAIN from the training modules, $N_EVAL from the held-out ones"
    $PY -m trainer.small_lm --size "$SIZE" --prompts train --n "$N_TRAIN" --out "$WORK/train_prompts.jsonl"
    $PY -m trainer.small_lm --size "$SIZE" --prompts held-out --n "$N_EVAL" --seed 1 --out "$WORK/eval_prompts.jsonl"
    phase "regen, batch $REGEN_BATCH"
    if ! $PY -m trainer.regen --target "$target" --prompts "$WORK/train_prompts.jsonl" --out "$WORK/regen.jsonl" \
            --max-new-tokens "$NEW" --batch-size "$REGEN_BATCH" --gpus "${GPUS:-1}" > "$OUT/regen.log" 2>&1; then
        [ "$REGEN_BATCH" -gt 256 ] || { tail -n 3 "$OUT/regen.log" >&2; return 1; }
        phase "regen at batch $REGEN_BATCH failed ($(tail -n 1 "$OUT/regen.log")); again at batch 256"
        $PY -m trainer.regen --target "$target" --prompts "$WORK/train_prompts.jsonl" --out "$WORK/regen.jsonl" \
            --max-new-tokens "$NEW" --batch-size 256 --gpus "${GPUS:-1}" --no-resume >> "$OUT/regen.log" 2>&1
    fi
    tail -n 1 "$OUT/regen.log" >&2
}
