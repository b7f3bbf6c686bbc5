"""Train-step benchmark: the trainer's own step, frozen target forward included.

    PYTHONUNBUFFERED=1 python3 benchmarks/train_step_bench.py --out DIR                      # 1 GPU, 8B shape
    PYTHONUNBUFFERED=1 python3 benchmarks/train_step_bench.py --out DIR --target-mode full   # the old forward
    PYTHONUNBUFFERED=1 python3 benchmarks/train_step_bench.py --out DIR --gpus 2            # 2 workers, 2 GPUs
    .venv/bin/python benchmarks/train_step_bench.py --tiny --policy eager --out /tmp/tsb     # CPU, end to end

What a user waits for per step: the target forward that makes the drafter's features (hidden states
of 5 tapped layers), then the drafter's forward + backward, the cross-replica gradient sum and
the optimizer update. The target is a Qwen3-8B-shaped Qwen3ForCausalLM (hidden 4096, intermediate
12288, 36 layers, 32 q / 8 kv heads, head dim 128, vocab 151936, untied lm_head) with random bf16
weights built directly on each GPU (nothing downloaded, nothing initialised on the CPU), SDPA
attention, tapped at layers 1, 9, 17, 25, 33, wrapped in `trainer.run.target.Target`. The drafter is
`target.drafter_config(num_layers=5, block_size=16)`. Batch 2 per worker, context 768, 256 anchors
x block 16 (4 batches of different tokens and anchors, rotated).

The step is the trainer's: replicas built by `trainer.engine.step.build_replica` in the worker
threads of `trainer.engine.workers.ThreadEngine` (one worker per device by default, started as
trainer/train/main.py starts them, without the first-step eager guard), each step
`engine.step(batch, ahead=next batch)` as the trainer's loop runs it: with --lookahead on (as the
trainer) a step makes the NEXT step's target features during its gradient sum, so the forward timed
in a step is the next one's (one a step either way); with --host ahead (as the trainer) the host
queues the next step before the devices have finished this one (ThreadEngine.step returns at once;
the results are read a step later), --host sync waits for each step's results first (the trainer
before 2026-12-01). Timing: steps run in blocks of --case-steps of one case; the host clock around a
whole block, every device synchronised before and after, divided by its steps, is each of its steps'
total; the target forward with CUDA events around `Target.features` in each worker (the host clock
on the CPU), summed over the block and divided likewise. Per step and worker: features = that
forward, drafter = total - features (the drafter's forward + backward, the gradient sum when there
are several workers, clip + AdamW). ms/sample = median over the timed steps / the global batch
(workers run at once, so a worker's forward counts once). With several workers on ONE GPU the split
is approximate (their kernels share the device); the total is exact. Peak memory:
max_memory_allocated per GPU over the timed blocks.

--target-mode: `truncated` (the trainer's default: the target stops after its last tapped layer),
`full` (the whole base model with every hidden state, as the trainer once ran it), `inference` (truncated,
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
compiled: clip + AdamW as one inductor-compiled function, trainer/engine/adamw.py) alternate the same
way (and --lookahead, --host): one case per combination, named MODE[+ALLREDUCE][+GRADS][+UPDATE]...
where a list has several.

Before timing, one batch's truncated features are compared with the whole forward's (torch.equal,
on this machine's transformers): `truncated_equals_full` in the results. With `compiled`, the
compiled layers' features are compared with eager's and both with the same forward in fp32 (fp64
on the CPU): `compiled_features` in the results (relative L2 errors).

--topology processes: the same step as `--topology processes` trains it: this command starts one
torchrun rank per worker (--workers, default --gpus), each with its own target, its replica's
DraftLoss inside DDP and `trainer.engine.ranks.RankEngine`; the step's wall time is the slowest
rank's (a barrier after each step), rank 0 reports. No GIL is shared, unlike threads.

--profile: after timing, two more steps of the first case under torch.profiler: CUDA kernel ms by
category. --trace: the same two steps' timeline too, as OUT/trace.json.gz, and where the GPU sat
idle in them and why (benchmarks/gpu_idle_gaps.py: `gaps` in the results).

Writes DIR/results.json (rewritten after every step, so a run cut short keeps what it measured);
prints progress lines while it runs and a summary at the end. This file holds the command and the
step loop; train_step_setup.py what the step runs on (target, shapes, batches, feature checks),
train_step_report.py what comes out (cases, medians, results file, summary, profile).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from train_step_report import REFERENCE_MS_PER_SAMPLE, cases, profile_steps, summarise, summary, write  # noqa: E402
from train_step_setup import SHAPES, FeatureClock, build_target, check_features, make_batches  # noqa: E402

MODES = ("truncated", "full", "inference", "compiled", "compiled-inference", "graphed")
GRADS = ("auto", "flat", "own")
UPDATES = ("auto", "fused", "compiled")


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

    from trainer import cores
    from trainer.model import choices

    choices.configure(fp32_wgrad=args.fp32_wgrad == "on", flex_tiles=args.flex_tiles, ce_rows=args.ce_rows,
                      ce_kernel_on=args.ce_kernel == "on")  # the trainer's --fp32-wgrad ... options, for A/Bs

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
            cores.share_cpu(args.workers)  # as trainer/train/main.py does for CPU workers
    try:
        _run(args, emit, res, Placement(cuda, procs, rank, devices, all_devices))
    finally:
        if procs:
            dist.destroy_process_group()


def _run(args, emit, res: dict, where: Placement) -> None:
    import torch

    from trainer import policies
    from trainer.model import masks
    from trainer.run.log import QuietLog, RunLog
    from trainer.model.drafter import Drafter
    from trainer.engine.step import build_replica
    from trainer.engine.workers import ThreadEngine

    sh = SHAPES[args.shape]
    cuda, procs, rank, devices = where.cuda, where.procs, where.rank, where.devices
    res.update({"ok": False, "shape": args.shape, "policy": args.policy, "topology": args.topology,
                "target_modes": [c["name"] for c in args.cases], "allreduce": args.allreduce, "grads": args.grads,
                "update": args.update, "host": args.host, "case_steps": args.case_steps,
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
    if args.precision != "bf16":  # the trainer's --precision (trainer/model/fp8.py), before the copies
        from trainer.model import fp8

        fp8.use(drafter, args.precision, args.fp8_emulate)
    res["precision"] = args.precision
    copies = [drafter] + [copy.deepcopy(drafter) for _ in devices[1:]]
    pw = masks.position_weights(sh["block"], masks.default_gamma(sh["block"]))
    res["trainable_params"] = sum(p.numel() for _, p in drafter.trainable_parameters())

    def build(i, device):
        wrap = None
        if procs:  # as trainer/train/distributed.py builds a rank's replica: DraftLoss inside DDP
            from trainer.engine.ranks import wrap_ddp

            wrap = lambda m: wrap_ddp(m, device)  # noqa: E731
        compile_update = policies.compiled_part("auto", args.policy, device) or "compiled" in args.update
        return build_replica(i, device, copies[0 if procs else i], targets[device], policy=args.policy,
                             n_devices=1 if procs else len(devices), lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0,
                             pos_weights=pw,
                             wrap=wrap, compile_update=compile_update)

    batches = make_batches(args, dcfg.vocab_size, pw)
    ids = batches[0].input_ids[: sh["batch"]].to(devices[0])
    res.update(check_features(first, ids, targets.values(), args.modes, emit))
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
        from trainer.engine.ranks import RankEngine

        world = torch.distributed.get_world_size()
        engine = RankEngine(lambda: build(rank, devices[0]), rank, world, devices[0], log, guard=False)
    else:
        engine = ThreadEngine.start(devices, build, log, args.warmup_timeout, guard=False)

    updates = {r.index: r.update for r in engine.replicas}  # CompiledUpdate or None, as built

    def case_at(i: int) -> dict:
        return args.cases[(i // args.case_steps) % len(args.cases)]

    def use(case: dict) -> None:
        """Set up the next step as `case` says (between steps, while the workers are idle)."""
        if not procs:  # the ranks' sum is DDP's, into gradients it owns
            # "own": each parameter's own gradient, which is the engine's auto wherever the sum is NCCL
            engine.allreduce, engine.grads = case["allreduce"], "flat" if case["grads"] == "flat" else "auto"
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
        for block in blocks(args):
            case = case_at(block[0])
            use(case)  # the workers are idle: the last block ended with a synchronize
            if cuda:
                for d in dict.fromkeys(devices):
                    torch.cuda.reset_peak_memory_stats(d)
            outs = []
            t0 = time.perf_counter()
            for i in block:
                batch = batches[i % len(batches)]
                # as the trainer's loop: the next batch, when the next step is in this block (the last
                # step prefetches for a step that never comes: each step runs the target once)
                ahead = batches[(i + 1) % len(batches)] if case["lookahead"] == "on" and i != block[-1] else None
                out = engine.step(batch, i, 1e-5, 1.0, ahead=ahead)
                if case["host"] == "sync":  # the host waits for each step before it queues the next
                    out.result()
                outs.append(out)
            engine.settle()
            sync()
            wall = (time.perf_counter() - t0) * 1e3 / len(block)
            feats = {who: ms / len(block) for who, ms in clock.take().items()}
            for i, out in zip(block, outs):
                st, batch = out.result(), batches[i % len(batches)]
                B = len(batch)
                rec = {"step": i, "mode": case["name"], "allreduce": case["allreduce"], "grads": case["grads"],
                       "update": case["update"], "timed": i >= args.warmup, "block": len(block),
                       "total_ms": wall, "features_ms": feats,
                       "features_mean_ms": statistics.mean(feats.values()) if feats else 0.0,
                       "loss": st.loss_sum / batch.weight_total, "grad_norm": st.grad_norm}
                rec["drafter_ms"] = rec["total_ms"] - rec["features_mean_ms"]
                if cuda:
                    rec["peak_gb"] = {str(d): torch.cuda.max_memory_allocated(d) / 1e9 for d in dict.fromkeys(devices)}
                res["steps"].append(rec)
                if i == 0:
                    res["first_step_s"] = round(rec["total_ms"] / 1e3, 1)
                emit(f"step {i + 1}/{args.warmup + args.steps} [{case['name']}]{'' if rec['timed'] else ' (warm-up)'}: "
                     f"{rec['total_ms'] / B:.1f} ms/sample (target {rec['features_mean_ms'] / B:.1f}, "
                     f"drafter {rec['drafter_ms'] / B:.1f}; a block of {len(block)}), loss {rec['loss']:.4f}, "
                     f"grad norm {st.grad_norm:.3f}"
                     + (f", peak {max(rec['peak_gb'].values()):.1f} GB" if cuda else ""))
            summarise(res)
            if rank == 0:
                write(args.out, res)
            # every rank stops at the same step (RankEngine.agree: any rank's flag)
            if engine.agree(time.perf_counter() - start > args.deadline) and block[-1] + 1 < args.warmup + args.steps:
                res["stopped_early"] = f"--deadline {args.deadline:g} s reached after step {block[-1] + 1}"
                emit(res["stopped_early"])
                break
        if args.profile or args.trace:  # on the CPU the tables are empty (CUDA only): the code path still runs
            use(args.cases[0])
            res["profile"] = profile_steps(engine, batches, args, sync, record=rank == 0)
        if rank == 0 and (args.profile or args.trace):
            emit("profile (CUDA kernel ms per sample, 2 steps of " + args.cases[0]["name"] + "): "
                 + json.dumps(res["profile"]["per_sample_ms"]))
            if "gaps" in res["profile"]:
                from gpu_idle_gaps import render

                emit("where the GPU sat idle in those 2 steps:\n" + render(res["profile"]["gaps"]))
            write(args.out, res)
        # Every worker applied the same updates: their weights must be bit-identical (raises if not).
        engine.check_replicas(len(res["steps"]))
        res["replicas_identical"] = True
        emit(f"replica weights bit-identical after {len(res['steps'])} steps: {engine.size} replica(s)")
    finally:
        engine.close()
    res["ok"] = bool(res.get("timed_steps"))


def blocks(args) -> list[list[int]]:
    """The steps in the order they run: step 0 alone (it compiles), then runs of --case-steps steps
    of one case each (case_at), each timed as a whole: the host queues a block's steps as the
    trainer's loop does (ThreadEngine.step returns before the devices have run the step) and the
    block ends with every device synchronised."""
    n = args.warmup + args.steps
    out = [[0]]
    for i in range(1, n):
        if len(out) == 1 or i // args.case_steps != out[-1][-1] // args.case_steps:
            out.append([])
        out[-1].append(i)
    return out


def main(argv=None) -> int:
    from trainer.run.flags import add_trainer_options   # torch-free

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the trainer's tiny target on the CPU, end to end")
    ap.add_argument("--policy", default="inductor", help="compile policy (trainer/policies.py); default inductor")
    ap.add_argument("--target-mode", default="truncated",
                    help=f"one of {', '.join(MODES)}, or several comma-separated, alternated step by step")
    ap.add_argument("--allreduce", default="auto",
                    help="the workers' gradient sum: auto, copy or nccl (ThreadEngine.allreduce); several "
                         "comma-separated alternate step by step")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs (ignored with --tiny)")
    ap.add_argument("--workers", type=int, default=0,
                    help="worker threads (ranks with --topology processes), worker i on GPU i mod --gpus; "
                         "default --gpus")
    ap.add_argument("--topology", default="threads", choices=("threads", "processes"),
                    help="threads: ThreadEngine in this process (default); processes: one torchrun rank per worker, "
                         "DDP, as --topology processes trains (this command starts torchrun)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first compiles)")
    ap.add_argument("--grads", default="auto",
                    help="where gradients live: flat (FlatGrads), own (each parameter's: ThreadEngine.grads auto, "
                         "which still uses FlatGrads where the copy-sum needs them) or auto; several comma-separated "
                         "alternate")
    ap.add_argument("--update", default="auto",
                    help="the optimizer update: auto (as the trainer), fused or compiled; several "
                         "comma-separated alternate")
    ap.add_argument("--lookahead", default="on",
                    help="on (as the trainer): each step also makes the next step's target features, during the "
                         "gradient sum; off: each step its own; on,off alternates (see --case-steps)")
    ap.add_argument("--host", default="ahead",
                    help="ahead (as the trainer): the host queues the next step before the devices finish this "
                         "one; sync: the host waits for each step's results first; ahead,sync alternates")
    ap.add_argument("--case-steps", type=int, default=8,
                    help="steps in a row per case, timed as one block (default 8): within a block the host runs "
                         "ahead, and a look-ahead step prefetches only for a next step of its own block")
    ap.add_argument("--profile", action="store_true",
                    help="after timing, profile 2 steps (GPU only): kernel ms by category")
    ap.add_argument("--trace", action="store_true",
                    help="with the profile, keep its timeline (OUT/trace.json.gz) and attribute the GPU's idle gaps")
    ap.add_argument("--deadline", type=float, default=1e9, help="stop timing after this many seconds of steps")
    ap.add_argument("--warmup-timeout", type=float, default=900.0, help="seconds a worker may take to build + compile")
    # the trainer's GPU choices and precision, its own options (help, defaults, values), for an A/B of one of them
    add_trainer_options(ap, ("fp32_wgrad", "flex_tiles", "ce_rows", "ce_kernel", "precision", "fp8_emulate"))
    ap.add_argument("--out", default="out/train_step_bench")
    ap.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)  # tests: the 8B code path on the CPU
    args = ap.parse_args(argv)
    args.shape = "tiny" if args.tiny else "8b"
    args.modes = list(dict.fromkeys(args.target_mode.split(",")))
    args.allreduce = list(dict.fromkeys(args.allreduce.split(",")))
    args.grads = list(dict.fromkeys(args.grads.split(",")))
    args.update = list(dict.fromkeys(args.update.split(",")))
    args.lookahead = list(dict.fromkeys(args.lookahead.split(",")))
    args.host = list(dict.fromkeys(args.host.split(",")))
    bad = ([m for m in args.modes if m not in MODES] + [a for a in args.allreduce if a not in ("auto", "copy", "nccl")]
           + [g for g in args.grads if g not in GRADS] + [u for u in args.update if u not in UPDATES]
           + [x for x in args.lookahead if x not in ("on", "off")]
           + [x for x in args.host if x not in ("ahead", "sync")])
    if bad:
        ap.error(f"--target-mode/--allreduce/--grads/--update/--lookahead/--host {bad[0]!r}: choose from "
                 f"{', '.join(MODES)} / auto, copy, nccl / {', '.join(GRADS)} / {', '.join(UPDATES)} / "
                 "on, off / ahead, sync")
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
    args.cases = cases(mode=args.modes, allreduce=args.allreduce, grads=args.grads, update=args.update,
                       lookahead=args.lookahead, host=args.host)
    if args.case_steps < 1:
        ap.error("--case-steps must be at least 1")
    # the first step compiles; each case runs once untimed (a whole block of it); blocks are timed
    # or not as a whole
    k = args.case_steps
    args.warmup = -(-max(len(args.cases) * k, args.warmup) // k) * k

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
            write(args.out, res)
    if rank == 0:
        print("\n" + summary(res), flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    from trainer.exits import exit_process  # a torchrun rank ends without finalization

    exit_process(main())
