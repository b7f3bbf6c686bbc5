#!/usr/bin/env bash
# `make demo`: the whole daily loop on the built-in `local` target (this machine; CPU when it has
# no GPU): deploy -> probe -> launch -> logs --follow -> report -> export. Ends with the run's exit status
# (0 succeeded, 100 failed, 103 stopped), then the `dflash-ops tensorboard` line that serves the run's curves.
# The Makefile puts the venv's bin first on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

T=local                      # named everywhere: a ./hosts.yaml must not redirect the demo
config=trainer/demo-small-code.yaml   # a drafter for the small real target, on its own answers
cache=${DFLASH_OPS_CACHE:-$HOME/.cache/dflash-ops}
# The demo's own python phases (regen, specdec) on ONE intra-op thread: they decode small batches of a
# small model, where a second OpenMP thread gains nothing and, on 2 cores that something else also
# uses, its spin-waits cost 3x (regen) to 4x (specdec) the time. The trainer has cpu_threads: 1 in the config.
one_thread="env OMP_NUM_THREADS=1"

# Each phase's time, printed at the end (bash's SECONDS: whole seconds since the script started).
phases=()
phase_start=$SECONDS
phase_name=""
step() {
    [ -n "$phase_name" ] && phases+=("$(printf '%5d s  %s' $((SECONDS - phase_start)) "$phase_name")")
    phase_name="$*"; phase_start=$SECONDS
    printf '\n\033[1m== %s\033[0m\n' "$*" >&2
}
summary() {
    rc=$?
    failed=$phase_name
    step "done"
    printf '\nphase times (%d s in all):\n' "$SECONDS" >&2
    printf '  %s\n' "${phases[@]}" >&2
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 100 ] && [ "$rc" -ne 103 ]; then   # 100/103: the run's own end, said above
        printf '\ndemo: FAILED in "%s" (exit %d); see its output above. A venv that no longer runs is rebuilt\n' \
            "$failed" "$rc" >&2
        printf 'by the next `make demo`; `make clean` removes it by hand.\n' >&2
        return
    fi
    bin=$(dirname "$(command -v dflash-ops)")
    printf '\ndflash-ops is %s; put it on PATH with:\n  export PATH="%s:$PATH"\n' "$bin/dflash-ops" "$bin" >&2
    printf 'state: the local target keeps releases, runs and probe.json in %s;\n' \
        "${DFLASH_OPS_HOME:-$HOME/.dflash-ops}/local" >&2
    printf '       the small target and the demo data are cached in %s; reports and exports are in out/\n' \
        "$cache" >&2
    if [ -n "${run:-}" ]; then      # the run's curves, served here (its event files were brought home above)
        printf '\nits curves in TensorBoard (served on 127.0.0.1, its URL printed; Ctrl-C ends it):\n' >&2
        printf '  dflash-ops tensorboard %s %s\n' "$T" "$run" >&2
    fi
}
trap summary EXIT

step "dflash-ops deploy $T"
dflash-ops deploy "$T"

# eager only: the demo shows the probe's verdict in ~30 s (kept on the target and reused by the next
# demo); the whole matrix is `dflash-ops probe local` (minutes on 2 cores: every compile policy).
step "dflash-ops probe $T --policies eager"
policy=auto                  # the probe's choice, saved on the target
if ! dflash-ops probe "$T" --policies eager; then
    echo "demo: the probe could not run; launching with --policy eager" >&2
    policy=eager
fi

# The small real target, built once (minutes on 2 cores, with progress) and then read from the
# cache; prompts cut from its training modules, answered by the target itself (the DFlash recipe's
# data), and prompts from the modules it never saw, for the held-out tau at the end.
step "python -m trainer.small_lm --size cpu (built once, then cached)"
built=$(python -m trainer.small_lm --size cpu)
# The prompts and the target's answers depend only on the cached target: made once, kept in a folder
# named after it (the build's folder name holds its recipe and text hash), so a target built anew (another
# Python's standard library, another recipe) never trains on the answers of the one before.
# This machine is the `local` target: the files are where it reads them.
target_dir=$(printf '%s' "$built" | python -c 'import json, sys; print(json.load(sys.stdin)["out"])')
data=$cache/demo/$(basename "$target_dir")
mkdir -p "$data"
if [ ! -s "$data/prompts.jsonl" ] || [ ! -s "$data/held-out.jsonl" ]; then
    python -m trainer.small_lm --size cpu --prompts train --n 192 --out "$data/prompts.jsonl" >/dev/null
    python -m trainer.small_lm --size cpu --prompts held-out --n 8 --seed 1 --out "$data/held-out.jsonl" >/dev/null
fi
step "python -m trainer.regen --target small-code (answers by the target itself; kept once complete)"
if [ "$(wc -l 2>/dev/null < "$data/regen.jsonl" || echo 0)" -lt 192 ]; then
    # Two halves side by side, one thread each (each resumes where it stopped), then one file.
    head -n 96 "$data/prompts.jsonl" > "$data/prompts-a.jsonl"
    tail -n +97 "$data/prompts.jsonl" > "$data/prompts-b.jsonl"
    pids=()
    for half in a b; do
        $one_thread python -m trainer.regen --target small-code --prompts "$data/prompts-$half.jsonl" \
            --out "$data/regen-$half.jsonl" --max-new-tokens 48 --batch-size 48 \
            --block-size 8 --seq-len 256 &      # the config's: rows the run would skip are said here
        pids+=($!)
    done
    regen_rc=0
    for pid in "${pids[@]}"; do wait "$pid" || regen_rc=$?; done
    [ "$regen_rc" -eq 0 ]
    cat "$data/regen-a.jsonl" "$data/regen-b.jsonl" > "$data/regen.jsonl.tmp"
    mv "$data/regen.jsonl.tmp" "$data/regen.jsonl"
else
    echo "kept: $data/regen.jsonl (192 rows; delete it to answer the prompts again)" >&2
fi

# One GPU when this machine has any (the config's batch splits over it), else the CPU.
gpus=$(dflash-ops targets "$T" --json | python3 -c \
    'import json, sys; print(min(1, json.load(sys.stdin)["targets"][0]["gpus"]))')

step "dflash-ops launch $T --gpus $gpus --policy $policy --config $config"
run=$(dflash-ops launch "$T" --gpus "$gpus" --policy "$policy" --config "$config" -- --data "$data/regen.jsonl")

step "dflash-ops logs $T $run --follow"
set +e
dflash-ops logs "$T" "$run" --follow
rc=$?
set -e

# The run's TensorBoard event files, brought home into $DFLASH_OPS_HOME/tensorboard/local/RUN (docs/runs.md,
# "Curves: TensorBoard and W&B"); the last lines print the command that serves them.
step "dflash-ops tensorboard $T $run --no-serve"
dflash-ops tensorboard "$T" "$run" --no-serve || true

# out/ is git-ignored, so the PNG is never shipped by a later `deploy` of this checkout.
step "dflash-ops report $T $run -o out/dflash-report-$run.png"
dflash-ops report "$T" "$run" -o "out/dflash-report-$run.png" || true

# The trained drafter as the DFlash draft-model folder serving engines load (docs/serving.md, "Serve your drafter").
if [ "$rc" -eq 0 ]; then
    step "dflash-ops export $T $run -o out/dflash-drafter-$run"
    dflash-ops export "$T" "$run" -o "out/dflash-drafter-$run" || rc=$?
fi

# tau on prompts from modules the target never trained on, the untrained drafter against the trained one
# (32 new tokens a prompt, as the trainer's own eval: on 2 cores each run then takes well under a minute).
# The untrained one (its tau only: --no-baseline) runs beside the trained one, one thread each on the two
# cores; the trained one checks lossless decoding and times the target alone against the drafter.
if [ "$rc" -eq 0 ]; then
    step "python -m trainer.specdec --untrained, beside python -m trainer.specdec (held-out modules)"
    specdec=($one_thread python -m trainer.specdec --target small-code --drafter "out/dflash-drafter-$run"
             --prompts "$data/held-out.jsonl" --max-new-tokens 32 --cpu)
    "${specdec[@]}" --untrained --no-baseline >/dev/null 2>"out/specdec-untrained-$run.log" &
    untrained=$!
    "${specdec[@]}" >/dev/null || rc=$?
    if wait "$untrained"; then
        grep '^specdec: ' "out/specdec-untrained-$run.log" | sed 's/^specdec: /specdec (untrained): /' >&2 || true
    else
        rc=1; cat "out/specdec-untrained-$run.log" >&2
    fi
fi

step "dflash-ops status $T"
dflash-ops status "$T"
exit "$rc"
