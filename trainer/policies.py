"""Named compile policies, shared by the probe and the trainer.

A policy is a named, logged recipe for `torch.compile`: the probe measures each one
on the target (`python -m trainer.probe`) and saves its choice in WORKDIR/probe.json; the trainer
runs `--compile-policy NAME|auto`. In a one-thread-per-GPU trainer, inside EVERY worker thread:

    policies.configure_thread(n_devices)        # per-thread config from torch 2.12 on
    torch.cuda.set_device(i)
    fn = policies.compile_module(model, policy, n_devices=n_devices)   # keep `model` for state_dict
    for batch in batches:
        policies.step_begin(policy)
        loss = fn(**batch); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

Importing this module does not import torch (the controller may describe policies).
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from trainer import faults

POLICY_NAMES = ("eager", "inductor", "max-autotune-no-cudagraphs", "reduce-overhead",
                "cudagraphs-no-trees")
# What a probe without --policies tries: every policy but max-autotune-no-cudagraphs, whose first
# compile autotunes GEMMs for minutes before the first step (docs/probe-h200.md). It stays a policy:
# --policies names it to probe it.
# `--compile-policy auto`: the probe's saved choice for this host, resolved by the trainer (resolve());
# the default everywhere a policy is asked for. POLICY_CHOICES: what a user may name.
AUTO = "auto"
PROBE_FILE = "probe.json"      # WORKDIR/probe.json: the probe's saved choice, which `auto` reads
POLICY_CHOICES = (AUTO, *POLICY_NAMES)
PROBED_BY_DEFAULT = tuple(p for p in POLICY_NAMES if p != "max-autotune-no-cudagraphs")

# What each policy hands torch.compile: never mode= and options= together, torch refuses that
# ("Either mode or options can be specified", signature compile-mode-and-options).
_RECIPES: dict[str, dict[str, Any]] = {
    "eager": {"mode": None, "options": None, "cuda": False,
              "notes": "no compilation; the fallback that always works"},
    "inductor": {"mode": "default", "options": None, "cuda": False,
                 "notes": "inductor default mode, no CUDA graphs; runs in worker threads on every "
                          "torch version measured (docs/background.md#torchcompile-in-worker-threads)"},
    "max-autotune-no-cudagraphs": {
        "mode": "max-autotune-no-cudagraphs", "options": None, "cuda": False,
        "notes": "inductor with GEMM/kernel autotuning, no CUDA graphs; long first compile"},
    "reduce-overhead": {
        "mode": "reduce-overhead", "options": None, "cuda": True,
        "notes": "CUDA Graph Trees; before torch 2.13 fails in any thread but the one that imported "
                 "cudagraph_trees (pytorch#123177, fixed by PR #184357); needs "
                 "cudagraph_mark_step_begin() per step"},
    "cudagraphs-no-trees": {
        "mode": None, "options": {"triton.cudagraphs": True, "triton.cudagraph_trees": False},
        "cuda": True,
        "notes": "inductor's older non-tree CUDA graphs; before 2.13 one compiled function is shared "
                 "by all threads and asserts when another thread's parameters come in "
                 "(cudagraph-static-input)"},
}

# Test-only policies, known only where a test enables the fault point test_policies (trainer/faults.py):
# deliberately WRONG compiled paths, so that tests can show the probe's numerics verdict and the
# trainer's first-step guard reject a policy that runs but computes something else, as inductor's
# non-tree CUDA graphs did on the H200 (right loss, wrong first gradient; docs/probe-h200.md).
#   test-drop-first-grad  the first call's loss carries no gradient
#   test-frozen           no call's loss carries a gradient (weights never train)
# They wrap the UNCOMPILED module (_DropGrad works from outside, so what it wraps is not what is tested;
# compiling it only cost the tests a compile per run): the verdict and the guard go by the policy not
# being eager (Replica.compiled), and the compiled path in threads and ranks is the `inductor` policy's.
_TEST_RECIPES: dict[str, dict[str, Any]] = {
    "test-drop-first-grad": {"mode": None, "options": None, "cuda": False, "drop": "first",
                             "notes": "test only: the eager module, its first gradient dropped"},
    "test-frozen": {"mode": None, "options": None, "cuda": False, "drop": "all",
                    "notes": "test only: the eager module, all its gradients dropped"},
}

# Dynamo's defaults, per device: recompile_limit 8, accumulated_recompile_limit 256.
_RECOMPILE_PER_DEVICE = 8
_ACCUMULATED_PER_DEVICE = 256


class PolicyError(ValueError):
    """An unknown policy, a policy this machine cannot run, or `auto` without a probe result."""


def known() -> tuple[str, ...]:
    """POLICY_NAMES, plus the test-only policies where the test hook is set."""
    return POLICY_NAMES + (tuple(_TEST_RECIPES) if faults.enabled("test_policies") else ())


def chosen(text: str | None) -> list[str]:
    """The probe's --policies A,B as a list, or PROBED_BY_DEFAULT; ValueError names unknown ones."""
    names = [p.strip() for p in (text or "").split(",") if p.strip()]
    unknown = [p for p in names if p not in known()]
    if unknown:
        raise ValueError(f"--policies: unknown {', '.join(unknown)}; known: {', '.join(POLICY_NAMES)}")
    return names or list(PROBED_BY_DEFAULT)


def _recipe(name: str) -> dict[str, Any]:
    _check_name(name)
    return _RECIPES.get(name) or _TEST_RECIPES[name]


def _check_name(name: str) -> None:
    if name not in known():
        raise PolicyError(f"unknown compile policy {name!r}; choose one of "
                          f"{', '.join(POLICY_NAMES)} or auto")


def needs_cuda(name: str) -> bool:
    """True for the policies that capture CUDA graphs (reduce-overhead, cudagraphs-no-trees)."""
    return bool(_recipe(name)["cuda"])


def describe(policy: str) -> dict:
    """What a policy does, as data to log or print: name, mode, options, needs_cuda, notes."""
    r = _recipe(policy)
    return {"name": policy, "mode": r["mode"], "options": dict(r["options"]) if r["options"] else None,
            "needs_cuda": r["cuda"], "mark_step": policy == "reduce-overhead", "notes": r["notes"]}


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of `version`, default torch.__version__: '2.12.0a0+git1' -> (2, 12)."""
    if version is None:
        import torch
        version = torch.__version__
    m = re.match(r"(\d+)\.(\d+)", str(version))
    if not m:
        raise ValueError(f"cannot parse torch version {version!r}")
    return int(m.group(1)), int(m.group(2))


def resolve(policy: str, workdir: str | None, topology: str = "threads") -> str:
    """A policy name as given, or for 'auto' the probe's choice saved in WORKDIR/probe.json: its
    `policy` for worker threads, its `processes_policy` (from the main-thread cases, CUDA graphs
    allowed) for `--topology processes`, falling back to `policy` for a probe.json without it."""
    return resolve_for_run(policy, workdir, topology)[0]


def resolve_for_run(policy: str, workdir: str | None, topology: str = "threads",
                    steps: int | None = None) -> tuple[str, str | None]:
    """resolve(), and for 'auto' with the run's length: (policy, the one line that says why auto
    took eager instead of the probe's choice, or None). A compiled policy pays its compile back
    only after compile_s / (eager's step - its step) steps; a run shorter than that is faster eager."""
    if policy != AUTO:
        _check_name(policy)
        return policy, None
    chosen, saved = _probe_choice(workdir, topology)
    return weigh(saved, chosen, topology, steps)


def weigh(saved: dict, chosen: str, topology: str, steps: int | None) -> tuple[str, str | None]:
    """(policy, why eager) for a run of `steps`, from the probe's own figures in saved["result"]
    ["cases"]: the compile is the longest first step of `chosen`'s cases less eager's (a cold
    compile), the saving a step eager's step_ms less chosen's, in the run's topology's cases
    ("threads", or "main" for processes). Without figures, or when it pays back: (chosen, None)."""
    if chosen == "eager" or not steps:
        return chosen, None
    cases = [c for c in ((saved.get("result") or {}).get("cases") or [])
             if isinstance(c, dict) and c.get("outcome") == "ok" and c.get("step_ms") and c.get("first_step_s")]
    kind = "main" if topology == "processes" else "threads"

    def one(name: str, key: str):     # a compile: the longest of any topology; a step: this topology's
        vals = [c[key] for c in cases if c.get("policy") == name and (key == "first_step_s" or c["topology"] == kind)]
        return max(vals) if vals else None
    compile_s, ms, eager_ms = one(chosen, "first_step_s"), one(chosen, "step_ms"), one("eager", "step_ms")
    if compile_s is None or ms is None or eager_ms is None:
        return chosen, None
    compile_s -= one("eager", "first_step_s") or 0.0
    saving = (eager_ms - ms) / 1000
    payback = compile_s / saving if saving > 0 else float("inf")
    if steps >= payback:
        return chosen, None
    figures = f"({ms:.2f} against eager's {eager_ms:.2f} ms a step in the probe)"
    why = (f"this run's {steps} steps are fewer than the {payback:,.0f} its {compile_s:.1f} s compile takes to "
           f"pay back {figures}" if saving > 0 else f"its {compile_s:.1f} s compile never pays back {figures}")
    return "eager", f"auto: eager, not the probe's {chosen}: {why}; --compile-policy {chosen} compiles anyway"


def _probe_choice(workdir: str | None, topology: str) -> tuple[str, dict]:
    """The probe's choice for `topology` and the whole saved probe.json (PolicyError when missing,
    unreadable, unknown or from another torch)."""
    path = os.path.join(workdir, PROBE_FILE) if workdir else None
    if not path or not os.path.isfile(path):
        raise PolicyError(f"no probe result in {workdir or '(no workdir given)'}: "
                          "run `dflash-ops probe`")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError, RecursionError) as e:     # RecursionError: nested beyond what json reads
        raise PolicyError(f"{path}: unreadable probe result ({e}): run `dflash-ops probe` again") from None
    chosen = saved.get("policy") if isinstance(saved, dict) else None
    if topology == "processes" and isinstance(saved, dict) and saved.get("processes_policy"):
        chosen = saved["processes_policy"]
    if chosen not in known():
        raise PolicyError(f"{path}: probe chose {chosen!r}, not a known policy: "
                          "run `dflash-ops probe` again")
    # A choice measured on another torch build proves nothing about this one (the answer changes
    # between 2.11, 2.12 and 2.13). Only checked when torch is already loaded: resolve stays cheap.
    probed = saved.get("torch")
    torch_mod = sys.modules.get("torch")
    if isinstance(probed, str) and torch_mod is not None and probed != torch_mod.__version__:
        raise PolicyError(f"{path}: probed with torch {probed}, this is torch "
                          f"{torch_mod.__version__}: run `dflash-ops probe` again")
    return chosen, saved


def configure_thread(n_devices: int) -> None:
    """Raise dynamo's recompile limits for `n_devices` devices, in the CALLING thread.

    The device index is part of every tensor guard, so N GPUs compiling one function use N cache
    entries: 8 GPUs exhaust the default recompile_limit of 8 by themselves. Idempotent (sets
    max(current, needed)). From torch 2.12 dynamo/inductor config is thread-local (a ContextVar;
    pytorch#186537): a value set in the main thread is not seen by worker threads, so call this in
    every worker thread. Before 2.12 config is process-global and this is harmless to repeat.
    (Work the autograd engine runs for a thread's backward sees that thread's overrides only once
    contextvars propagate to autograd threads, pytorch PR #186583.)
    """
    import torch._dynamo.config as dconfig

    n = max(1, int(n_devices))
    # recompile_limit was called cache_size_limit up to torch 2.6 (the old name stays as an alias).
    for new, old, per_device in (("recompile_limit", "cache_size_limit", _RECOMPILE_PER_DEVICE),
                                 ("accumulated_recompile_limit", "accumulated_cache_size_limit",
                                  _ACCUMULATED_PER_DEVICE)):
        name = new if hasattr(dconfig, new) else old
        if not hasattr(dconfig, name):
            continue
        want = per_device * n
        if getattr(dconfig, name) < want:
            setattr(dconfig, name, want)


def compile_module(module, policy: str, *, n_devices: int = 1):
    """Return a callable running `module` under `policy` (the module itself for eager).

    Compilation is lazy: it happens on the first call, in the calling thread, so call
    configure_thread() in each worker first (done here too, for the thread that calls this).
    Keep `module` itself for state_dict/eval: the compiled wrapper prefixes keys with `_orig_mod.`.
    """
    recipe = _recipe(policy)
    if policy == "eager":
        return module
    if recipe.get("drop"):          # the test-only wrong policies: no compile (see _TEST_RECIPES)
        return _DropGrad(module, recipe["drop"])
    import torch

    if recipe["cuda"] and not torch.cuda.is_available():
        raise PolicyError(f"compile policy {policy!r} captures CUDA graphs and needs a GPU; "
                          "this machine has none (use inductor or eager)")
    configure_thread(n_devices)
    if recipe["options"] is not None:
        # Options, not global config: from 2.12 config set outside the compiling thread is not
        # seen (pytorch#186537), and before 2.12 config.patch is not thread-safe.
        return torch.compile(module, options=dict(recipe["options"]))
    return torch.compile(module) if recipe["mode"] == "default" else torch.compile(module, mode=recipe["mode"])


class _DropGrad:
    """Test-only (see _TEST_RECIPES): the first element of the output (the loss) keeps its value
    but loses its gradient, on the first call or on every call."""

    def __init__(self, fn, when: str):
        self.fn, self.when, self.calls = fn, when, 0

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        self.calls += 1
        if self.when == "all" or self.calls == 1:
            loss = out[0]
            out = (loss.detach() + 0.0 * loss, *out[1:])
        return out


def compiled_part(setting: str, policy: str, device) -> bool:
    """Whether a part of the step beside the drafter's loss runs compiled: the target's decoder
    layers (--compile-target) or the clip + AdamW update (--compile-update), each auto|on|off.

    auto: on a GPU whenever the drafter's policy compiles. The target's forward is a third of a
    step at the Qwen3-8B shape and eager launches ~25 small kernels per layer around its matmuls;
    the fused AdamW streams at 2.6 TB/s where the compiled update reaches a copy's 4.2
    (docs/benchmarks.md). On the CPU the compile costs more than it saves for short runs. Plain
    inductor whatever the policy: both run inside worker threads, where CUDA graphs are unsafe."""
    if setting in ("on", "off"):
        return setting == "on"
    return policy != "eager" and device.type == "cuda"


def step_begin(policy: str) -> None:
    """Mark a training-step boundary where the policy needs one (CUDA Graph Trees only).

    Without it trees cannot tell a new step from a re-run and outputs kept from the previous step
    are overwritten (signature cudagraph-output-overwritten). Note the mark-step counter is
    process-wide in every torch version: one thread's mark affects every thread's trees.
    The non-tree path (cudagraphs-no-trees) has no step notion; nothing to do there.
    """
    _check_name(policy)
    if policy == "reduce-overhead":
        import torch

        torch.compiler.cudagraph_mark_step_begin()
