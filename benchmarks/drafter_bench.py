"""Drafter training-step benchmark: fwd + bwd + AdamW per sample, in a worker thread.

    PYTHONUNBUFFERED=1 python3 benchmarks/drafter_bench.py --out DIR              # GPU, the 8B shape
    .venv/bin/python benchmarks/drafter_bench.py --tiny --out /tmp/bench          # CPU, end to end

A Qwen3-8B-shaped drafter (5 layers, hidden 4096, intermediate 12288, 32 q / 8 kv heads, head dim 128,
vocab 151936) on synthetic target features: batch 2, context 768, 256 anchors x block 16. Each variant
(POLICY/ATTENTION/LOSS[@SHAPE]) runs in its own process, under a time limit, with the step in a
threading.Thread that calls policies.configure_thread and torch.cuda.set_device, as the trainer's
workers do: the trainer's step (zero_grad, autocast bf16 forward, backward of loss / batch weight, then
with --update trainer (the default) the trainer's own update, trainer.engine.step.apply_update: clip
1.0 + AdamW as one compiled function on a GPU under a compiled policy (trainer/engine/adamw.py), else
fused AdamW with the clip folded in; --update clip+fused: clip_grad_norm_ then torch's fused AdamW, what
this benchmark ran until 2026-12-01). Reports ms/sample (median step / batch), TFLOP/s and MFU (of 989
TFLOP/s bf16) by two counts, peak memory of the steady-state steps, the first step's seconds (compile
included) and the step-0 loss and gradient norm (same seed, weights and batch in every variant: the fast
paths must give the dense paths' numbers). The policy `fp32` (variant fp32/sdpa/dense) is the reference
for those numbers: eager, no autocast, no TF32, on the same bf16-valued weights and features; with it in
the list the summary also gives each variant's distance from it, to set against the bf16 dense path's
own. Writes DIR/results.json, DIR/summary.md and DIR/<variant>.log; prints the summary last.

FLOP counts (trainer.model.drafter): "dense" = flops_per_sample, SpecForge-style (every matmul 3x, dense
attention over all S + Tq keys, lm_head included with a weight gradient): 44.5 TFLOP/sample here.
"needed" = flops_needed: lm_head frozen (2x) and skipped on the anchor position, attention over
the pairs the mask allows only, the fc without an input gradient, the first layer's q/k/v on the
distinct rows, the last layer's o_proj and MLP without the anchor rows: ~33.3 TFLOP/sample here
(33.5 before the last one, 34.2 before the two before it, 34.9 before the anchor rows were skipped
at the head).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16, datasheet

SHAPES = {
    # the shape
    "8b": dict(hidden=4096, inter=12288, layers=5, heads=32, kv=8, hd=128, vocab=151936,
               batch=2, seq=768, anchors=256, block=16),
    # for the CUDA-graph policies, whose failure does not depend on size
    "small": dict(hidden=512, inter=1024, layers=2, heads=8, kv=2, hd=64, vocab=8192,
                  batch=2, seq=256, anchors=32, block=16),
    # CPU smoke test of the whole harness
    "tiny": dict(hidden=64, inter=128, layers=2, heads=4, kv=2, hd=16, vocab=512,
                 batch=2, seq=128, anchors=8, block=16),
}

GPU_VARIANTS = [
    "inductor/flex/chunked",          # the goal
    "inductor/sdpa/dense",            # the floor (docs/benchmarks.md: 81.2 ms/sample)
    "eager/sdpa/dense",
    "fp32/sdpa/dense",                # the reference for the step-0 numbers (~30 s at 0.8 s/sample)
    "eager/flex/chunked",             # flex call and CE core compiled on their own
    "inductor/sdpa/chunked",          # ablations: one lever at a time
    "inductor/flex/dense",
    "max-autotune-no-cudagraphs/flex/chunked",
    "reduce-overhead/flex/chunked@small",
    "cudagraphs-no-trees/flex/chunked@small",
]
CPU_VARIANTS = ["eager/sdpa/dense", "eager/sdpa/chunked", "inductor/sdpa/chunked", "eager/flex/chunked",
                "reduce-overhead/sdpa/dense"]


# The policy of the reference variant (fp32/sdpa/dense): eager with no autocast and no TF32.
REFERENCE = "fp32"


def is_reference(variant: str) -> bool:
    return variant.split("/")[0] == REFERENCE


def parse_variant(v: str, default_shape: str) -> tuple[str, str, str, str]:
    spec, _, shape = v.partition("@")
    policy, att, loss = spec.split("/")
    return policy, att, loss, shape or default_shape


# ----------------------------------------------------------------------------------------------
# one variant, in its own process


def _kernel_table(prof, top: int = 25) -> dict:
    """CUDA kernel time by category and the top kernels, from a torch.profiler run."""
    from torch.autograd import DeviceType

    rows = []
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        if "#" in e.key or e.key.startswith("ProfilerStep"):
            continue  # record_function ranges mirrored on the GPU timeline (Optimizer.step#AdamW.step): not kernels
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        rows.append((e.key, t / 1e3, e.count))
    cats: dict[str, float] = {}
    for name, ms, _ in rows:
        n = name.lower()
        if "flex" in n:
            cat = "flex attention"
        elif any(s in n for s in ("fmha", "attention", "flash", "efficient")):
            cat = "sdpa attention"
        elif any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "triton_tem_fused_mm",
                                  "_mm_", "addmm", "bmm")):
            cat = "matmul"
        elif "adam" in n or "multi_tensor" in n:
            cat = "optimizer"
        elif n.startswith("triton_"):
            cat = "inductor fused (pointwise/reduction)"
        else:
            cat = "other (eager elementwise, copies)"
        cats[cat] = cats.get(cat, 0.0) + ms
    rows.sort(key=lambda r: -r[1])
    return {"by_category_ms": {k: round(v, 2) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "total_ms": round(sum(r[1] for r in rows), 2),
            "top": [{"kernel": k[:140], "ms": round(ms, 3), "calls": c} for k, ms, c in rows[:top]]}


def run_one(args) -> dict:
    import torch

    from trainer import policies
    from trainer.model import attention, masks
    from trainer.model.draft_loss import DraftLoss
    from trainer.model.drafter import Drafter, DrafterConfig, flops_needed, flops_per_sample

    from trainer.model import choices

    choices.configure(fp32_wgrad=args.fp32_wgrad == "on", flex_tiles=args.flex_tiles, ce_rows=args.ce_rows,
                      ce_kernel_on=args.ce_kernel == "on")  # the trainer's --fp32-wgrad ... options, for A/Bs
    from trainer.model import fp8

    policy, att, loss, shape = parse_variant(args.one, "tiny" if args.tiny else "8b")
    sh = SHAPES[shape]
    cuda = torch.cuda.is_available() and not args.tiny
    # "fp32": the reference for the step-0 numbers, eager with no autocast and no TF32 (full fp32
    # matmuls), on the same bf16-valued head weights and features upcast exactly
    reference = policy == REFERENCE
    if reference:
        policy = "eager"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    B, S, N, Bs = sh["batch"], sh["seq"], sh["anchors"], sh["block"]
    cfg = DrafterConfig(hidden_size=sh["hidden"], vocab_size=sh["vocab"], mask_token_id=sh["vocab"] - 1,
                        num_layers=sh["layers"], num_heads=sh["heads"], num_kv_heads=sh["kv"],
                        head_dim=sh["hd"], intermediate_size=sh["inter"], block_size=Bs)
    res: dict = {"variant": args.one, "policy": policy, "attention": att, "loss": loss, "shape": shape,
                 "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
                 "batch": B, "ok": False, "precision": "bf16" if policy == REFERENCE else args.precision}

    # Synthetic batches (CPU generator: the same in every variant), rotated so anchors change per step.
    g = torch.Generator().manual_seed(1234)
    head_dtype = torch.bfloat16 if cuda else torch.float32
    pw = masks.position_weights(Bs, masks.default_gamma(Bs))
    batches, pairs = [], []
    for _ in range(4):
        ids = torch.randint(0, cfg.vocab_size - 1, (B, S), generator=g)
        lm = torch.ones(B, S)
        picked = [masks.sample_anchors(lm[b], S, Bs, N, g) for b in range(B)]
        anchors = torch.stack([a for a, _ in picked])
        valid = torch.stack([v for _, v in picked])
        _, w = masks.block_labels(ids, lm, anchors, valid, pw)
        feats = torch.randn(B, S, cfg.num_target_layers * cfg.hidden_size, generator=g).to(head_dtype)
        batches.append(([t.to(dev) for t in (feats, ids, lm, anchors, valid)], float(w.sum())))
        pairs.append(attention.attended_pairs(anchors, S, Bs) / B)
    Tq = N * Bs
    res["flops_dense"] = flops_per_sample(cfg, S, Tq)
    res["flops_needed"] = flops_needed(cfg, S, Tq, attended_pairs=statistics.mean(pairs))
    res["keys_per_query"] = round(statistics.mean(pairs) / Tq, 1)
    res["attention_tiles_computed"] = round(attention.sparse_mask(batches[0][0][3], S, Bs).density(), 4) \
        if attention.FLEX else None

    def worker():
        policies.configure_thread(1)
        if cuda:
            torch.cuda.set_device(dev)
        torch.manual_seed(0)
        with torch.device(dev):
            drafter = Drafter(cfg)
            embed = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
            lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
            norm = torch.ones(cfg.hidden_size)
        up = (lambda t: t.to(head_dtype).float()) if reference else (lambda t: t.to(head_dtype))
        drafter.borrow_target_head(up(embed), up(norm), up(lm_head))
        if res["precision"] != "bf16":  # the trainer's --precision (trainer/model/fp8.py)
            fp8.use(drafter, args.precision, args.fp8_emulate)
        module = DraftLoss(drafter, pw, attention=att, loss=loss).to(dev)
        res["backends"] = module.backends(dev)
        fn = policies.compile_module(module, policy, n_devices=1)
        params = [p for _, p in drafter.trainable_parameters()]
        res["trainable_params"] = sum(p.numel() for p in params)
        opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0,
                                **({"fused": True} if cuda else {}))
        res["update"] = args.update
        if args.update == "trainer":  # as build_replica + apply_update do it
            from types import SimpleNamespace

            from trainer.engine.adamw import CompiledUpdate
            from trainer.engine.step import apply_update

            replica = SimpleNamespace(index=0, params=params, optimizer=opt, update=CompiledUpdate(opt, params)
                                      if policies.compiled_part("auto", policy, torch.device(dev)) else None)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda and not reference else \
            torch.autocast(dev.type, enabled=False)

        def step(i):
            tensors, wt = batches[i % len(batches)]
            if reference:
                tensors = [tensors[0].float(), *tensors[1:]]
            policies.step_begin(policy)
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss_sum, _, _ = fn(*tensors)
            (loss_sum / wt).backward()
            if args.update == "trainer":
                gn = apply_update(replica, 1e-5, 1.0, i)
            else:
                gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
            return float(loss_sum.detach()) / wt, float(gn)

        sync = torch.cuda.synchronize if cuda else (lambda: None)
        print(f"[{args.one}] model built ({res['trainable_params'] / 1e9:.2f} B trainable), backends "
              f"{res['backends']}; first step (compiles under a policy)...", flush=True)
        t0 = time.perf_counter()
        res["loss0"], res["gradnorm0"] = step(0)
        sync()
        res["first_step_s"] = round(time.perf_counter() - t0, 2)
        print(f"[{args.one}] first step {res['first_step_s']} s, loss {res['loss0']:.5f}, "
              f"grad norm {res['gradnorm0']:.5f}", flush=True)
        for i in range(1, args.warmup):
            step(i)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        times, losses = [], []
        for i in range(args.steps):
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                losses.append(step(i)[0])
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1))
            else:
                t = time.perf_counter()
                losses.append(step(i)[0])
                times.append((time.perf_counter() - t) * 1e3)
        res["step_ms"] = [round(t, 2) for t in times]
        res["step_losses"] = losses  # the timed steps' losses: they follow from the updates before them
        res["peak_gb"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 2) if cuda else None
        ms = statistics.median(times) / B
        res["ms_per_sample"] = round(ms, 2)
        for name in ("dense", "needed"):
            tf = res[f"flops_{name}"] / (ms / 1e3) / 1e12
            res[f"tflops_{name}"] = round(tf, 1)
            res[f"mfu_{name}"] = round(tf / PEAK_TFLOPS, 4)
        print(f"[{args.one}] {ms:.2f} ms/sample (steps {res['step_ms']}), peak {res['peak_gb']} GB", flush=True)
        if args.one in args.profile and cuda:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for i in range(2):
                    step(i)
                sync()
            res["profile"] = _kernel_table(prof, top=args.profile_top)
            res["profile"]["steps"] = 2
            print(json.dumps(res["profile"], indent=1), flush=True)
        res["ok"] = True

    def guarded():
        try:
            worker()
        except BaseException as e:  # noqa: BLE001 - recorded, the parent names the signature
            res["error"] = f"{type(e).__name__}: {e}"[-2000:]
            traceback.print_exc()

    th = threading.Thread(target=guarded, name=f"bench-{policy}")
    th.start()
    th.join()
    return res


# ----------------------------------------------------------------------------------------------
# the driver: one process per variant, each under a time limit


def _run_child(variant: str, args, out: Path, limit: float) -> dict:
    from trainer import signatures

    log = out / (variant.replace("/", "_").replace("@", "_at_") + ".log")
    js = out / (log.stem + ".json")
    cmd = [sys.executable, __file__, "--one", variant, "--json", str(js), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--update", args.update] + (["--tiny"] if args.tiny else []) + \
          ["--profile", variant if variant in args.profile else "", "--profile-top", str(args.profile_top),
           "--fp32-wgrad", args.fp32_wgrad, "--flex-tiles", args.flex_tiles, "--ce-rows", str(args.ce_rows),
           "--ce-kernel", args.ce_kernel, "--precision", args.precision] + ["--fp8-emulate"] * args.fp8_emulate
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and its compile workers, nothing else
            proc.wait()
            rc = None
    text = log.read_text(errors="replace")
    res = json.loads(js.read_text()) if js.exists() else {"variant": variant, "ok": False}
    # One log for all variants: the device tool brings back only a few files per call.
    with open(out / "bench.log", "a") as f:
        f.write(f"\n===== {variant}\n{text}")
    log.unlink()
    js.unlink(missing_ok=True)
    res["wall_s"] = round(time.time() - t0, 1)
    res["exit"] = rc
    if rc is None:
        res["error"] = f"timed out after {limit:.0f} s (time limit of this variant)"
    elif rc != 0 and "error" not in res:
        res["error"] = f"exit {rc}: " + text[-600:]
    if not res.get("ok"):
        res["signature"] = signatures.classify(text, rc)
    return res


def _fmt_row(r: dict, ref: dict | None, fp32: dict | None = None) -> str:
    name = r["variant"]
    if not r.get("ok"):
        why = r.get("signature") or (r.get("error") or "failed").splitlines()[0][:90]
        return f"| {name} | failed: {why} | | | | | | |" + (" |" if fp32 else "")
    def diff(ref):
        if not (ref and ref is not r and ref.get("ok") and ref.get("shape") == r.get("shape")):
            return ""
        dl = abs(r["loss0"] - ref["loss0"]) / abs(ref["loss0"])
        dg = abs(r["gradnorm0"] - ref["gradnorm0"]) / abs(ref["gradnorm0"])
        return f"{dl:.1e} / {dg:.1e}"

    num = diff(ref) + (f" | {diff(fp32)}" if fp32 else "")
    shape = "" if r.get("shape") in ("8b", "tiny") else f" ({r['shape']} shape)"
    peak = "-" if r.get("peak_gb") is None else f"{r['peak_gb']:.1f}"
    return (f"| {name}{shape} | {r['ms_per_sample']:.1f} | {r['tflops_needed']:.0f} / {r['tflops_dense']:.0f} | "
            f"{100 * r['mfu_needed']:.1f}% / {100 * r['mfu_dense']:.1f}% | {peak} | {r['first_step_s']:.1f} | "
            f"{r['loss0']:.5f} | {num} |")


def summarize(results: list[dict]) -> str:
    ref = next((r for r in results if r.get("ok") and r.get("attention") == "sdpa" and r.get("loss") == "dense"
                and r.get("shape") in ("8b", "tiny") and not is_reference(r["variant"])), None)
    fp32 = next((r for r in results if r.get("ok") and is_reference(r["variant"])
                 and r.get("shape") in ("8b", "tiny")), None)
    first = next((r for r in results if "flops_dense" in r and r.get("shape") in ("8b", "tiny")), {})
    lines = [
        f"torch {first.get('torch', '?')}, {first.get('device', '?')}; "
        f"FLOP/sample: dense {first.get('flops_dense', 0) / 1e12:.1f} T (flops_per_sample), "
        f"needed {first.get('flops_needed', 0) / 1e12:.1f} T (flops_needed, {first.get('keys_per_query')} keys/query); "
        f"flex computes {first.get('attention_tiles_computed')} of the 128x128 attention tiles; "
        f"precision {first.get('precision', 'bf16')}",
        "",
        "| variant (policy/attention/loss) | ms/sample | TFLOP/s needed / dense | MFU needed / dense | "
        "peak GB | first step s | step-0 loss | vs dense: loss / grad-norm rel. diff |"
        + (" vs fp32 (the reference): loss / grad-norm |" if fp32 else ""),
        "| --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if fp32 else ""),
    ]
    lines += [_fmt_row(r, ref, fp32) for r in results]
    return "\n".join(lines)


def main(argv=None) -> int:
    from trainer.run.flags import add_trainer_options   # torch-free

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU-sized shape, CPU device")
    ap.add_argument("--variants", help="comma-separated POLICY/ATTENTION/LOSS[@SHAPE]; default: all")
    ap.add_argument("--out", default="out/drafter_bench")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds for the whole run")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds per variant (a compile policy with flex needed more than 69 s on the H200)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--update", default="trainer", choices=("trainer", "clip+fused"),
                    help="the optimizer update: the trainer's (apply_update; default) or clip_grad_norm_ + fused AdamW")
    ap.add_argument("--profile", default="inductor/flex/chunked", help="variants to profile (comma-separated)")
    ap.add_argument("--profile-top", type=int, default=25,
                    help="kernels a profile lists by name (the rest only in its categories)")
    # the trainer's GPU choices (trainer/model/choices.py) and precision, its own options (help, defaults, values),
    # for an A/B of one of them; --precision is not applied to the fp32 reference
    add_trainer_options(ap, ("fp32_wgrad", "flex_tiles", "ce_rows", "ce_kernel", "precision", "fp8_emulate"))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.profile = set(filter(None, args.profile.split(",")))

    if args.one:
        res = run_one(args)
        Path(args.json).write_text(json.dumps(res, indent=1))
        return 0 if res["ok"] else 1

    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.variants:
        variants = args.variants.split(",")
    else:
        import torch

        variants = GPU_VARIANTS if torch.cuda.is_available() and not args.tiny else CPU_VARIANTS
    results = []
    for v in variants:
        left = args.deadline - (time.time() - start) - 3
        if left < 20:
            results.append({"variant": v, "ok": False, "error": "not run: out of time (--deadline)"})
            continue
        print(f"== {v} (limit {min(args.timeout, left):.0f} s)", flush=True)
        r = _run_child(v, args, out, min(args.timeout, left))
        print(f"   -> {'ok ' + str(r.get('ms_per_sample')) + ' ms/sample' if r.get('ok') else r.get('error', '')[:200]}"
              f" [{r['wall_s']} s]", flush=True)
        results.append(r)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    table = summarize(results)
    (out / "summary.md").write_text(table + "\n")
    for r in results:
        if r.get("profile"):
            print(f"\nprofile of {r['variant']} (CUDA kernel ms over {r['profile']['steps']} steps): "
                  f"{json.dumps(r['profile']['by_category_ms'])}, total {r['profile']['total_ms']}")
    print("\n" + table)
    try:
        from plot_drafter import plot

        print(f"plot: {plot(results, out / 'results.png')}")
    except ImportError:
        print("plot: skipped (no matplotlib here; run benchmarks/plot_drafter.py on results.json)")
    except ValueError as e:
        print(f"plot: skipped ({e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
