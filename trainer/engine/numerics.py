"""Does a compiled step compute what eager computes? Gradient comparison for the probe and the trainer.

A compile policy that runs is not yet one that works: on the H200 (torch 2.11) inductor's non-tree
CUDA graphs returned the right loss and an entirely wrong gradient on their first step
(docs/probe-h200.md). A loss tolerance wide enough for bf16 noise also passes a model whose
weights never change, so both checks here compare GRADIENTS, per parameter, on identical weights
and batches:

- the probe (trainer/probe/case.py) measures the noise of the working precision in the same case
  (eager at the working precision against eager at a higher one: bf16 -> fp32 on CUDA, fp32 -> fp64
  on the CPU) and accepts a compiled gradient within NOISE_FACTOR x that noise of eager's;
- the trainer's first-step guard (`guard_first_step`) costs one eager forward/backward per worker
  and uses GUARD_TOLERANCE, set from what the probe measured on the H200 (docs/probe-h200.md).

Two estimates of the same gradient that each lie within the noise of the exact one differ by at
most twice the noise; NOISE_FACTOR leaves room for the noise being estimated from few steps.
A wrong gradient (dropped, stale, scaled by 1/2) is off by 0.5-1.0 in relative L2, orders of
magnitude above either threshold.

An fp8 case of the probe (--precision fp8, trainer/model/fp8.py) is judged against eager bf16, and
its noise is fp8's own, measured in the same steps (eager fp8 against eager bf16). The compiled fp8
step carries an fp8 error of the same size, but not the same one: each worker quantizes its own
shard with its own scales (2 CPU threads measured 1.25x eager's). FP8_NOISE_FACTOR x that noise,
and never more than FP8_NOISE_FACTOR x what fp8.step_error estimates from e4m3/e5m2 for the whole
gradient (`fp8_limit`), so that fp8's large noise cannot excuse a wrong gradient. The estimate is
first-order, not a bound: on the H200 the first step of a freshly initialised drafter measured
0.374 against its 0.342 (it takes every rounding as relative; values far below a tensor's amax
round worse), so a limit of the estimate itself would reject fp8's own noise; twice it (0.68)
still stops a wrong gradient (0.997 measured for stale CUDA graphs).
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.errors import TrainerError
from trainer.engine.step import eager_grads
from trainer.model import fp8

NOISE_FACTOR = 8.0
FP8_NOISE_FACTOR = 2.0
# The smallest noise a comparison assumes, in units of the working dtype's machine epsilon: an
# estimate of 0 (a lucky step, or a parameter the precision change does not touch) must not make
# reassociation alone count as wrong.
NOISE_FLOOR_EPS = 1.0
# The guard's threshold on the relative L2 error of the whole gradient (all parameters as one
# vector), by working dtype. bf16: the probe measured compiled-vs-eager 1e-3..1e-2 on the H200
# (docs/probe-h200.md) while a wrong first gradient measured 1.00; fp32 (CPU): ~1e-7 vs 1.00.
GUARD_TOLERANCE = {torch.bfloat16: 0.1, torch.float16: 0.1, torch.float32: 1e-3, torch.float64: 1e-6}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are 0; inf when only b is)."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    den = float(torch.linalg.vector_norm(b))
    num = float(torch.linalg.vector_norm(a - b))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def grad_errors(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> tuple[list[float], float]:
    """Per-parameter relative L2 errors of `got` against `ref`, and the error of all of them as one vector."""
    per = [rel_l2(g, r) for g, r in zip(got, ref)]
    num = math.sqrt(sum(float(torch.linalg.vector_norm((g.detach().double() - r.detach().double()).flatten())) ** 2
                        for g, r in zip(got, ref)))
    den = math.sqrt(sum(float(torch.linalg.vector_norm(r.detach().double().flatten())) ** 2 for r in ref))
    total = 0.0 if num == 0.0 else (num / den if den else math.inf)
    return per, total


def snapshot_grads(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """A copy of every parameter's gradient (zeros where there is none), on the CPU in float64."""
    return [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().cpu() for p in params]


def _copy_grads(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """A copy of every parameter's gradient where it lives (zeros where there is none)."""
    return [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone() for p in params]


def noise_floor(dtype: torch.dtype) -> float:
    return NOISE_FLOOR_EPS * float(torch.finfo(dtype).eps)


@dataclass
class StepCheck:
    """One teacher-forced step: compiled (c), eager (e) and high-precision eager (t) on the same weights and batch."""
    loss_c: float
    loss_e: float
    loss_t: float
    grad_err: list[float]       # per parameter, compiled vs eager
    grad_noise: list[float]     # per parameter, eager vs high precision
    total_err: float            # all parameters as one vector
    total_noise: float


def fp8_limit(precision: str, layers: int) -> float:
    """The most an fp8 probe case's whole-gradient tolerance may be: FP8_NOISE_FACTOR x fp8.step_error's
    first-order estimate of fp8's noise for a drafter of `layers` layers (module docstring)."""
    return FP8_NOISE_FACTOR * fp8.step_error(precision, layers)


def judge(steps: list[StepCheck], replay: list[tuple[float, float]], learn: tuple[list[float], list[float]] | None,
          names: Sequence[str], dtype: torch.dtype, factor: float = NOISE_FACTOR, limit: float | None = None) -> dict:
    """The numerics verdict of a probe case: {"ok", "why", figures...}.

    steps:  teacher-forced steps (every step compiled and eager start from eager's weights).
    replay: (compiled loss, eager loss) on batches 0, 1, 2, 0 with fixed weights: a stale static
            input repeats batch 0's loss.
    learn:  (compiled losses, eager losses) free-running on one repeated batch: the loss must fall
            as eager's does (a model whose update is lost does not).
    Thresholds: `factor` (NOISE_FACTOR) x the noise measured in these same steps (at least the dtype's
    floor); the whole gradient's at most `limit` where given (fp8: fp8_limit).
    """
    floor = noise_floor(dtype)
    n = len(names)
    noise_p = [max([floor] + [s.grad_noise[i] for s in steps]) for i in range(n)]
    noise_total = max([floor] + [s.total_noise for s in steps])
    noise_loss = max([floor] + [abs(s.loss_e - s.loss_t) / max(abs(s.loss_e), 1e-12) for s in steps])
    tol_p = [factor * x for x in noise_p]
    tol_total, tol_loss = factor * noise_total, factor * noise_loss
    if limit is not None:
        tol_total = min(tol_total, limit)
    why = []
    worst = (0.0, 0, 0)  # (ratio, step, param)
    for k, s in enumerate(steps):
        for i, e in enumerate(s.grad_err):
            r = e / tol_p[i] if tol_p[i] else math.inf
            if not math.isfinite(e) or r > worst[0]:
                worst = (r if math.isfinite(e) else math.inf, k, i)
        if not s.total_err <= tol_total:
            why.append(f"gradient differs from eager at step {k + 1}: relative L2 {s.total_err:.3g} "
                       f"(tolerance {tol_total:.2g} = {_of(tol_total, factor, noise_total)})")
        dl = abs(s.loss_c - s.loss_e) / max(abs(s.loss_e), 1e-12)
        if not dl <= tol_loss:
            why.append(f"loss differs from eager at step {k + 1}: {s.loss_c:.6g} vs {s.loss_e:.6g} "
                       f"(relative {dl:.2g}, tolerance {tol_loss:.2g})")
    if worst[0] > 1.0 and not why:
        r, k, i = worst
        why.append(f"gradient of {names[i]} differs from eager at step {k + 1}: relative L2 "
                   f"{steps[k].grad_err[i]:.3g} (tolerance {tol_p[i]:.2g} = {_of(tol_p[i], factor, noise_p[i])})")
    for j, (lc, le) in enumerate(replay):
        dl = abs(lc - le) / max(abs(le), 1e-12)
        if not dl <= tol_loss:
            why.append(f"replay: loss on batch {[0, 1, 2, 0][j % 4]} (call {j + 1}) is {lc:.6g}, eager {le:.6g}: "
                       "a stale input or weight is replayed")
            break
    learned = None
    if learn is not None:
        curve_c, curve_e = learn        # the losses, compiled and eager (lc, le above: the replay's)
        drop_c, drop_e = curve_c[0] - curve_c[-1], curve_e[0] - curve_e[-1]
        learned = {"compiled_drop": drop_c, "eager_drop": drop_e}
        if drop_e > tol_loss * abs(curve_e[0]) and not abs(drop_c - drop_e) <= 0.5 * drop_e:
            why.append(f"learnability: on one repeated batch the loss fell by {drop_c:.4g} in {len(curve_c) - 1} "
                       f"steps, eager's by {drop_e:.4g}: the updates do not train the same model")
    return {
        "ok": not why, "why": why[0] if why else None, "reasons": why,
        "grad_err": max((s.total_err for s in steps), default=None),
        "grad_tol": tol_total, "grad_noise": noise_total,
        "grad_err_worst_param": names[worst[2]] if steps and n else None,
        "grad_err_worst_ratio": worst[0] if math.isfinite(worst[0]) else None,
        "loss_err": max((abs(s.loss_c - s.loss_e) for s in steps), default=None),
        "loss_tol_rel": tol_loss,
        "per_step": [{"loss": s.loss_c, "eager_loss": s.loss_e, "grad_err": s.total_err,
                      "grad_noise": s.total_noise} for s in steps],
        "replay": [list(p) for p in replay], "learn": learned,
    }


def _of(tol: float, factor: float, noise: float) -> str:
    """How a tolerance came about: factor x the noise, or the limit it was capped at."""
    return f"{'' if tol == factor * noise else 'the limit, below '}{factor:g} x noise {noise:.2g}"


# ---- the trainer's first-step guard ---------------------------------------------------------------

class CompiledStepWrong(TrainerError):
    """The first compiled step's gradient is not eager's: training on would train another model."""

    def __init__(self, where: str, policy: str, err: float, tol: float, loss_c: float, loss_e: float):
        self.err, self.tol = err, tol
        super().__init__(
            f"{where}: compile policy {policy} computes a different gradient than eager on the same weights "
            f"and batch (relative L2 {err:.3g} > {tol:g}; loss {loss_c:.6g} vs eager {loss_e:.6g}) "
            "(signature compiled-wrong)")


@dataclass
class GuardResult:
    err: float
    tol: float
    loss_c: float
    loss_e: float
    seconds: float


def guard_first_step(r, shard, loss_c: float, *, reduce=None) -> GuardResult:
    """After the first compiled step of replica `r` on `shard`, compute the same step eagerly (r's
    uncompiled DraftLoss, same weights, same shard) and compare gradients; raise CompiledStepWrong
    when they differ. `reduce(flat)` sums the eager gradient across ranks where the compiled one was
    (DDP). The compiled gradients are put back afterwards, so the run computes exactly what it would
    without the guard. Runs in the replica's own thread."""
    t = time.perf_counter()
    compiled = _copy_grads(r.params)
    loss_e = eager_grads(r, shard)
    eager = _copy_grads(r.params)
    if reduce is not None:
        flat = torch.cat([g.flatten().float() for g in eager])
        reduce(flat)
        eager = [chunk.view_as(g).to(g.dtype) for chunk, g in zip(flat.split([g.numel() for g in eager]), eager)]
    _, err = grad_errors(compiled, eager)
    with torch.no_grad():
        for p, g in zip(r.params, compiled):
            if p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)
    dtype = torch.bfloat16 if r.device.type == "cuda" else next(iter(r.params)).dtype
    tol = GUARD_TOLERANCE.get(dtype, 0.1)
    res = GuardResult(err, tol, loss_c, loss_e, time.perf_counter() - t)
    loss_err = abs(loss_c - loss_e) / max(abs(loss_e), 1e-12)
    if not (err <= tol and loss_err <= tol):
        raise CompiledStepWrong(f"worker {r.index} ({r.device})", r.policy, err, tol, loss_c, loss_e)
    return res
