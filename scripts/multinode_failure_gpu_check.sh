#!/usr/bin/env bash
# A job over two "nodes" on one host with 2 GPUs (one GPU each, NCCL, the rendezvous on 127.0.0.1)
# ends as one: node 1's rank is SIGKILLed mid-run and node 0's must end within seconds, naming it
# (NCCL itself does not notice a dead peer; before the job's watch node 0 waited for the collectives'
# timeout, 900 s). Then the same with node 1 frozen whole (SIGSTOP: a node that died without closing
# its connections). Prints each case's seconds to node 0's end, its exit status and its ending line.
#   OUT=/tmp/mnf POLICY=eager bash scripts/multinode_failure_gpu_check.sh
export OUT=${OUT:-/tmp/mnf}
set -u
A="--target tiny --data synthetic --steps 100000 --batch-size 8 --block-size 8 --anchors 16 --synthetic-samples 64 --synthetic-new-tokens 48 --draft-layers 2 --eval-prompts 0 --log-every 10 --checkpoint-every 0 --seed 0 --compile-policy ${POLICY:-eager} --topology processes --gpus 1 --nnodes 2"
mkdir -p $OUT
for case in killed frozen; do
  port=$((29420 + RANDOM % 500))
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m trainer $A --rdzv-endpoint 127.0.0.1:$port --rdzv-id $case --rdzv-host --node-address 127.0.0.1 --out $OUT/$case-n0 > $OUT/$case-node0.log 2>&1 &
  n0=$!
  CUDA_VISIBLE_DEVICES=1 timeout 300 python3 -m trainer $A --rdzv-endpoint 127.0.0.1:$port --rdzv-id $case --node-address 127.0.0.2 --out $OUT/$case-n1 > $OUT/$case-node1.log 2>&1 &
  n1=$!
  for _ in $(seq 240); do grep -q '"step": 30' $OUT/$case-node0.log && break; sleep 0.5; done
  ranks=$(pgrep -P $n1 | tr '\n' ' ')
  start=$(date +%s.%N)
  if [ $case = killed ]; then kill -KILL $ranks; else kill -STOP $n1 $ranks; fi
  wait $n0; rc=$?
  echo "$case: node 0 ended $(echo "$(date +%s.%N) - $start" | bc) s after the fault, rc=$rc"
  grep -h "ending (exit 3)" $OUT/$case-node0.log | head -2
  kill -CONT $n1 $ranks 2>/dev/null; kill -KILL $n1 $ranks 2>/dev/null; wait $n1 2>/dev/null
done
