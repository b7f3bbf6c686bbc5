#!/usr/bin/env bash
# Decoding as serving engines decode, measured beside eager: a drafter of the main recipe (R5's: built
# target, 30,000 regen rows, 5,700 steps) decoded on held-out prompts of a fresh seed, deduplicated
# against the training text, by `trainer.specdec` under both engines. Two stages:
#
#   STAGE=train: scripts/small_target_claims.sh with R5's settings (about 17 minutes on one H200), run
#                detached by scripts/detach.sh and polled by back-to-back device calls;
#   STAGE=bench: the prompts, then specdec: graphs in bf16 (the default) and float32 on every prompt,
#                eager float32 on the first N_EAGER (eager costs ~17 ms a token); then the graphs engine
#                with inductor-fused steps (--compile): its costs alone (and with COMPILED=1 its decode
#                of every prompt); ~9 minutes (13 with COMPILED=1). The train stage takes ~16.5.
#
#     bash scripts/detach.sh start /tmp/r6 env STAGE=train WORK=/tmp/r6/work bash scripts/decode_engines_gpu.sh
#     bash scripts/detach.sh poll /tmp/r6 540                       # calls until it has ended
#     STAGE=bench WORK=/tmp/r6/work OUT=$OUT bash scripts/decode_engines_gpu.sh
#     (RUNS="graphs-bf16 graphs-fp32" COSTS=0: the two graphs decodes alone, ~4 minutes)
#
# CPU dry run at the smallest size (seconds to minutes):
#     SIZE=smoke STAGE=train GPUS=0 WORK=/tmp/de/work OUT=/tmp/de/out PY=.venv/bin/python bash scripts/decode_engines_gpu.sh
#     SIZE=smoke STAGE=bench N_HELD=6 N_EAGER=3 NEW=24 COSTS_ARGS="--prompts 2 --prompt-len 40 --new 24" \
#         WORK=/tmp/de/work OUT=/tmp/de/out PY=.venv/bin/python \
#         bash scripts/decode_engines_gpu.sh
#
# OUT gets phases.log, each specdec's live lines and JSON (every prompt's tokens and rounds), and
# `python benchmarks/decode_engines.py OUT` makes the table and the plot of docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${STAGE:-bench}; SIZE=${SIZE:-gpu}; WORK=${WORK:-/tmp/decode-engines/work}; OUT=${OUT:-out/decode-engines}
PY=${PY:-python3}; N_HELD=${N_HELD:-240}; SEED=${SEED:-7}; NEW=${NEW:-128}; N_EAGER=${N_EAGER:-20}
DRAFTER=${DRAFTER:-$WORK/drafter-main}
export DFLASH_OPS_CACHE=${DFLASH_OPS_CACHE:-$WORK/cache} PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
t0=$(date +%s)
phase() { echo "$(( $(date +%s) - t0 )) s: $*" | tee -a "$OUT/phases.log" >&2; }
target=small-code-$SIZE
[ "$SIZE" = cpu ] && target=small-code

if [ "$STAGE" = sanity ]; then  # the engine on the built-in random target: captured, equal to eager, its costs
    $PY - <<'PY'
import time, torch
from trainer.model.drafter import Drafter
from trainer import specdec
from trainer.run.decode_graphs import GraphDecoder
from trainer.run.target import load_target
dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
for dtype in (torch.float32, torch.bfloat16):
    t = load_target("tiny", device=dev, dtype=dtype)
    torch.manual_seed(0)
    d = Drafter(t.drafter_config(num_layers=3, block_size=16, mask_token_id=None))
    d.init_norm(t.head_weights()[1]); d.borrow_target_head(*t.head_weights()); d = d.to(dev, dtype).eval()
    prompts = [list(b"def f(x):\n    return x" * k) for k in (1, 3, 9)]
    g, e = GraphDecoder(t, d, 600), specdec.EagerDecoder(t, d)
    for p in prompts:
        for name, dec in (("graphs", g), ("eager", e)):
            dec.target_alone(p, 8); dec.speculative(p, 8)
        a, b = g.speculative(p, 128), e.speculative(p, 128)
        ra, rb = g.target_alone(p, 128), e.target_alone(p, 128)
        print(f"{dtype} graphed={g.graphed} prompt {len(p)}: spec equal {a.tokens == b.tokens}, rounds equal "
              f"{a.produced == b.produced}, alone equal {ra.tokens == rb.tokens}, spec==alone {a.tokens == ra.tokens}; "
              f"ms/token alone graphs {1e3 * ra.spent.total / len(ra.tokens):.3f} eager {1e3 * rb.spent.total / len(rb.tokens):.3f}; "
              f"ms/round graphs {1e3 * a.spent.total / max(1, len(a.produced)):.3f} "
              f"(verify {1e3 * a.spent.verify / max(1, len(a.produced)):.3f}, draft {1e3 * a.spent.draft / max(1, len(a.produced)):.3f}, "
              f"extend {1e3 * a.spent.extend / max(1, len(a.produced)):.3f}) eager {1e3 * b.spent.total / max(1, len(b.produced)):.3f}",
              flush=True)
PY
    exit $?
fi

if [ "$STAGE" = train ]; then
    if [ "$SIZE" = smoke ]; then
        export N_TRAIN=48 N_EVAL=3 NEW=24 REGEN_BATCH=16 MAIN_STEPS=6 BATCH=4
    else
        export N_TRAIN=${N_TRAIN:-30000} MAIN_STEPS=${MAIN_STEPS:-5700} BATCH=${BATCH:-32}
    fi
    VARIANTS= SPEED=" " POLICY=eager TRAIN_FLAGS="--adam-beta2 0.95" SIZE=$SIZE WORK=$WORK OUT=$OUT PY=$PY \
        bash scripts/small_target_claims.sh
    exit $?
fi

[ -d "$DRAFTER" ] || { echo "decode_engines_gpu.sh: no drafter at $DRAFTER (run STAGE=train first)" >&2; exit 2; }
prompts=$WORK/heldout-s$SEED.jsonl
phase "prompts: $N_HELD held-out, seed $SEED, deduplicated against the training text"
$PY -m trainer.small_lm --size "$SIZE" --prompts held-out --n "$N_HELD" --seed "$SEED" --out "$prompts" \
    2> "$OUT/prompts.log" || { cat "$OUT/prompts.log" >&2; exit 1; }
tail -n 2 "$OUT/prompts.log" >&2
rc=0
sd() {  # LABEL FLAGS...: specdec of the drafter on the prompts, its live lines in specdec-LABEL.log
    local label=$1; shift
    phase "specdec $label: $*"
    $PY -m trainer.specdec --target "$target" --drafter "$DRAFTER" --prompts "$prompts" --max-new-tokens "$NEW" \
        --json "$OUT/specdec-$label.json" "$@" > /dev/null 2> "$OUT/specdec-$label.log" || rc=1
    tail -n 1 "$OUT/specdec-$label.log" >&2
}
# RUNS: which of the three decodes (all by default; fewer when device time is short)
for run in ${RUNS:-graphs-bf16 graphs-fp32 eager-fp32}; do
    case $run in
        graphs-bf16) sd graphs-bf16 --engine graphs --dtype bfloat16 ;;
        graphs-fp32) sd graphs-fp32 --engine graphs --dtype float32 ;;
        eager-fp32) sd eager-fp32 --engine eager --dtype float32 --limit "$N_EAGER" ;;
        *) echo "decode_engines_gpu.sh: RUNS takes graphs-bf16, graphs-fp32, eager-fp32, not $run" >&2; exit 2 ;;
    esac
done
# the round-cost lever: the steps fused by inductor before capture, first at the shapes alone (random
# weights, a few minutes of compiling; COSTS=0 leaves it out when device time is short), then on every
# prompt with the drafter
if [ "${COSTS:-1}" = 1 ]; then
    phase "costs: graphs vs graphs compiled, bfloat16, random weights"
    $PY benchmarks/decode_costs.py --size "$SIZE" --dtype bfloat16 --engines graphs,compiled --tau 3.25 3.0 ${COSTS_ARGS:-} \
        > "$OUT/costs-compiled.json" 2> "$OUT/costs-compiled.log" || rc=1
    tail -n 2 "$OUT/costs-compiled.log" >&2
fi
# every prompt compiled: ~4 minutes more, past one session's device time after the train stage (COMPILED=1)
[ "${COMPILED:-0}" = 1 ] && sd graphs-bf16-compiled --engine graphs --dtype bfloat16 --compile on
phase "done (exit $rc)"
exit $rc
