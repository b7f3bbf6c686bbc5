#!/usr/bin/env bash
# Two "nodes" on one host with 2 GPUs (one GPU each, CUDA_VISIBLE_DEVICES) joined by the c10d
# rendezvous on 127.0.0.1, against one node with both GPUs, same global batch and seed: the
# trainer's multi-node NCCL path without a second machine. Writes logs under $OUT (default /tmp/mn),
# prints the exit codes and whether the final weights are bit-identical.
#   OUT=/tmp/mn POLICY=eager bash scripts/multinode_gpu_check.sh
export OUT=${OUT:-/tmp/mn}
set -u
A="--target tiny --data synthetic --steps 40 --batch-size 8 --block-size 8 --anchors 16 --synthetic-samples 64 --synthetic-new-tokens 48 --draft-layers 2 --eval-prompts 0 --checksum-every 20 --log-every 10 --checkpoint-every 0 --seed 0 --compile-policy ${POLICY:-eager} --topology processes"
mkdir -p $OUT
timeout 150 python3 -m trainer $A --gpus 2 --out $OUT/one > $OUT/one-node-2gpus.log 2>&1; echo "one node rc=$?"
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m trainer $A --gpus 1 --nnodes 2 --rdzv-endpoint 127.0.0.1:29411 --rdzv-id j1 --rdzv-host --node-address 127.0.0.1 --out $OUT/n0 > $OUT/node0.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m trainer $A --gpus 1 --nnodes 2 --rdzv-endpoint 127.0.0.1:29411 --rdzv-id j1 --node-address 127.0.0.1 --out $OUT/n1 > $OUT/node1.log 2>&1 &
wait %1; echo "node0 rc=$?"; wait %2; echo "node1 rc=$?"
grep -h "step 40/40\|NCCL\|nccl\|Error" $OUT/one-node-2gpus.log $OUT/node0.log $OUT/node1.log | head -12
python3 - <<'PY'
import os, sys; sys.path.insert(0, ".")
import torch
from trainer.run import checkpoint
w = {}
for name in ("one", "n0", "n1"):
    out = os.path.join(os.environ["OUT"], name)
    p = checkpoint.find_latest(out)
    w[name] = checkpoint.load(p).model if p else None
    print(name, p)
for a, b in (("n0", "n1"), ("n0", "one")):
    if w[a] is None or w[b] is None:
        print(a, b, "missing"); continue
    same = all(torch.equal(w[a][k], w[b][k]) for k in w[a])
    worst = max(float((w[a][k].float() - w[b][k].float()).abs().max()) for k in w[a])
    print(f"{a} vs {b}: bit-identical {same}, max abs diff {worst:g}")
PY
