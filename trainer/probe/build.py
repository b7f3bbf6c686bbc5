"""The probe's build report: versions of python, torch, CUDA, cuDNN, NCCL, Triton, the driver and
the GPUs; the check against an expectation (--expect); the options of every compile mode."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import torch

KNOWN_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "lite")


def call_or_default(fn, default=None):
    """fn(), or `default` when it raises (the probe reports what it cannot read as null)."""
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
    nccl = call_or_default(lambda: torch.cuda.nccl.version()) if cuda else None
    return {
        "python": platform.python_version(), "executable": sys.executable,
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "torch_git": getattr(torch.version, "git_version", None),
        "cuda": torch.version.cuda, "cuda_available": cuda,
        "cudnn": _cudnn_str(call_or_default(torch.backends.cudnn.version)),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else (str(nccl) if nccl else None),
        "triton": _dist_version("triton", "pytorch-triton", "pytorch-triton-rocm"),
        "driver": _nvidia_driver() if cuda else None,
        "gpus": gpus,
        "bf16": bool(call_or_default(torch.cuda.is_bf16_supported, False)) if cuda else None,
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
    listed = call_or_default(inductor.list_mode_options)
    names = list(listed) if isinstance(listed, dict) and listed else list(KNOWN_MODES)
    out = {}
    for mode in names:
        try:
            out[mode] = _jsonable(inductor.list_mode_options(mode))
        except Exception as e:  # noqa: BLE001 - a mode the fallback list names but this torch lacks
            if isinstance(listed, dict):
                out[mode] = {"error": f"{type(e).__name__}: {e}"}
    return out
