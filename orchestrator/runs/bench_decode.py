"""`bench-decode`: decoding with a run's trained drafter against the target alone, measured on the target.

The runs agent's `bench` verb (remote/runs/bench.py) exports the run's drafter (float32) into a
private temporary folder on the target and runs `python -m trainer.specdec` of the live release
there against the run's own --target: every prompt decoded both ways, the outputs compared token
for token (lossless), tokens/s alone and with the drafter, tau. The prompts are a local JSONL file
(checked here as trainer.regen reads it, then sent on the agent's stdin) or, by default, the rows
the run's trainer held out for its eval. specdec's live lines come back on the agent's stderr. The
agent holds one free GPU of the target (or its CPU slot) for the whole measurement, as a launch
would; none free is refused (exit 1) naming the runs that hold them.

The measurement lives only as long as this call: the agent's stdin stays open until it ends
(hold.Hold), and EOF there (this process killed, timed out, its connection dropped) ends it
on the target within seconds, worker, slot and temporary folder included. Ctrl-C or SIGTERM here
hangs up first and waits for that end, then raises errors.Interrupted (exit 130 / 143). While it runs,
`status` shows it as `bench-PID` (kind bench-decode) and `stop TARGET bench-PID` ends it.
Library function: returns data, never prints.
"""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Callable

from orchestrator.errors import ContainerError, Interrupted, OpsError, StepFailed, Terminated, UsageError
from orchestrator.inventory import Inventory, Target
from orchestrator.lines import LineBuffer
from orchestrator.runs.export import refusal as export_refusal
from orchestrator.runs.regen import check_prompts
from orchestrator.ssh import agent_call
from orchestrator.ssh.session import owned_session
from orchestrator.ssh.session import Session
from orchestrator.ssh.hold import Hold
from trainer.controller_view import agreement, tau_text

TIMEOUT_S = 6 * 3600.0
ENGINES = ("graphs", "eager")           # trainer.specdec --engine: CUDA graphs over static caches, or eager code
DTYPES = ("auto", "float32", "bfloat16")  # --dtype: auto is bfloat16 on a GPU, float32 on a CPU


class NotLossless(OpsError):
    """Decoding with the drafter gave other tokens than the target alone (exit 1)."""


def bench_decode(inv: Inventory, target: Target, run: str = "latest", *, prompts: str | None = None,
                 max_new_tokens: int = 128, limit: int | None = None, step: int | None = None,
                 running_ok: bool = False, target_changed_ok: bool = False, gpu: int | None = None,
                 engine: str = "graphs", dtype: str = "auto", progress: Callable[[str], None] | None = None,
                 session: Session | None = None) -> dict:
    """specdec's document of RUN's drafter (default: the newest succeeded run; its last checkpoint,
    or `step`; on GPU `gpu` or any free one) with target, run, step, gpu and the prompts' source
    ("held-out" or the local file); "target" is the inventory's name, "model" the run's --target;
    "notes": what the target warned of. progress(line) gets specdec's live lines. Raises NotFound
    (no such run), UsageError (bad input, a regen run), NotLossless, OpsError (no free GPU, the
    measurement failed)."""
    if max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    if limit is not None and limit < 1:
        raise UsageError("--limit must be at least 1")
    if step is not None and step < 0:
        raise UsageError("--step must be >= 0")
    if gpu is not None and not 0 <= gpu < target.gpus:
        raise UsageError(f"--gpu {gpu}: {target.name} has "
                         + (f"GPUs 0..{target.gpus - 1}" if target.gpus else "no GPUs (gpus: 0 in the inventory)"))
    data = None
    if prompts is not None:
        check_prompts(prompts)
        data = Path(prompts).expanduser().read_bytes()
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine}: one of {', '.join(ENGINES)}")
    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: one of {', '.join(DTYPES)}")
    args = ["bench", target.workdir, "--max-new-tokens", str(max_new_tokens), "--gpus", str(target.gpus),
            "--engine", engine, "--dtype", dtype]
    for flag, value in (("--step", step), ("--limit", limit), ("--gpu", gpu)):
        if value is not None:
            args += [flag, str(value)]
    args += ["--running-ok"] * running_ok + ["--target-changed-ok"] * target_changed_ok
    if data is not None:        # the prompts' length: what follows on the agent's stdin is only its EOF
        args += ["--prompts-bytes", str(len(data))]
    args += ["--", run]
    lines, hold = LineBuffer(progress or (lambda line: None)), Hold(data or b"")
    try:
        with owned_session(inv, session) as s:
            doc = agent_call.call(s.transport(target), target, agent_call.RUNS, args, what="measure decoding",
                             stdin=hold, stderr=lines, timeout=TIMEOUT_S)
    except agent_call.Refused as e:
        raise _refusal(target, run, e) from None
    except ContainerError as e:
        if e.under is None:
            raise
        # the container went down under the measurement (or was found down): every process of it ended there
        raise OpsError(f"{target.name}: run {run}: the measurement ended with its container: CT {e.vmid} {e.message}; "
                       f"nothing measured; its slot is free once the container runs again") from None
    except StepFailed as e:
        if e.exit_code_remote in (128 + 9, 128 + 15):   # the agent itself killed (stop --force, the OOM killer)
            raise OpsError(f"{target.name}: run {run}: the measurement's agent on the target was killed (exit "
                           f"{e.exit_code_remote}); nothing measured; its worker ended with it, and the next launch or "
                           f"bench-decode there takes its slot") from None
        raise
    except KeyboardInterrupt as e:      # Ctrl-C, or SIGTERM as errors.Terminated (ui.sigterm_raises)
        signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
        end = ("the measurement on the target ended and its slot is free" if hold.ended else
               f"the target did not confirm its end within {hold.grace_s:g} s; it ends when it sees the connection "
               f"gone (`dflash-ops status {target.name}` shows it while it runs)")
        raise Interrupted(signum, f"{target.name}: bench-decode interrupted ({signum.name}): {end}") from None
    finally:
        lines.flush()
    result = dict(doc["result"])
    result.pop("drafter", None)     # the target's temporary folder, gone
    # "model" is the run's --target here; specdec's model of the round costs goes on as "cost_model"
    return {**result, "target": target.name, "model": result.get("target"), "cost_model": result.get("model"),
            "run": doc["run"], "step": doc["step"],
            "running": bool(doc.get("running")), "gpu": doc.get("gpu"), "notes": doc.get("notes") or [],
            "prompts_source": doc["prompts_source"] if prompts is None else str(Path(prompts).expanduser())}


def _refusal(target: Target, run: str, refused: agent_call.Refused) -> OpsError:
    t, head = target.name, refused.doc
    if refused.reason == "not_lossless":
        return NotLossless(f"{t}: run {head.get('run')}: {head.get('message')}")
    if refused.reason in ("bench", "no_prompts", "no_drafter", "busy", "bad_gpu", "stopped"):
        msg = f"{t}: run {head.get('run')}: cannot measure decoding: {head.get('message')}"
        return UsageError(msg) if head.get("exit_code") == 2 else OpsError(msg)
    return export_refusal(target, run, refused, "measure")


def summary(doc: dict) -> str:
    """The one line, as specdec's own: the agreement with the target alone first ("lossless" only
    where every output is equal), then tau and the speedup with their per-prompt intervals over the
    headline's prompts (one-token prompts left out), against the target alone in the same mode."""
    n = doc.get("headline_prompts", doc["prompts"])
    tau = f"tau {tau_text(doc['tau'], doc.get('tau_ci95'), doc.get('rounds'), digits=2)}"
    mode = (doc.get("mode") or {}).get("spec") or doc.get("engine", "eager")
    speedup = f"speedup {doc['speedup']:.2f}x"
    ci = doc.get("speedup_ci95")
    if ci:
        speedup += f" (95% {ci[0]:.2f}-{ci[1]:.2f}x, median per prompt {doc['speedup_median']:.2f}x)"
    speedup += f" against the target alone, both {mode}"
    if doc["speedup"] < 1:
        speedup += ": SLOWER than the target alone"
    need = (doc.get("cost_model") or {}).get("tau_for_2x")
    if need and doc["speedup"] < 2:     # what the drafter must reach at these costs (docs/decoding.md)
        speedup += f"; 2x needs tau {need:.2f}"
    left = f", {doc['one_token_prompts']} one-token prompt(s) left out" if doc.get("one_token_prompts") else ""
    loops = f"; {doc['loop_prompts']} output(s) end in a loop" if doc.get("loop_prompts") else ""
    return (f"{doc['target']}: run {doc['run']} step {doc['step']}: {agreement(doc)}; {n} prompts "
            f"({doc['prompts_source']}{left}), {doc['tokens']} tokens, {doc.get('dtype', 'float32')}: {tau}; "
            f"{doc['target_tokens_per_s']:.1f} tokens/s alone, {doc['spec_tokens_per_s']:.1f} with the drafter, "
            f"{speedup}{loops}")


__all__ = ["bench_decode", "summary", "NotLossless"]
