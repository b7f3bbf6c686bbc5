"""One probe case, in its own process: `python -m trainer.probe --case POLICY:TOPOLOGY:N`.

Trains the drafter-shaped block (probe_block.py) for a few real steps under one compile policy,
in the main thread (`main`) or in N worker threads (`threads`), and checks it against an eager
run of the same seed. The result is ONE stdout line, CASE_MARK + JSON, which the parent
(probe.py) picks out of the case's merged output.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import threading
import time
import traceback

import torch

from trainer import policies
from trainer.probe_block import CPU_CONFIG, GPU_CONFIG, SEED, BlockConfig, ProbeDrafter, make_batches

CASE_MARK = "@@dflash-probe-case@@ "

_init_lock = threading.Lock()   # replicas draw their initial weights from the process-wide RNG
_print_lock = threading.Lock()


def _replica(policy: str, device: str, n_devices: int, c: BlockConfig, amp, batches,
             warmup: int, barrier: threading.Barrier | None) -> dict:
    """Build, compile and train one replica; in `threads` this runs inside its worker thread."""
    policies.configure_thread(n_devices)          # thread-local config from 2.12 (pytorch#186537)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))  # no device guard in non-tree cudagraphs
    with _init_lock:
        torch.manual_seed(SEED)
        model = ProbeDrafter(c, amp).to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, **({"fused": True} if device.startswith("cuda") else {}))
    fn = policies.compile_module(model, policy, n_devices=n_devices)
    data = [tuple(t.to(device) for t in b) for b in batches]
    losses, times = [], []
    if barrier is not None:
        barrier.wait()                            # compile and warm up concurrently, as a trainer does
    for i, batch in enumerate(data):
        if i == warmup and barrier is not None:
            barrier.wait()                        # time the steady state of all threads together
        t0 = time.perf_counter()
        policies.step_begin(policy)
        loss = fn(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())                # .item() waits for the device
        times.append((time.perf_counter() - t0) * 1000.0)
    checksum = sum(float(p.detach().double().sum()) for p in trainable)
    return {"losses": losses, "times_ms": times,
            "checksum": checksum if math.isfinite(checksum) else None}


def run_case(policy: str, topology: str, n_threads: int, steps: int, warmup: int,
             device_kind: str) -> dict:
    cuda = device_kind == "cuda"
    n_gpus = torch.cuda.device_count() if cuda else 0
    c = GPU_CONFIG if cuda else CPU_CONFIG
    amp = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else None
    batches = make_batches(c, warmup + steps)
    dev = (lambda i: f"cuda:{i % n_gpus}") if cuda else (lambda i: "cpu")
    # one cache entry per replica at worst (device index and module identity are guarded)
    n_devices = n_threads if topology == "threads" else 1
    if not cuda:
        policies.share_cpu(n_devices)

    ref = _replica("eager", dev(0), 1, c, amp, batches, warmup, None)     # the numerics yardstick
    results: list[dict | None] = []
    errors: list[str] = []
    if topology == "main":
        results.append(_replica(policy, dev(0), 1, c, amp, batches, warmup, None))
    else:
        barrier = threading.Barrier(n_threads)
        results = [None] * n_threads

        def worker(i: int) -> None:
            try:
                results[i] = _replica(policy, dev(i), n_devices, c, amp, batches, warmup, barrier)
            except threading.BrokenBarrierError:
                errors.append(f"thread {i}: stopped, another thread failed")
            except BaseException as e:  # noqa: BLE001 - reported, with its traceback, to the parent
                barrier.abort()
                errors.append(f"thread {i}: {_one_line(e)}")
                with _print_lock:
                    sys.stderr.write(f"[thread {i}] failed:\n{traceback.format_exc()}")
                    sys.stderr.flush()

        threads = [threading.Thread(target=worker, args=(i,), name=f"probe-{i}") for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors or any(r is None for r in results):
        first = next((e for e in errors if "another thread failed" not in e), errors[0] if errors else "failed")
        return {"ok": False, "error": first}

    # fp32 on CPU: compiled and eager agree to ~1e-6; bf16 autocast on GPU: to ~1e-2
    tol_abs, tol_rel = (0.05, 0.02) if amp is not None else (1e-3, 1e-3)
    pairs = [(a, b) for r in results for a, b in zip(r["losses"], ref["losses"])]
    finite = all(math.isfinite(a) and math.isfinite(b) for a, b in pairs)
    diff = max(abs(a - b) for a, b in pairs) if finite else None      # NaN is not JSON
    agrees = finite and all(abs(a - b) <= tol_abs + tol_rel * abs(b) for a, b in pairs)
    timed = [t for r in results for t in r["times_ms"][warmup:]]
    return {
        "ok": True, "error": None,
        "step_ms": round(statistics.median(timed), 3),
        "step_ms_threads": [round(statistics.median(r["times_ms"][warmup:]), 3) for r in results],
        "first_step_s": round(max(r["times_ms"][0] for r in results) / 1000.0, 3),
        "eager_step_ms": round(statistics.median(ref["times_ms"][warmup:]), 3),
        "max_abs_diff": diff, "agrees": agrees,
        "tolerance": f"|loss - eager| <= {tol_abs} + {tol_rel} * |eager| per step",
        "losses": [[x if math.isfinite(x) else None for x in r["losses"]] for r in results],
        "eager_losses": [x if math.isfinite(x) else None for x in ref["losses"]],
        "checksums": [r["checksum"] for r in results], "eager_checksum": ref["checksum"],
    }


def _one_line(e: BaseException) -> str:
    first = str(e).strip().splitlines()[:1]
    return f"{type(e).__name__}: {first[0]}" if first else type(e).__name__


def case_main(args) -> int:
    """`--case POLICY:TOPOLOGY:N`: run one case, print its result line, exit without teardown."""
    policy, topology, n = args.case.split(":")
    try:
        out = run_case(policy, topology, int(n), args.steps, args.warmup, args.device)
    except BaseException as e:  # noqa: BLE001 - the main-thread failure is the case's result
        traceback.print_exc()
        out = {"ok": False, "error": _one_line(e)}
    sys.stderr.flush()
    sys.stdout.write(CASE_MARK + json.dumps(out) + "\n")
    sys.stdout.flush()
    # Skip interpreter teardown: the result is out, and a crash while freeing CUDA graphs or
    # compile workers after it would only blur what the case measured.
    os._exit(0 if out["ok"] else 1)
