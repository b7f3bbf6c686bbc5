"""Train-step benchmark (issue 14): the trainer's own step, frozen target forward included.

    PYTHONUNBUFFERED=1 python3 benchmarks/train_step_bench.py --out DIR                      # 1 GPU, 8B shape
    PYTHONUNBUFFERED=1 python3 benchmarks/train_step_bench.py --out DIR --target-mode full   # the old forward
    PYTHONUNBUFFERED=1 python3 benchmarks/train_step_bench.py --out DIR --gpus 2            # 2 workers, 2 GPUs
    .venv/bin/python benchmarks/train_step_bench.py --tiny --policy eager --out /tmp/tsb     # CPU, end to end

What a user waits for per step: the target forward that makes the drafter's features (hidden states
of 5 tapped layers), then the drafter's forward + backward, the cross-replica gradient sum and
the optimizer update. The target is a Qwen3-8B-shaped Qwen3ForCausalLM (hidden 4096, intermediate
12288, 36 layers, 32 q / 8 kv heads, head dim 128, vocab 151936, untied lm_head) with random bf16
weights built directly on each GPU (nothing downloaded, nothing initialised on the CPU), SDPA
attention, tapped at layers 1, 9, 17, 25, 33, wrapped in `trainer.target.Target`. The drafter is
`target.drafter_config(num_layers=5, block_size=16)`. Batch 2 per worker, context 768, 256 anchors
x block 16 (4 batches of different tokens and anchors, rotated).

The step is the trainer's: replicas built by `trainer.step.build_replica` in the worker threads of
`trainer.workers.ThreadEngine` (one worker per device by default, started as train.py starts them,
without the first-step eager guard), each step `engine.compute(batch)` then `engine.update(...)`,
which is what `ThreadEngine.step` runs. Timing: the host clock around the whole step with every
device synchronised before and after (the step's wall time); the target forward with CUDA events
around `Target.features` in each worker (the host clock on the CPU). Per step and worker:
features = that forward, drafter = step wall time - features (the drafter's forward + backward,
the gradient sum when there are several workers, clip + AdamW). ms/sample = median over the
timed steps / the global batch (workers run at once, so a worker's forward counts once). With
several workers on ONE GPU the split is approximate (their kernels share the device); the total
is exact. Peak memory: max_memory_allocated per GPU over the timed steps.

--target-mode: `truncated` (the trainer's default: the target stops after its last tapped layer),
`full` (the whole base model with every hidden state, as before issue 14), `inference` (truncated,
under torch.inference_mode, then cloned so the drafter's autograd may save it: a lever measured
here, not used by the trainer), `compiled` (truncated, each decoder layer compiled by inductor:
`Target.compile_layers`, what the trainer does on a GPU under a compiled policy since
--compile-target), `compiled-inference` (compiled, under inference_mode, then cloned),
`graphed` (compiled, and the whole forward replayed as a CUDA graph: Target.graph_features, what
the trainer does with one worker per GPU; on the CPU the same as compiled). A
comma-separated list alternates the modes step by step in one process (one compile, interleaved
steps: a fair A/B); each mode gets its own medians. --allreduce (copy, nccl) and --grads (flat:
FlatGrads buffers; own: each parameter keeps backward's gradient, what the trainer does unless the
copy-sum needs the buffers) and --update (fused: torch's fused AdamW with the clip folded in;
compiled: clip + AdamW as one inductor-compiled function, trainer/adamw.py) alternate the same
way: one case per combination, named MODE[+ALLREDUCE][+GRADS][+UPDATE] where a list has several.
The step is ThreadEngine.step's: the shards' loss and counts are read after the update is queued,
so "compute" and "update" split the host's time (compute = queuing forward + backward), not the GPU's.

Before timing, one batch's truncated features are compared with the whole forward's (torch.equal,
on this machine's transformers): `truncated_equals_full` in the results. With `compiled`, the
compiled layers' features are compared with eager's and both with the same forward in fp32 (fp64
on the CPU): `compiled_features` in the results (relative L2 errors).

--topology processes: the same step as `--topology processes` trains it: this command starts one
torchrun rank per worker (--workers, default --gpus), each with its own target, its replica's
DraftLoss inside DDP and `trainer.distributed.RankEngine`; the step's wall time is the slowest
rank's (a barrier after each step), rank 0 reports. No GIL is shared, unlike threads.

--profile: after timing, two more steps of the first case under torch.profiler: CUDA kernel ms by
category. --trace: the same two steps' timeline too, as OUT/trace.json.gz, and where the GPU sat
idle in them and why (benchmarks/gaps.py: `gaps` in the results).

Writes DIR/results.json (rewritten after every step, so a run cut short keeps what it measured);
prints progress lines while it runs and a summary at the end.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

# Measured on one H200, torch 2.11, batch 2 x 768 (docs/benchmarks.md): what this benchmark's
# figures are compared with.
REFERENCE_MS_PER_SAMPLE = {
    "plain Qwen3-8B forward, hidden states of 5 layers (transformers + sdpa, inference mode)": 25.9,
    "the same, stopping after layer 33": 24.9,
    "drafter step alone (benchmarks/drafter_bench.py, inductor/flex/chunked)": 67.1,
    "SpecForge 0.2.0, whole step": 112.8,
}

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
SHAPES = {
    "8b": dict(layers=(1, 9, 17, 25, 33), draft_layers=5, batch=2, seq=768, anchors=256, block=16),
    # the trainer's `tiny` target (8 layers, hidden 64) with its default layers
    "tiny": dict(layers=None, draft_layers=2, batch=2, seq=128, anchors=8, block=16),
}
MODES = ("truncated", "full", "inference", "compiled", "compiled-inference", "graphed")
GRADS = ("auto", "flat", "own")
UPDATES = ("auto", "fused", "compiled")


def build_target(args, device):
    """The frozen target on `device`, wrapped in trainer.target.Target."""
    import torch

    from trainer.target import Target, load_target

    if args.tiny:
        t = load_target("tiny", device=device, dtype=torch.float32)
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        # bf16 on a GPU, as the trainer loads a target; fp32 on the CPU (--cpu, tests), as it would there
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        cfg = Qwen3Config(**QWEN3_8B, attn_implementation="sdpa")
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # allocate bf16 from the start: 16 GB, not 33
        try:
            torch.manual_seed(0)
            with torch.device(device):
                model = Qwen3ForCausalLM(cfg)
        finally:
            torch.set_default_dtype(before)
        model = model.to(dtype=dtype).eval()  # as load_target does (casts the rotary buffer too)
        for p in model.parameters():
            p.requires_grad_(False)
        t = Target(model, None, SHAPES["8b"]["layers"], "qwen3-8b-random", "random")
    return t


class FeatureClock:
    """Times Target.features in whichever worker thread calls it: CUDA events on a GPU (read after
    the step's synchronize), the host clock on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.inference = False  # set between steps, while the workers are idle
        self._lock = threading.Lock()
        self._marks: dict[str, list] = {}

    def wrap(self, target) -> None:
        import torch

        inner = target.features  # the bound method; replicas on this device share this Target

        def features(input_ids, **kw):
            who = threading.current_thread().name
            if self.cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            else:
                t0 = time.perf_counter()
            if self.inference:
                with torch.inference_mode():
                    out = inner(input_ids, **kw)
                out = out.clone()  # outside inference mode: a tensor autograd may save
            else:
                out = inner(input_ids, **kw)
            if self.cuda:
                e1.record()
                mark = (e0, e1)
            else:
                mark = (time.perf_counter() - t0) * 1e3
            with self._lock:
                self._marks.setdefault(who, []).append(mark)
            return out

        target.features = features

    def take(self) -> dict[str, float]:
        """ms of each worker's target forward(s) since the last call (call after synchronizing)."""
        with self._lock:
            marks, self._marks = self._marks, {}
        return {who: sum(m if isinstance(m, float) else m[0].elapsed_time(m[1]) for m in ms)
                for who, ms in sorted(marks.items())}


def compare_compiled(first, ids, targets) -> dict:
    """Compile every target's layers; on `first`, compare compiled and eager features with the same
    forward at a higher precision (the model cast up in place, then back: bf16 -> fp32 -> bf16 is
    exact). The compiled error against the reference must be eager's own, not more."""
    import torch

    from trainer.numerics import rel_l2

    for t in targets:
        t.compile_layers()
    t0 = time.perf_counter()
    compiled = first.features(ids)
    compile_s = time.perf_counter() - t0
    eager = first.features(ids, eager=True)
    dtype = next(first.model.parameters()).dtype
    high = torch.float32 if dtype != torch.float32 else torch.float64
    first.model.to(high)
    try:
        ref = first.features(ids, eager=True)
    finally:
        first.model.to(dtype)
    return {"compiled_vs_eager": rel_l2(compiled, eager), "eager_vs_reference": rel_l2(eager, ref),
            "compiled_vs_reference": rel_l2(compiled, ref), "reference_dtype": str(high),
            "first_compile_s": round(compile_s, 1)}


def make_batches(args, vocab: int, pos_weights, n: int = 4):
    """n global batches of random tokens (every position carries loss), anchors drawn per step."""
    import torch

    from trainer.data import Sample, make_batch

    sh = SHAPES[args.shape]
    B = sh["batch"] * args.workers
    g = torch.Generator().manual_seed(1234)
    out = []
    for k in range(n):
        ids = torch.randint(0, vocab - 1, (B, sh["seq"]), generator=g).tolist()
        samples = [Sample(tuple(row), (1,) * sh["seq"]) for row in ids]
        out.append(make_batch(samples, pad_len=sh["seq"], pad_id=0, step=k, seed=0, block_size=sh["block"],
                              anchors=sh["anchors"], pos_weights=pos_weights))
    return out


@dataclass
class Placement:
    """Where this process's replicas run: `devices` (one per worker thread, or this rank's one),
    `all_devices` (every worker's or rank's, for the results), `rank` (0 with threads)."""
    cuda: bool
    procs: bool
    rank: int
    devices: list
    all_devices: list[str]


def run(args, emit, res: dict) -> None:
    import torch

    from trainer import policies

    cuda = not (args.tiny or args.cpu)
    procs = args.topology == "processes"
    if cuda and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if procs:  # this process is one torchrun rank (main() started them): one replica, one device
        import torch.distributed as dist

        rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        devices = [torch.device("cuda", local) if cuda else torch.device("cpu")]
        if cuda:
            torch.cuda.set_device(devices[0])
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.warmup_timeout))
        all_devices = [f"cuda:{i}" for i in range(world)] if cuda else ["cpu"] * world
    else:
        rank = 0
        devices = ([torch.device("cuda", i % args.gpus) for i in range(args.workers)] if cuda
                   else [torch.device("cpu")] * args.workers)
        all_devices = [str(d) for d in devices]
        if not cuda and args.workers > 1:
            policies.share_cpu(args.workers)  # as train.py does for CPU workers
    try:
        _run(args, emit, res, Placement(cuda, procs, rank, devices, all_devices))
    finally:
        if procs:
            dist.destroy_process_group()


def _run(args, emit, res: dict, where: Placement) -> None:
    import torch

    from trainer import adamw, masks
    from trainer.log import QuietLog, RunLog
    from trainer.model import Drafter
    from trainer.step import build_replica
    from trainer.workers import ThreadEngine

    sh = SHAPES[args.shape]
    cuda, procs, rank, devices = where.cuda, where.procs, where.rank, where.devices
    res.update({"ok": False, "shape": args.shape, "policy": args.policy, "topology": args.topology,
                "target_modes": [c["name"] for c in args.cases], "allreduce": args.allreduce, "grads": args.grads,
                "update": args.update,
                "workers": args.workers, "gpus": args.gpus if cuda else 0, "devices": where.all_devices,
                "batch_per_worker": sh["batch"], "global_batch": sh["batch"] * args.workers, "seq": sh["seq"],
                "anchors": sh["anchors"], "block": sh["block"], "torch": torch.__version__,
                "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
                "reference_ms_per_sample": REFERENCE_MS_PER_SAMPLE, "steps": []})
    try:
        import transformers

        res["transformers"] = transformers.__version__
    except ImportError:
        pass

    # ---- targets: one per device, shared by the workers on it (as Target.to does) --------------
    t0 = time.perf_counter()
    clock = FeatureClock(cuda)
    targets = {}
    for d in dict.fromkeys(devices):
        emit(f"building the target on {d} ...")
        targets[d] = build_target(args, d)
    first = targets[devices[0]]
    res["target_build_s"] = round(time.perf_counter() - t0, 1)
    res["layer_ids"] = list(first.layer_ids)
    res["target_layers"] = first.num_layers
    res["attn_implementation"] = getattr(first.config, "_attn_implementation", None)
    res["target_params"] = sum(p.numel() for p in first.model.parameters())
    emit(f"target: {res['target_params'] / 1e9:.2f} B params, {first.num_layers} layers, taps {res['layer_ids']}, "
         f"attention {res['attn_implementation']}, {res['target_build_s']} s")

    # ---- drafters: one initial copy per worker, built on the first device -------------------------
    dcfg = first.drafter_config(num_layers=sh["draft_layers"], block_size=sh["block"], mask_token_id=None)
    torch.manual_seed(0)
    with torch.device(devices[0]):
        drafter = Drafter(dcfg)
    copies = [drafter] + [copy.deepcopy(drafter) for _ in devices[1:]]
    pw = masks.position_weights(sh["block"], masks.default_gamma(sh["block"]))
    res["trainable_params"] = sum(p.numel() for _, p in drafter.trainable_parameters())

    def build(i, device):
        wrap = None
        if procs:  # as trainer/distributed.py builds a rank's replica: DraftLoss inside DDP
            from trainer.distributed import _ddp

            wrap = lambda m: _ddp(m, device)  # noqa: E731
        return build_replica(i, device, copies[0 if procs else i], targets[device], policy=args.policy,
                             n_devices=1 if procs else len(devices), lr=1e-5, weight_decay=0.0, pos_weights=pw,
                             wrap=wrap,
                             compile_update=adamw.compile_update("auto", args.policy, device) or "compiled" in args.update)

    batches = make_batches(args, dcfg.vocab_size, pw)
    # This machine's transformers, this shape: the truncated forward must give the whole forward's features.
    ids = batches[0].input_ids[: sh["batch"]].to(devices[0])
    first.truncate = False
    want = first.features(ids)
    first.truncate = True
    got = first.features(ids)
    res["truncated_equals_full"] = bool(torch.equal(got, want))
    res["truncated_max_abs_diff"] = float((got.float() - want.float()).abs().max())
    emit(f"truncated target features equal the whole forward's: {res['truncated_equals_full']} "
         f"(max abs diff {res['truncated_max_abs_diff']:g})")
    del want, got
    if any(m.startswith("compiled") or m == "graphed" for m in args.modes):
        res["compiled_features"] = compare_compiled(first, ids, targets.values())
        emit("compiled target layers, features relative L2: " + ", ".join(
            f"{k} {v:.3g}" for k, v in res["compiled_features"].items() if isinstance(v, float)))
    if "graphed" in args.modes:
        # The graph replays the compiled forward's kernels: the same bits (captured here, replayed
        # in the worker; a failed capture warns and runs uncaptured, which this also shows).
        want = first.features(ids)
        first.graph_features()
        first.features(ids)  # captures
        got = first.features(ids)
        first.graphed = False
        res["graphed_equals_compiled"] = bool(torch.equal(got, want))
        res["graph_captured"] = any(v is not False for v in first._graphs.values())
        emit(f"graphed target features equal the compiled forward's: {res['graphed_equals_compiled']} "
             f"(graph captured: {res['graph_captured']})")
        del want, got
    for t in targets.values():
        clock.wrap(t)
    def sync():
        if cuda:
            for d in dict.fromkeys(devices):
                torch.cuda.synchronize(d)
        if procs:  # every rank's step has ended: the step's wall time is the slowest rank's
            torch.distributed.barrier()

    # the engine's own progress lines (worker ready, ...), from rank 0 only
    log = RunLog(None, stream=sys.stdout) if rank == 0 else QuietLog()

    t0 = time.perf_counter()
    if procs:
        from trainer.distributed import RankEngine

        world = torch.distributed.get_world_size()
        engine = RankEngine(lambda: build(rank, devices[0]), rank, world, devices[0], log, guard=False)
    else:
        engine = ThreadEngine.start(devices, build, log, args.warmup_timeout, guard=False)

    updates = {r.index: r.update for r in engine.replicas}  # CompiledUpdate or None, as built

    def use(case: dict) -> None:
        """Set up the next step as `case` says (between steps, while the workers are idle)."""
        if not procs:  # the ranks' sum is DDP's, into gradients it owns
            engine.allreduce, engine.grads = case["allreduce"], case["grads"]
        for r in engine.replicas:
            r.update = None if case["update"] == "fused" else updates[r.index]
        for t in targets.values():
            t.truncate = case["mode"] != "full"
            t.compiled = case["mode"].startswith("compiled") or case["mode"] == "graphed"
            t.graphed = case["mode"] == "graphed"
        clock.inference = case["mode"].endswith("inference")

    try:
        res["build_s"] = round(time.perf_counter() - t0, 1)
        res["backends"] = engine.primary.loss_module.backends(devices[0])
        emit(f"{engine.size} replica(s) built in {res['build_s']} s ({res['trainable_params'] / 1e9:.2f} B trainable "
             f"each, backends {res['backends']}); step 1 compiles under {args.policy}, one worker at a time ...")
        start = time.perf_counter()
        for i in range(args.warmup + args.steps):
            batch = batches[i % len(batches)]
            case = args.cases[i % len(args.cases)]  # warm-up steps cycle too: each case runs once untimed
            use(case)
            allreduce = case["allreduce"]
            sync()
            if cuda:
                for d in dict.fromkeys(devices):
                    torch.cuda.reset_peak_memory_stats(d)
            t0 = time.perf_counter()
            stats = engine.compute(batch, host=False)  # as ThreadEngine.step: read after the update is queued
            t1 = time.perf_counter()
            norm = engine.update(1e-5, 1.0, i)
            stats = [s.to_host() for s in stats]
            sync()
            t2 = time.perf_counter()
            feats = clock.take()
            B = len(batch)
            loss_sum = sum(s.loss_sum for s in stats)
            if procs:  # the global batch's loss (untimed): every rank's shard
                t = torch.tensor([loss_sum], dtype=torch.float64, device=devices[0])
                torch.distributed.all_reduce(t)
                loss_sum = float(t)
            rec = {"step": i, "mode": case["name"], "allreduce": allreduce, "grads": case["grads"], "update": case["update"], "timed": i >= args.warmup, "total_ms": (t2 - t0) * 1e3,
                   "compute_ms": (t1 - t0) * 1e3, "update_ms": (t2 - t1) * 1e3, "features_ms": feats,
                   "features_mean_ms": statistics.mean(feats.values()) if feats else 0.0,
                   "loss": loss_sum / batch.weight_total, "grad_norm": norm}
            rec["drafter_ms"] = rec["total_ms"] - rec["features_mean_ms"]
            if cuda:
                rec["peak_gb"] = {str(d): torch.cuda.max_memory_allocated(d) / 1e9 for d in dict.fromkeys(devices)}
            res["steps"].append(rec)
            if i == 0:
                res["first_step_s"] = round(rec["total_ms"] / 1e3, 1)
            emit(f"step {i + 1}/{args.warmup + args.steps} [{case['name']}]{'' if rec['timed'] else ' (warm-up)'}: "
                 f"{rec['total_ms'] / B:.1f} ms/sample (target {rec['features_mean_ms'] / B:.1f}, "
                 f"drafter {rec['drafter_ms'] / B:.1f}), loss {rec['loss']:.4f}, grad norm {norm:.3f}"
                 + (f", peak {max(rec['peak_gb'].values()):.1f} GB" if cuda else ""))
            _summarise(res)
            if rank == 0:
                _write(args.out, res)
            # every rank stops at the same step (RankEngine.agree: any rank's flag)
            if engine.agree(time.perf_counter() - start > args.deadline) and i + 1 < args.warmup + args.steps:
                res["stopped_early"] = f"--deadline {args.deadline:g} s reached after step {i + 1}"
                emit(res["stopped_early"])
                break
        if args.profile or args.trace:  # on the CPU the tables are empty (CUDA only): the code path still runs
            use(args.cases[0])
            res["profile"] = profile_steps(engine, batches, args, sync, record=rank == 0)
        if rank == 0 and (args.profile or args.trace):
            emit("profile (CUDA kernel ms per sample, 2 steps of " + args.cases[0]["name"] + "): "
                 + json.dumps(res["profile"]["per_sample_ms"]))
            if "gaps" in res["profile"]:
                from gaps import render

                emit("where the GPU sat idle in those 2 steps:\n" + render(res["profile"]["gaps"]))
            _write(args.out, res)
        # Every worker applied the same updates: their weights must be bit-identical (raises if not).
        engine.check_replicas(len(res["steps"]))
        res["replicas_identical"] = True
        emit(f"replica weights bit-identical after {len(res['steps'])} steps: {engine.size} replica(s)")
    finally:
        engine.close()
    res["ok"] = bool(res.get("timed_steps"))


def profile_steps(engine, batches, args, sync, record: bool = True) -> dict:
    """Two more steps of the first case under torch.profiler: CUDA kernel time by category
    (drafter_bench's table; CUPTI sees every thread's kernels), per sample of the global batch.
    The target's attention is the `sdpa attention` row (the drafter's is flex). With --trace, the
    timeline goes to OUT/trace.json.gz and its idle gaps are attributed (benchmarks/gaps.py)."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    from drafter_bench import _kernel_table
    from gaps import gap_report, load

    sync()
    # Started and stopped in worker 0's thread: the profiler records the CPU ops of the thread that
    # starts it (and the autograd threads it drives), so the trace can say which op made a gap.
    # With several ranks, only rank 0 records (`record`); the others run the same two steps.
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    if record:
        engine.on_primary(prof.start)
    try:
        for k in range(2):
            engine.step(batches[k % len(batches)], k, 1e-5, 1.0)
        sync()
    finally:
        if record:
            engine.on_primary(prof.stop)
    if not record:
        return {}
    table = _kernel_table(prof)
    n = 2 * len(batches[0])
    table["steps"] = 2
    table["case"] = args.cases[0]["name"]
    table["per_sample_ms"] = {k: round(v / n, 2) for k, v in table["by_category_ms"].items()}
    if args.trace:
        raw = Path(args.out) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        table["gaps"] = gap_report(load(str(raw) + ".gz"))
    return table


def cases(**dims: list[str]) -> list[dict]:
    """One case per combination of the dimensions' values, in order; named by the first dimension's
    value and, joined by "+", each other dimension's that has several (compiled+own+fused, ...)."""
    import itertools

    keys = list(dims)
    out = []
    for values in itertools.product(*dims.values()):
        parts = [v for k, v in zip(keys, values) if k == keys[0] or len(dims[k]) > 1]
        out.append(dict(zip(keys, values), name="+".join(parts)))
    return out


def _summarise(res: dict) -> None:
    """res["modes"][mode]: medians over that mode's timed steps, ms/sample (each column its own median)."""
    timed = [s for s in res["steps"] if s["timed"]]
    res["timed_steps"] = len(timed)
    B = res["global_batch"]
    res["modes"] = {}
    for mode in res["target_modes"]:
        mine = [s for s in timed if s["mode"] == mode]
        if not mine:
            continue
        m = res["modes"][mode] = {"timed_steps": len(mine)}
        for key in ("total", "features_mean", "drafter", "compute", "update"):
            m[f"{key.replace('_mean', '')}_ms_per_sample"] = round(statistics.median(s[f"{key}_ms"] for s in mine) / B, 2)
        if "peak_gb" in mine[0]:
            m["peak_gb"] = {d: round(max(s["peak_gb"][d] for s in mine), 2) for d in mine[0]["peak_gb"]}


def _write(out: str, res: dict) -> None:
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "results.json.tmp"
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, path / "results.json")


def summary(res: dict) -> str:
    if not res.get("timed_steps"):
        return f"no timed step ({res.get('error', 'see the log')})"
    lines = [
        f"train step, {res['shape']} shape, policy {res['policy']}, "
        f"{res['workers']} {'rank(s)' if res.get('topology') == 'processes' else 'worker(s)'} on "
        f"{', '.join(dict.fromkeys(res['devices']))} ({res['device_name']}), "
        f"global batch {res['global_batch']} x {res['seq']}, {res['anchors']} anchors x block {res['block']}; "
        f"torch {res['torch']}, transformers {res.get('transformers', '?')}",
        f"medians of {res['timed_steps']} timed steps after {len(res['steps']) - res['timed_steps']} warm-up "
        f"(the first, with compile: {res.get('first_step_s')} s); ms/sample, drafter = total - target forward; "
        f"truncated features == the whole forward's: {res.get('truncated_equals_full')}",
        "",
        "| target mode | steps | target forward | drafter step | total | compute / update | peak GB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, m in res["modes"].items():
        peak = ", ".join(f"{v:.1f}" for v in m["peak_gb"].values()) if m.get("peak_gb") else "-"
        lines.append(f"| {mode} | {m['timed_steps']} | {m['features_ms_per_sample']:.1f} | {m['drafter_ms_per_sample']:.1f} | "
                     f"**{m['total_ms_per_sample']:.1f}** | {m['compute_ms_per_sample']:.1f} / "
                     f"{m['update_ms_per_sample']:.1f} | {peak} |")
    if res["shape"] == "8b":
        lines.append("reference, ms/sample on one H200: " + "; ".join(f"{k}: {v}" for k, v in REFERENCE_MS_PER_SAMPLE.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the trainer's tiny target on the CPU, end to end")
    ap.add_argument("--policy", default="inductor", help="compile policy (trainer/policies.py); default inductor")
    ap.add_argument("--target-mode", default="truncated",
                    help=f"one of {', '.join(MODES)}, or several comma-separated, alternated step by step")
    ap.add_argument("--allreduce", default="auto",
                    help="the workers' gradient sum: auto, copy or nccl (ThreadEngine.allreduce); several comma-separated "
                         "alternate step by step")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs (ignored with --tiny)")
    ap.add_argument("--workers", type=int, default=0,
                    help="worker threads (ranks with --topology processes), worker i on GPU i mod --gpus; default --gpus")
    ap.add_argument("--topology", default="threads", choices=("threads", "processes"),
                    help="threads: ThreadEngine in this process (default); processes: one torchrun rank per worker, "
                         "DDP, as --topology processes trains (this command starts torchrun)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first compiles)")
    ap.add_argument("--grads", default="auto",
                    help="where gradients live: auto, flat or own (ThreadEngine.grads); several comma-separated alternate")
    ap.add_argument("--update", default="auto",
                    help="the optimizer update: auto (as the trainer), fused or compiled; several comma-separated alternate")
    ap.add_argument("--profile", action="store_true", help="after timing, profile 2 steps (GPU only): kernel ms by category")
    ap.add_argument("--trace", action="store_true",
                    help="with the profile, keep its timeline (OUT/trace.json.gz) and attribute the GPU's idle gaps")
    ap.add_argument("--deadline", type=float, default=1e9, help="stop timing after this many seconds of steps")
    ap.add_argument("--warmup-timeout", type=float, default=900.0, help="seconds a worker may take to build + compile")
    ap.add_argument("--out", default="out/train_step_bench")
    ap.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)  # tests: the 8B code path on the CPU
    args = ap.parse_args(argv)
    args.shape = "tiny" if args.tiny else "8b"
    args.modes = list(dict.fromkeys(args.target_mode.split(",")))
    args.allreduce = list(dict.fromkeys(args.allreduce.split(",")))
    args.grads = list(dict.fromkeys(args.grads.split(",")))
    args.update = list(dict.fromkeys(args.update.split(",")))
    bad = ([m for m in args.modes if m not in MODES] + [a for a in args.allreduce if a not in ("auto", "copy", "nccl")]
           + [g for g in args.grads if g not in GRADS] + [u for u in args.update if u not in UPDATES])
    if bad:
        ap.error(f"--target-mode/--allreduce/--grads/--update {bad[0]!r}: choose from {', '.join(MODES)} / "
                 f"auto, copy, nccl / {', '.join(GRADS)} / {', '.join(UPDATES)}")
    args.workers = args.workers or (1 if args.tiny else args.gpus)
    procs = args.topology == "processes"
    if procs and (args.allreduce != ["auto"] or args.grads != ["auto"]):
        ap.error("--allreduce and --grads are the threads' sum: with --topology processes DDP sums the gradients")
    if procs and "RANK" not in os.environ:  # start the ranks; each runs this same command
        argv = list(sys.argv[1:] if argv is None else argv)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.workers}",
               str(Path(__file__).resolve()), *argv]
        print(f"[train_step_bench] torchrun: {' '.join(cmd[1:])}", flush=True)
        return subprocess.call(cmd)
    rank = int(os.environ.get("RANK", "0")) if procs else 0
    args.cases = cases(mode=args.modes, allreduce=args.allreduce, grads=args.grads, update=args.update)
    args.warmup = max(len(args.cases), args.warmup)  # the first step compiles; each case runs once untimed

    def emit(text: str) -> None:
        if rank == 0:  # with several ranks, rank 0 speaks for the job
            print(f"[train_step_bench {time.strftime('%H:%M:%S')}] {text}", flush=True)

    emit(f"{args.shape} shape, policy {args.policy}, target mode(s) {', '.join(args.modes)}, {args.workers} "
         + ("rank(s)" if procs else "worker(s)") + ("" if args.tiny else f" on {args.gpus} GPU(s)")
         + f"; results in {args.out}/results.json")
    res: dict = {"ok": False}
    try:
        run(args, emit, res)
    except BaseException as e:  # recorded in results.json, then raised: the traceback is the log's
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"[-2000:]
        raise
    finally:
        if rank == 0:
            _write(args.out, res)
    if rank == 0:
        print("\n" + summary(res), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
