"""One probe case, in its own process: `python -m trainer.probe --case POLICY:TOPOLOGY:N`.

A case runs what the trainer runs, at a small shape: the trainer's own replicas (Drafter + DraftLoss
with the attention and loss backends the trainer picks on this device, built by
`step.build_replica`) through the trainer's own engines:
  threads    a ThreadEngine of N worker threads: serialized build and warm-up, the threaded
             reduce-scatter + all-gather, the same update in every worker;
  processes  this process is one of N ranks that torchrun started (the parent runs
             `python -m torch.distributed.run --standalone --nproc-per-node N -m trainer.probe
             --case ...`), the DraftLoss in DDP as a RankEngine (gloo on the CPU, NCCL on GPUs).

Then, against an eager replica built from the same weights in this process (numerics.judge):
  1. teacher-forced steps: before each step the engine's replicas receive the eager replica's
     current weights (copied in place, as an optimizer step writes them); compiled and eager
     run forward + backward on the same batch; loss and per-parameter gradients are compared,
     and the noise of the working precision is measured on the same weights and batch (eager
     at a higher precision), so drift can neither hide an error nor excuse one;
  2. replay: fixed weights, batches 0, 1, 2, 0: a stale static input repeats batch 0's loss;
  3. learnability: a few free-running steps on one repeated batch: the loss must fall as eager's does;
and `--steps` timed training steps, alone when the parent runs cases side by side (it stops the others
first: schedule.py). With `--precision fp8 | fp8-rowwise` the engine's replicas train
with fp8 matmuls (trainer/model/fp8.py) while the eager reference stays bf16, and the noise is fp8's
own: eager fp8 against eager bf16 on the same weights and batch (numerics.py: FP8_NOISE_FACTOR, and
numerics.fp8_limit as the limit). The outcome: `ok`, or `wrong` (it ran, but computes something
else; signature compiled-wrong), or a failure the parent names from the output. The result is ONE
stdout line, CASE_MARK + JSON (rank 0's under processes), which the parent (program.py) picks out.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from trainer import cores
from trainer.model import fp8, masks
from trainer.exits import exit_process
from trainer.run.data import Sample, make_batch
from trainer.model.draft_loss import DraftLoss
from trainer.run.config import TrainConfig
from trainer.run.log import QuietLog
from trainer.model.drafter import Drafter
from trainer.engine.numerics import (FP8_NOISE_FACTOR, NOISE_FACTOR, StepCheck, fp8_limit, grad_errors, judge,
                                     snapshot_grads)
from trainer.engine.step import Replica, apply_update, build_replica, compute_grads, load_weights
from trainer.probe.case_watch import CASE_MARK, PHASE_MARK, wait_for_turn  # noqa: F401 - CASE_MARK: the result line's mark

if TYPE_CHECKING:           # the engines are imported where used: the topology picks one
    from trainer.engine.protocol import Engine

SEED = 1234
TEACHER_STEPS = 3
LEARN_STEPS = 6
LR = 1e-3           # teacher-forced and timed steps
BETAS = (TrainConfig.adam_beta1, TrainConfig.adam_beta2)  # the trainer's defaults
LEARN_LR = 1e-2     # the learnability steps: a clear fall of the loss in a few steps
GRAD_CLIP = 1.0


@dataclass(frozen=True)
class Shape:
    """The drafter and batch a case trains. The target is the trainer's `tiny` on the CPU; on GPUs a
    random Qwen3 of `gpu_target` (built on the device, no download), wide enough to time kernels."""
    draft_layers: int
    block_size: int
    seq_len: int
    anchors: int
    rows_per_worker: int


CPU_SHAPE = Shape(draft_layers=2, block_size=8, seq_len=48, anchors=3, rows_per_worker=1)
GPU_SHAPE = Shape(draft_layers=2, block_size=16, seq_len=512, anchors=16, rows_per_worker=2)
GPU_TARGET: dict[str, Any] = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                  num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                  max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                                  tie_word_embeddings=False)


def _target(device: torch.device):
    from trainer.run.target import TINY_LM_HEAD_STD, Target, _freeze, default_layer_ids, load_target
    from trainer.run.tokenizer import ByteTokenizer

    if device.type != "cuda":
        return load_target("tiny", device=device, dtype=torch.float32)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(SEED)
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**GPU_TARGET))
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, TINY_LM_HEAD_STD)
    model = _freeze(model.to(torch.bfloat16))
    return Target(model, ByteTokenizer(), default_layer_ids(GPU_TARGET["num_hidden_layers"]), "probe", "probe")


def _batches(shape: Shape, rows: int, n: int, pos_weights: torch.Tensor) -> list:
    """n global batches of `rows` random rows; the first quarter of each row is prompt (no loss)."""
    g = torch.Generator().manual_seed(SEED)
    out = []
    for k in range(n):
        samples = []
        for _ in range(rows):
            ids = torch.randint(1, 250, (shape.seq_len,), generator=g).tolist()
            p = shape.seq_len // 4
            samples.append(Sample(tuple(ids), tuple([0] * p + [1] * (shape.seq_len - p))))
        out.append(make_batch(samples, pad_len=shape.seq_len, pad_id=0, step=k, seed=SEED,
                              block_size=shape.block_size, anchors=shape.anchors, pos_weights=pos_weights))
    return out


class _HigherPrecisionStep:
    """Eager at a higher precision than the working one (fp32 for bf16 autocast on CUDA, fp64 for fp32
    on the CPU), on the same weights and batch: how far the working precision is from the exact step.
    With an fp8 precision, eager fp8 instead, at the working precision: how far fp8 is from it."""

    def __init__(self, ref: Replica, precision: str = "bf16", emulate: bool = False):
        self.dtype = torch.float32 if ref.device.type == "cuda" else torch.float64
        self.autocast = contextlib.nullcontext()
        if precision != "bf16":
            self.dtype, self.autocast = ref.params[0].dtype, ref.autocast
        drafter = copy.deepcopy(ref.drafter).to(self.dtype)
        fp8.use(drafter, precision, emulate)
        self.module = DraftLoss(drafter, ref.loss_module.pos_weights.to(self.dtype)).to(ref.device)
        self.params = [p for _, p in drafter.trainable_parameters()]
        self.target, self.device = ref.target, ref.device

    def step(self, weights: list[torch.Tensor], batch) -> tuple[float, list[torch.Tensor]]:
        with torch.no_grad():
            for p, w in zip(self.params, weights):
                p.copy_(w)
                p.grad = None
        b = batch.to(self.device)
        feats = self.target.features(b.input_ids).to(self.dtype)
        with self.autocast:
            loss_sum, _, _ = self.module(feats, b.input_ids, b.loss_mask, b.anchors, b.valid)
        (loss_sum / batch.weight_total).backward()
        return float(loss_sum.detach()) / batch.weight_total, snapshot_grads(self.params)


class _Case:
    """The engine under test (threads or processes) and the eager reference, from the same weights."""

    def __init__(self, policy: str, topology: str, n: int, device_kind: str, rank: int = 0,
                 precision: str = "bf16", emulate: bool = False):
        cuda = device_kind == "cuda"
        self.topology, self.n, self.rank = topology, n, rank
        self.shape = GPU_SHAPE if cuda else CPU_SHAPE
        n_gpus = torch.cuda.device_count() if cuda else 0
        if topology == "processes":
            devices = [torch.device(f"cuda:{rank % n_gpus}") if cuda else torch.device("cpu")]
        else:
            devices = [torch.device(f"cuda:{i % n_gpus}") if cuda else torch.device("cpu") for i in range(n)]
        self.device = devices[0]
        if cuda:
            torch.cuda.set_device(self.device)
        self.target = _target(self.device)
        self.pos_weights = masks.position_weights(self.shape.block_size, masks.default_gamma(self.shape.block_size))
        self.batches = _batches(self.shape, self.shape.rows_per_worker * n, 4, self.pos_weights)
        dcfg = self.target.drafter_config(num_layers=self.shape.draft_layers, block_size=self.shape.block_size,
                                          mask_token_id=None)
        torch.manual_seed(SEED)
        drafter = Drafter(dcfg)
        self.dtype = torch.bfloat16 if cuda else torch.float32

        def build(i: int, device: torch.device, policy_=policy, n_devices=len(devices), wrap=None,
                  precision_=precision):
            copied = copy.deepcopy(drafter)
            fp8.use(copied, precision_, emulate)
            return build_replica(i, device, copied, self.target, policy=policy_, n_devices=n_devices,
                                 lr=LR, betas=BETAS, weight_decay=0.0, pos_weights=self.pos_weights,
                                 wrap=wrap)

        self.ref = build(0, self.device, "eager", 1, precision_="bf16")   # eager bf16: the reference
        self.exact = _HigherPrecisionStep(self.ref, precision, emulate)
        self.precision = precision
        self.engine: Engine
        if topology == "processes":
            from trainer.engine.ranks import RankEngine, wrap_ddp

            self.engine = RankEngine(lambda: build(rank, self.device, wrap=lambda m: wrap_ddp(m, self.device)),
                                     rank, n, self.device, QuietLog(), guard=False)
        else:
            from trainer.engine.workers import ThreadEngine

            self.engine = ThreadEngine.start(devices, build, QuietLog(), warmup_timeout=3600.0, guard=False)
        self.names = self.ref.names

    # ---- the engine's step, in pieces --------------------------------------------------------
    def _loss(self, stats, batch) -> float:
        total = sum(s.loss_sum for s in stats)
        if self.topology == "processes":
            import torch.distributed as dist

            t = torch.tensor([total], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            total = float(t)
        return total / batch.weight_total

    def _load(self, weights: list[torch.Tensor]) -> None:
        self.engine.run_each(load_weights, [(weights,)] * len(self.engine.replicas))

    def _ref_step(self, batch, lr: float | None, step: int) -> float:
        st = compute_grads(self.ref, batch)
        if lr is not None:
            apply_update(self.ref, lr, GRAD_CLIP, step)
        return st.loss_sum / batch.weight_total

    # ---- the checks --------------------------------------------------------------------------
    def teacher_forced(self) -> list[StepCheck]:
        checks = []
        for k in range(TEACHER_STEPS):
            batch = self.batches[k]
            weights = [p.detach().clone() for p in self.ref.params]
            loss_t, g_t = self.exact.step(weights, batch)
            self._load(weights)
            loss_c = self._loss(self.engine.compute(batch), batch)
            g_c = snapshot_grads(self.engine.replicas[0].params)
            loss_e = self._ref_step(batch, None, k)
            g_e = snapshot_grads(self.ref.params)
            per_err, tot_err = grad_errors(g_c, g_e)
            per_noise, tot_noise = grad_errors(g_e, g_t)
            checks.append(StepCheck(loss_c, loss_e, loss_t, per_err, per_noise, tot_err, tot_noise))
            self.engine.update(LR, GRAD_CLIP, k)
            apply_update(self.ref, LR, GRAD_CLIP, k)
            if k == 0:
                phase("teacher-forced")   # the first step compiled; the rest are the checks
        return checks

    def replay(self) -> list[tuple[float, float]]:
        weights = [p.detach().clone() for p in self.ref.params]
        self._load(weights)
        eager = {b: self._ref_step(self.batches[b], None, 0) for b in (0, 1, 2)}
        return [(self._loss(self.engine.compute(self.batches[b]), self.batches[b]), eager[b]) for b in (0, 1, 2, 0)]

    def learn(self) -> tuple[list[float], list[float]]:
        weights = [p.detach().clone() for p in self.ref.params]
        self._load(weights)
        batch = self.batches[3]
        lc, le = [], []
        for k in range(LEARN_STEPS):
            out = self.engine.step(batch, k, LEARN_LR, GRAD_CLIP).result()
            lc.append(out.loss_sum / batch.weight_total)
            le.append(self._ref_step(batch, LEARN_LR, k))
        return lc, le

    def timed(self, steps: int) -> tuple[list[float], list[float]]:
        ms, ms_eager = [], []
        for k in range(steps):
            batch = self.batches[k % len(self.batches)]
            t = time.perf_counter()
            self.engine.step(batch, k, LR, GRAD_CLIP).result()  # the step has run: timed whole
            ms.append((time.perf_counter() - t) * 1000.0)
            if self.topology == "threads" or self.rank == 0:
                t = time.perf_counter()
                self._ref_step(batch, LR, k)
                ms_eager.append((time.perf_counter() - t) * 1000.0)
        return ms, ms_eager

    def close(self) -> None:
        self.engine.close()


def run_case(policy: str, topology: str, n: int, steps: int, device_kind: str, rank: int = 0,
             precision: str = "bf16", emulate: bool = False) -> dict:
    if device_kind != "cuda" and topology == "threads":
        cores.share_cpu(n)
    t0 = time.perf_counter()
    phase("compile")                         # building the replicas, then the first step compiles
    case = _Case(policy, topology, n, device_kind, rank, precision, emulate)
    try:
        checks = case.teacher_forced()       # the first call of the engine compiles: its warm-up
        first_s = time.perf_counter() - t0
        replay = case.replay()
        learn = case.learn()
        phase("timed")
        wait_for_turn()                      # side by side (schedule.py): until the other cases are stopped
        ms, ms_eager = case.timed(steps)
        phase("verdict")                     # the others may go on
        fp8_case = precision != "bf16"
        verdict = judge(checks, replay, learn, case.names, case.dtype, FP8_NOISE_FACTOR if fp8_case else NOISE_FACTOR,
                        fp8_limit(precision, case.shape.draft_layers) if fp8_case else None)
    finally:
        case.close()
    return _finite({
        "ok": True, "error": None, "wrong": not verdict["ok"], "why": verdict["why"],
        "numerics": verdict, "step_ms": round(statistics.median(ms), 3),
        "eager_step_ms": round(statistics.median(ms_eager), 3) if ms_eager else None,
        "first_step_s": round(first_s, 3), "shape": asdict(case.shape),
        "backends": list(case.ref.loss_module.backends(case.device)),
        "caches": _caches(),
    })


def _caches() -> dict:
    """The compile caches this case used (the parent gives every case the same ones:
    schedule.compile_caches) and how many graphs came from them or were compiled."""
    from torch._dynamo.utils import counters

    inductor: str | None
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        inductor = cache_dir()
    except Exception:  # noqa: BLE001 - where this torch keeps it elsewhere: what the parent said
        inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return {"inductor": inductor, "triton": os.environ.get("TRITON_CACHE_DIR"),
            "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
            "autograd_hit": counters["aot_autograd"]["autograd_cache_hit"]}


def phase(name: str) -> None:
    """Tell the parent (watch.run_isolated) what this case is doing now, for its heartbeat."""
    sys.stdout.write(PHASE_MARK + name + "\n")
    sys.stdout.flush()


def _finite(x):
    """JSON has no inf/NaN: a non-finite figure becomes null."""
    if isinstance(x, float):
        return x if x == x and x not in (float("inf"), float("-inf")) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _one_line(e: BaseException) -> str:
    first = str(e).strip().splitlines()[:1]
    return f"{type(e).__name__}: {first[0]}" if first else type(e).__name__


def case_main(args) -> int:
    """`--case POLICY:TOPOLOGY:N`: run one case, print its result line, exit without teardown."""
    policy, topology, n = args.case.split(":")
    rank = 0
    try:
        if topology == "processes":
            import torch.distributed as dist

            rank = int(os.environ.get("RANK", "0"))
            if args.device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
            dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                                    timeout=timedelta(seconds=max(60.0, args.timeout)))
        out = run_case(policy, topology, int(n), args.steps, args.device, rank, args.precision, args.fp8_emulate)
    except BaseException as e:  # noqa: BLE001 - the failure is the case's result
        traceback.print_exc()
        out = {"ok": False, "error": _one_line(e)}
    sys.stderr.flush()   # the case's traceback before its result line
    if rank == 0:
        sys.stdout.write(CASE_MARK + json.dumps(out) + "\n")
    # Skip interpreter teardown: the result is out, and a crash while freeing CUDA graphs or
    # compile workers after it would only blur what the case measured.
    exit_process(0 if out["ok"] else 1, finalize=False)
