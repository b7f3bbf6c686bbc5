#!/usr/bin/env bash
# `make demo`: the whole daily loop on the built-in `local` target (this machine; CPU when it has
# no GPU): deploy -> probe -> launch -> logs --follow -> report -> export. Ends with the run's exit status
# (0 succeeded, 100 failed, 103 stopped). The Makefile puts the venv's bin first on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

T=local                      # named everywhere: a ./hosts.yaml must not redirect the demo
config=trainer/demo.yaml       # a CPU run that visibly learns in about a minute

step() { printf '\n\033[1m== %s\033[0m\n' "$*" >&2; }

step "dflash-ops deploy $T"
dflash-ops deploy "$T"

step "dflash-ops probe $T"
policy=auto                  # the probe's choice, saved on the target
if ! dflash-ops probe "$T"; then
    echo "demo: the probe could not run; launching with --policy eager" >&2
    policy=eager
fi

# One GPU when this machine has any (the config's batch splits over it), else the CPU.
gpus=$(dflash-ops targets "$T" --json | python3 -c \
    'import json, sys; print(min(1, json.load(sys.stdin)["targets"][0]["gpus"]))')

step "dflash-ops launch $T --gpus $gpus --policy $policy --config $config"
run=$(dflash-ops launch "$T" --gpus "$gpus" --policy "$policy" --config "$config")

step "dflash-ops logs $T $run --follow"
set +e
dflash-ops logs "$T" "$run" --follow
rc=$?
set -e

# out/ is git-ignored, so the PNG is never shipped by a later `deploy` of this checkout.
step "dflash-ops report $T $run -o out/dflash-report-$run.png"
dflash-ops report "$T" "$run" -o "out/dflash-report-$run.png" || true

# The trained drafter as the DFlash draft-model folder serving engines load (README: "Serve your drafter").
if [ "$rc" -eq 0 ]; then
    step "dflash-ops export $T $run -o out/dflash-drafter-$run"
    dflash-ops export "$T" "$run" -o "out/dflash-drafter-$run" || rc=$?
fi

step "dflash-ops status $T"
dflash-ops status "$T"
exit "$rc"
