"""The probe: which compile policy works, and is fastest, for threaded training on THIS torch build.

    python -m trainer.probe [--threads N] [--steps K] [--timeout S] [--workdir DIR]
                            [--expect JSON] [--policies a,b] [--signatures PATH]

Runs on the target with only torch (+ PyYAML for the signature catalog). Prints ONE JSON document
on stdout; one progress line per case on stderr. It reports the build (python, torch, CUDA, cuDNN,
NCCL, Triton, driver, GPUs, bf16) against an optional expectation, the options of every compile
mode this torch knows, and the policy x topology matrix: each case trains a small drafter-shaped
block for a few real steps (forward, backward, AdamW) in its OWN subprocess with a timeout, so a
segfault or a hang loses only that case. Topology `main` runs in the main thread; `threads` runs
N worker threads (one per GPU, or sharing GPU 0 / the CPU), each with its own replica from the same
seed, configured inside the thread, compiling and warming up concurrently as the trainer does.
Each case is checked against an eager run of the same seed. The choice: the fastest policy that
passed in `threads` and agreed with eager (eager is the fallback); with --workdir it is saved
atomically in WORKDIR/probe.json, which `--compile-policy auto` reads (policies.resolve).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from trainer import policies

TOPOLOGIES = ("main", "threads")
CASE_MARK = "@@dflash-probe-case@@ "
TAIL_LINES = 20
HISTORY_KEEP = 20
SEED = 1234
# Two policies within this fraction of each other's step time are a tie on a noisy machine:
# the simpler one (earlier in POLICY_NAMES) wins.
TIE_MARGIN = 0.03
COST_ORDER = ("eager", "inductor", "reduce-overhead", "cudagraphs-no-trees", "max-autotune-no-cudagraphs")
KNOWN_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "lite")


# ---- the drafter-shaped block (field notes 5; self-contained, the trainer's model may change) ----

@dataclass(frozen=True)
class BlockConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    taps: int          # target layers whose hidden states condition the drafter
    batch: int
    context: int       # Tc: target tokens
    blocks: int        # anchors per sequence
    block_size: int
    gamma: float       # loss decay over block positions


CPU_CONFIG = BlockConfig(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256,
                         layers=2, taps=3, batch=2, context=32, blocks=2, block_size=8, gamma=4.0)
GPU_CONFIG = BlockConfig(hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=2816,
                         vocab=32768, layers=2, taps=5, batch=4, context=512, blocks=16,
                         block_size=16, gamma=7.0)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight.to(x.dtype)


def _rope(x, cos, sin):  # x (B, h, T, d), cos/sin (B, 1, T, d)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Layer(nn.Module):
    """Qwen3-style: q/k norm, RoPE, GQA; keys/values over [context; block], queries from the block."""

    def __init__(self, c: BlockConfig):
        super().__init__()
        self.c = c
        self.attn_norm, self.mlp_norm = RMSNorm(c.hidden), RMSNorm(c.hidden)
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        self.q_norm, self.k_norm = RMSNorm(c.head_dim), RMSNorm(c.head_dim)
        self.gate = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x, ctx, mask, cos_q, sin_q, cos_k, sin_k):
        c = self.c
        B, Q, _ = x.shape
        h = self.attn_norm(x)
        kv = torch.cat([ctx, h], dim=1)                                          # (B, Tc+Q, H)
        T = kv.shape[1]
        q = self.q_norm(self.q_proj(h).view(B, Q, c.heads, c.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv).view(B, T, c.kv_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(kv).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rope(q, cos_q, sin_q), _rope(k, cos_k, sin_k)
        rep = c.heads // c.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, heads, T, d)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)             # (B, heads, Q, d)
        x = x + self.o_proj(o.transpose(1, 2).reshape(B, Q, c.heads * c.head_dim))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class ProbeDrafter(nn.Module):
    """Frozen target embedding/norm/lm_head; trainable context projection and layers; weighted CE."""

    def __init__(self, c: BlockConfig, amp_dtype: torch.dtype | None):
        super().__init__()
        self.amp_dtype = amp_dtype
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.fc = nn.Linear(c.taps * c.hidden, c.hidden, bias=False)
        self.ctx_norm = RMSNorm(c.hidden)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        for m in (self.embed, self.norm, self.lm_head):
            m.requires_grad_(False)

    def forward(self, ctx_hidden, block_ids, mask, cos_q, sin_q, cos_k, sin_k, labels, weights):
        if self.amp_dtype is None:
            logits = self._logits(ctx_hidden, block_ids, mask, cos_q, sin_q, cos_k, sin_k)
        else:
            with torch.autocast(device_type="cuda", dtype=self.amp_dtype):   # bf16 only on GPU
                logits = self._logits(ctx_hidden, block_ids, mask, cos_q, sin_q, cos_k, sin_k)
        ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        w = weights.flatten()
        return (ce * w).sum() / w.sum()

    def _logits(self, ctx_hidden, block_ids, mask, cos_q, sin_q, cos_k, sin_k):
        ctx = self.ctx_norm(self.fc(ctx_hidden))                                 # (B, Tc, H)
        x = self.embed(block_ids)                                                # (B, Q, H)
        for layer in self.layers:
            x = layer(x, ctx, mask, cos_q, sin_q, cos_k, sin_k)
        return self.lm_head(self.norm(x))                                        # (B, Q, V)


def make_batches(c: BlockConfig, n: int, seed: int = SEED) -> list[tuple[torch.Tensor, ...]]:
    """n CPU batches: random target features/tokens, anchors, the DFlash mask (a block sees context
    strictly before its anchor and itself), labels token[anchor+k], weights exp(-(k-1)/gamma)."""
    g = torch.Generator().manual_seed(seed)
    B, C, nb, bs, d = c.batch, c.context, c.blocks, c.block_size, c.head_dim
    Q = nb * bs
    k = torch.arange(bs)
    w_block = torch.where(k > 0, torch.exp(-(k - 1).clamp(min=0) / c.gamma), torch.zeros(bs))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    out = []
    for _ in range(n):
        tokens = torch.randint(1, c.vocab, (B, C), generator=g)                 # 0 is MASK
        ctx_hidden = torch.randn(B, C, c.taps * c.hidden, generator=g)
        anchors = torch.stack([torch.randperm(C - bs, generator=g)[:nb].sort().values + 1
                               for _ in range(B)])                              # (B, nb) in [1, C-bs]
        pos_q = (anchors[:, :, None] + k).reshape(B, Q)                         # (B, Q)
        labels = torch.gather(tokens, 1, pos_q.clamp(max=C - 1))
        block_ids = torch.zeros(B, nb, bs, dtype=torch.long)
        block_ids[:, :, 0] = torch.gather(tokens, 1, anchors)
        block_of_q = torch.arange(Q) // bs
        sees_ctx = torch.arange(C)[None, None, :] < anchors.repeat_interleave(bs, 1)[:, :, None]
        sees_blk = (block_of_q[:, None] == block_of_q[None, :]).expand(B, Q, Q)
        mask = torch.cat([sees_ctx, sees_blk], dim=2)[:, None]                  # (B, 1, Q, C+Q)
        pos_k = torch.cat([torch.arange(C).expand(B, C), pos_q], dim=1)         # (B, C+Q)

        def rope(pos):
            f = pos[:, None, :, None].float() * inv_freq                        # (B, 1, T, d/2)
            f = torch.cat([f, f], dim=-1)
            return f.cos(), f.sin()

        cos_q, sin_q = rope(pos_q)
        cos_k, sin_k = rope(pos_k)
        out.append((ctx_hidden, block_ids.reshape(B, Q), mask, cos_q, sin_q, cos_k, sin_k,
                    labels, w_block.repeat(B, nb)))
    return out


# ---- one case, in its own process (`--case POLICY:TOPOLOGY:N`) ------------------------------

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


def _case_main(args) -> int:
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


# ---- the parent: build report, modes, the matrix, the choice ----------------------------------

def _guard(fn, default=None):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a build report field we cannot read is reported as null
        return default


def _cudnn_str(v: int | None) -> str | None:
    if not v:
        return None
    major, rest = (v // 10000, v % 10000) if v >= 90000 else (v // 1000, v % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _dist_version(*names: str) -> str | None:
    from importlib import metadata
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _nvidia_driver() -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    line = r.stdout.strip().splitlines()[:1]
    return line[0].strip() if r.returncode == 0 and line else None


def build_report() -> dict:
    cuda = torch.cuda.is_available()
    gpus = []
    for i in range(torch.cuda.device_count() if cuda else 0):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"name": p.name, "capability": f"{p.major}.{p.minor}",
                     "memory_gb": round(p.total_memory / 2**30, 1)})
    nccl = _guard(lambda: torch.cuda.nccl.version()) if cuda else None
    return {
        "python": platform.python_version(), "executable": sys.executable,
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "torch_git": getattr(torch.version, "git_version", None),
        "cuda": torch.version.cuda, "cuda_available": cuda,
        "cudnn": _cudnn_str(_guard(torch.backends.cudnn.version)),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else (str(nccl) if nccl else None),
        "triton": _dist_version("triton", "pytorch-triton", "pytorch-triton-rocm"),
        "driver": _nvidia_driver() if cuda else None,
        "gpus": gpus,
        "bf16": bool(_guard(torch.cuda.is_bf16_supported, False)) if cuda else None,
    }


def check_expect(build: dict, expect: dict) -> dict:
    """Compare the build with an expectation like {"torch": ">=2.5", "cuda": "13.0", "gpus": 8}.
    Version keys take specs (trainer.signatures.version_in); gpus a count; gpu_name a substring;
    bf16 a bool. Unknown keys are mismatches too, so a typo is not silently ignored."""
    from trainer.signatures import version_in
    mismatches = []
    for key, want in expect.items():
        if key in ("torch", "cuda", "python", "triton", "cudnn", "nccl", "driver"):
            have = build.get(key)
            try:
                ok = have is not None and version_in(str(have), str(want))
            except ValueError as e:
                mismatches.append(f"{key}: bad expectation {want!r}: {e}")
                continue
            if not ok:
                mismatches.append(f"{key}: have {have}, expected {want}")
        elif key == "gpus":
            if len(build["gpus"]) != int(want):
                mismatches.append(f"gpus: have {len(build['gpus'])}, expected {want}")
        elif key == "gpu_name":
            bad = [g["name"] for g in build["gpus"] if str(want).lower() not in g["name"].lower()]
            if bad or not build["gpus"]:
                mismatches.append(f"gpu_name: have {bad or 'no GPU'}, expected {want!r}")
        elif key == "bf16":
            if bool(build.get("bf16")) != bool(want):
                mismatches.append(f"bf16: have {build.get('bf16')}, expected {want}")
        else:
            mismatches.append(f"{key}: unknown expectation key (known: torch, cuda, python, triton, "
                              "cudnn, nccl, driver, gpus, gpu_name, bf16)")
    return {**expect, "mismatches": mismatches}


def _jsonable(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return repr(v)


def mode_options() -> dict:
    """list_mode_options(mode) for every mode this torch knows (its no-argument form lists them)."""
    import torch._inductor as inductor
    listed = _guard(inductor.list_mode_options)
    names = list(listed) if isinstance(listed, dict) and listed else list(KNOWN_MODES)
    out = {}
    for mode in names:
        try:
            out[mode] = _jsonable(inductor.list_mode_options(mode))
        except Exception as e:  # noqa: BLE001 - a mode the fallback list names but this torch lacks
            if isinstance(listed, dict):
                out[mode] = {"error": f"{type(e).__name__}: {e}"}
    return out


class _Stopped(Exception):
    """SIGTERM reached the probe: finish with the cases done so far."""


def _stop_probe(signum, frame):
    raise _Stopped()


def _run_child(policy: str, topology: str, n: int, args) -> dict:
    """One case: `python -m trainer.probe --case POLICY:TOPOLOGY:N` in the release's root."""
    root = str(Path(__file__).resolve().parent.parent)
    # faulthandler prints "Fatal Python error: Segmentation fault" and every thread's stack
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "trainer.probe", "--case", f"{policy}:{topology}:{n}",
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device]
    return run_isolated(cmd, args.timeout, cwd=root, env=env)


def run_isolated(cmd: list[str], timeout: float, *, cwd: str | None = None,
                 env: dict | None = None) -> dict:
    """Run `cmd` in its own process group with stdout+stderr merged; on timeout kill the group
    (the case and any compile workers it started). Returns the case result line (if printed),
    exit code (negative: killed by that signal; None on timeout), output without it, tail, seconds."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=cwd, env=env, start_new_session=True)
    timed_out = False
    deadline = t0 + timeout
    try:
        while True:
            try:
                out, _ = proc.communicate(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                # the case exited but leftovers (compile workers) still hold the pipe; or time is up
                exited = proc.poll() is not None
                if exited or time.monotonic() >= deadline:
                    timed_out = not exited
                    _killpg(proc.pid)
                    out, _ = proc.communicate()
                    break
    except BaseException:
        _killpg(proc.pid)      # the probe itself is being stopped: take the case down with it
        raise
    _killpg(proc.pid)      # compile workers the case left behind
    text = out.decode("utf-8", "replace")
    result, lines = None, []
    for line in text.splitlines():
        if line.startswith(CASE_MARK):
            result = _guard(lambda: json.loads(line[len(CASE_MARK):]))
        else:
            lines.append(line)
    return {"result": result, "exit_code": None if timed_out else proc.returncode,
            "timed_out": timed_out, "output": "\n".join(lines), "tail": lines[-TAIL_LINES:],
            "seconds": round(time.monotonic() - t0, 2)}


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _case_record(policy, topology, n, run, catalog) -> dict:
    res, code = run["result"], run["exit_code"]
    if run["timed_out"]:
        outcome = "timeout"
    elif code is not None and (code < 0 or code > 128):
        outcome = "crashed"            # even after reporting: dying by a signal is the news
    elif res and res.get("ok"):
        outcome = "ok"
    else:
        outcome = "failed"
    sig = None
    if outcome != "ok" and catalog is not None:
        sig = catalog.classify(run["output"], code)
    ok = outcome == "ok"
    return {
        "policy": policy, "topology": topology, "threads": n, "outcome": outcome, "signature": sig,
        "step_ms": res.get("step_ms") if ok else None,
        "max_abs_diff": res.get("max_abs_diff") if ok else None,
        "agrees": res.get("agrees") if ok else None,
        "exit_code": code, "seconds": run["seconds"],
        "error": None if ok else ((res or {}).get("error") or (run["tail"][-1] if run["tail"] else None)),
        "first_step_s": res.get("first_step_s") if ok else None,
        "eager_step_ms": res.get("eager_step_ms") if ok else None,
        "step_ms_threads": res.get("step_ms_threads") if ok else None,
        "tail": run["tail"],
    }


def _skipped(policy, topology, n, why) -> dict:
    return {"policy": policy, "topology": topology, "threads": n, "outcome": "skipped",
            "signature": None, "step_ms": None, "max_abs_diff": None, "agrees": None,
            "exit_code": None, "seconds": 0.0, "error": why, "tail": []}


def choose(cases: list[dict]) -> tuple[str, str]:
    """The fastest policy that passed in `threads` and agreed with eager; eager as the fallback."""
    passed = [c for c in cases if c["topology"] == "threads" and c["outcome"] == "ok"
              and c["agrees"] and c["step_ms"] is not None]
    failed = [f"{c['policy']} ({c['signature'] or c['outcome']})" for c in cases
              if c["topology"] == "threads" and c["outcome"] in ("failed", "crashed", "timeout")]
    disagreed = [c["policy"] for c in cases if c["topology"] == "threads"
                 and c["outcome"] == "ok" and c["agrees"] is False]
    notes = ""
    if failed:
        notes += f"; failed in threads: {', '.join(failed)}"
    if disagreed:
        notes += f"; ran but disagreed with eager: {', '.join(disagreed)}"
    if not passed:
        return "eager", "no policy passed in threads and agreed with eager: eager is the fallback" + notes
    order = {name: i for i, name in enumerate(policies.POLICY_NAMES)}
    passed.sort(key=lambda c: c["step_ms"])
    best = passed[0]
    # a simpler policy within the noise margin of the fastest wins
    for c in sorted(passed, key=lambda c: order.get(c["policy"], 99)):
        if c["step_ms"] <= best["step_ms"] * (1 + TIE_MARGIN):
            best = c
            break
    others = ", ".join(f"{c['policy']} {c['step_ms']:.2f}" for c in passed if c is not best)
    reason = (f"{best['policy']}: fastest of {len(passed)} polic{'y' if len(passed) == 1 else 'ies'} "
              f"that ran in {best['threads']} threads and agreed with eager "
              f"({best['step_ms']:.2f} ms/step" + (f"; {others} ms/step" if others else "") + ")")
    if best is not passed[0]:
        reason += f" (within {TIE_MARGIN:.0%} of {passed[0]['policy']}: the simpler policy wins)"
    return best["policy"], reason + notes


def save_result(workdir: str, doc: dict) -> str:
    """Write WORKDIR/probe.json atomically (temp file + rename), keeping the last runs' summaries."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "probe.json")
    history = []
    prev = _guard(lambda: json.loads(Path(path).read_text(encoding="utf-8")))
    if isinstance(prev, dict):
        history = list(prev.get("history") or [])
        history.append({k: prev.get(k) for k in ("policy", "reason", "time", "torch")})
    record = {"policy": doc["policy"], "reason": doc["reason"], "time": doc["time"],
              "torch": doc["torch"]["version"], "result": doc, "history": history[-HISTORY_KEEP:]}
    fd, tmp = tempfile.mkstemp(prefix=".probe.", suffix=".json", dir=workdir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _guard(lambda: os.unlink(tmp))
        raise
    return path


def _progress(msg: str) -> None:
    sys.stderr.write(f"probe: {msg}\n")
    sys.stderr.flush()


def run_probe(args) -> dict:
    t_start = time.monotonic()
    build = build_report()
    cuda = args.device == "cuda"
    n_threads = args.threads or max(2, len(build["gpus"]))
    names = args.policies
    catalog, catalog_error = None, None
    try:
        from trainer.signatures import load_catalog
        catalog = load_catalog(args.signatures)
    except Exception as e:  # noqa: BLE001 - probe still runs; cases are just not named
        catalog_error = f"{type(e).__name__}: {e}"
    # Cheapest compiles first: a probe stopped early (SIGTERM, a caller's time limit) still has
    # the answers that matter; max-autotune benchmarks kernels for minutes on a cold cache.
    names = sorted(names, key=COST_ORDER.index)
    plan = [(p, t, 1 if t == "main" else n_threads) for p in names for t in TOPOLOGIES]
    _progress(f"torch {build['torch']}, {args.device}, {len(build['gpus'])} GPU(s); "
              f"{len(plan)} cases, threads={n_threads}")
    cases = []
    interrupted = False
    previous = signal.signal(signal.SIGTERM, _stop_probe)
    for i, (policy, topology, n) in enumerate(plan, 1):
        label = f"[{i}/{len(plan)}] {policy} {topology}" + (f" x{n}" if topology == "threads" else "")
        if interrupted:
            cases.append(_skipped(policy, topology, n, "not run: the probe was stopped"))
            continue
        try:
            if policies.needs_cuda(policy) and not cuda:
                case = _skipped(policy, topology, n, "needs CUDA; this machine has none")
            else:
                case = _case_record(policy, topology, n, _run_child(policy, topology, n, args), catalog)
        except _Stopped:
            # SIGTERM: report what is known rather than nothing (the cases so far cost minutes).
            interrupted = True
            case = dict(_skipped(policy, topology, n, "the probe was stopped during this case"),
                        outcome="timeout")
        cases.append(case)
        if case["outcome"] == "ok":
            diff = "non-finite loss" if case["max_abs_diff"] is None else f"max diff {case['max_abs_diff']:.2g}"
            detail = (f"{case['step_ms']:.2f} ms/step, "
                      f"{'agrees with' if case['agrees'] else 'DISAGREES with'} eager ({diff})")
        else:
            detail = case["signature"] or case["error"] or ""
        _progress(f"{label}: {case['outcome']} {detail} ({case['seconds']:.1f} s)")
    signal.signal(signal.SIGTERM, previous)
    policy, reason = choose(cases)
    if interrupted:
        reason += " (probe stopped early: later cases not run)"
    _progress(f"chosen: {reason}")
    c = GPU_CONFIG if cuda else CPU_CONFIG
    doc = {
        "ok": True, "build": build,
        "torch": {"version": build["torch"], "cuda": build["cuda"], "gpus": [g["name"] for g in build["gpus"]]},
        "expect": check_expect(build, args.expect or {}),
        "modes": mode_options(),
        "device": args.device, "threads": n_threads, "steps": args.steps, "warmup": args.warmup,
        "model": asdict(c), "dtype": "bfloat16" if cuda and build["bf16"] else "float32",
        "policies": {p: policies.describe(p) for p in names},
        "cases": cases, "policy": policy, "reason": reason, "interrupted": interrupted,
        "catalog_error": catalog_error,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.monotonic() - t_start, 2),
        "saved": None,
    }
    if args.workdir:
        doc["saved"] = os.path.join(args.workdir, "probe.json")
        save_result(args.workdir, doc)
    return doc


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m trainer.probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=0,
                    help="worker threads for the `threads` topology (default: number of GPUs, at least 2)")
    ap.add_argument("--steps", type=int, default=10, help="timed training steps per replica (default 10)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps first: compile, CUDA graph warm-up and record (default 3)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per case (default 600 on CUDA, 300 on CPU)")
    ap.add_argument("--workdir", help="save the choice in WORKDIR/probe.json (read by --compile-policy auto)")
    ap.add_argument("--expect", type=_json_object, default=None,
                    help='JSON expectation, e.g. \'{"torch": ">=2.5", "cuda": "13.0", "gpus": 8}\'')
    ap.add_argument("--policies", help=f"comma-separated subset of {','.join(policies.POLICY_NAMES)}")
    ap.add_argument("--signatures", help="signature catalog (default: the bundled signatures.yaml)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where cases run (default: cuda when available)")
    ap.add_argument("--case", help=argparse.SUPPRESS)   # internal: POLICY:TOPOLOGY:N, one case
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.steps < 1 or args.warmup < 1 or args.threads < 0:
        _parser().error("--steps and --warmup must be >= 1, --threads >= 0")
    names = [p.strip() for p in (args.policies or "").split(",") if p.strip()]
    unknown = [p for p in names if p not in policies.POLICY_NAMES]
    if unknown:
        _parser().error(f"--policies: unknown {', '.join(unknown)}; known: {', '.join(policies.POLICY_NAMES)}")
    args.policies = names or list(policies.POLICY_NAMES)
    if args.timeout is None:
        # a GPU case compiles Triton kernels (max-autotune benchmarks them) in N threads at once
        args.timeout = 600.0 if args.device == "cuda" else 300.0
    if args.case:
        return _case_main(args)
    doc = run_probe(args)
    sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
