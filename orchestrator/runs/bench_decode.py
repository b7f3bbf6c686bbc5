"""`bench-decode`: decoding with a run's trained drafter against the target alone, measured on the target.

The runs agent's `bench` verb (remote/runs/bench.py) exports the run's drafter (float32) into a
private temporary folder on the target and runs `python -m trainer.specdec` of the live release
there against the run's own --target: every prompt decoded both ways, the outputs compared token
for token (lossless), tokens/s alone and with the drafter, tau. The prompts are a local JSONL file
(checked here as trainer.regen reads it, then sent on the agent's stdin) or, by default, the rows
the run's trainer held out for its eval. specdec's live lines come back on the agent's stderr.
Library function: returns data, never prints.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from orchestrator.errors import OpsError, UsageError
from orchestrator.inventory import Inventory, Target
from orchestrator.lines import LineBuffer
from orchestrator.runs.export import _refusal as export_refusal
from orchestrator.runs.regen import check_prompts
from orchestrator.ssh import agent
from orchestrator.ssh.session import Session

TIMEOUT_S = 6 * 3600.0


class NotLossless(OpsError):
    """Decoding with the drafter gave other tokens than the target alone (exit 1)."""


def bench_decode(inv: Inventory, target: Target, run: str = "latest", *, prompts: str | None = None,
                 max_new_tokens: int = 128, limit: int | None = None, step: int | None = None,
                 running_ok: bool = False, progress: Callable[[str], None] | None = None,
                 session: Session | None = None) -> dict:
    """specdec's document of RUN's drafter (default: the newest succeeded run; its last checkpoint,
    or `step`) with target, run, step and the prompts' source ("held-out" or the local file);
    "target" is the inventory's name, "model" the run's --target; "notes": what the target warned
    of. progress(line) gets specdec's live lines. Raises NotFound (no such run), UsageError (bad
    input, a regen run), NotLossless."""
    if max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    if limit is not None and limit < 1:
        raise UsageError("--limit must be at least 1")
    if step is not None and step < 0:
        raise UsageError("--step must be >= 0")
    data = None
    if prompts is not None:
        check_prompts(prompts)
        data = Path(prompts).expanduser().read_bytes()
    args = ["bench", target.workdir, "--max-new-tokens", str(max_new_tokens)]
    for flag, value in (("--step", step), ("--limit", limit)):
        if value is not None:
            args += [flag, str(value)]
    args += ["--running-ok"] * running_ok + ["--prompts-stdin"] * (data is not None) + ["--", run]
    lines = LineBuffer(progress or (lambda line: None))
    try:
        with agent.session(inv, session) as s:
            doc = agent.call(s.transport(target), target, agent.RUNS, args, what="measure decoding", stdin=data,
                             stderr=lines, timeout=TIMEOUT_S)
    except agent.Refused as e:
        raise _refusal(target, run, e) from None
    finally:
        lines.flush()
    result = dict(doc["result"])
    result.pop("drafter", None)     # the target's temporary folder, gone
    return {**result, "target": target.name, "model": result.get("target"), "run": doc["run"], "step": doc["step"],
            "running": bool(doc.get("running")), "notes": doc.get("notes") or [],
            "prompts_source": doc["prompts_source"] if prompts is None else str(Path(prompts).expanduser())}


def _refusal(target: Target, run: str, refused: agent.Refused) -> OpsError:
    t, head = target.name, refused.doc
    if refused.reason == "not_lossless":
        return NotLossless(f"{t}: run {head.get('run')}: {head.get('message')}")
    if refused.reason in ("bench", "no_prompts", "no_drafter"):
        msg = f"{t}: run {head.get('run')}: cannot measure decoding: {head.get('message')}"
        return UsageError(msg) if head.get("exit_code") == 2 else OpsError(msg)
    return export_refusal(target, run, refused)


def summary(doc: dict) -> str:
    """The one line: tau with its interval, tokens/s alone and with the drafter, speedup, lossless."""
    ci = doc.get("tau_ci95")
    tau = f"tau {doc['tau']:.2f}" + (f" (95% {ci[0]:.2f}-{ci[1]:.2f})" if ci else "")
    return (f"{doc['target']}: run {doc['run']} step {doc['step']}, {doc['prompts']} prompts "
            f"({doc['prompts_source']}), {doc['tokens']} tokens: {tau}; "
            f"{doc['target_tokens_per_s']:.1f} tokens/s alone, "
            f"{doc['spec_tokens_per_s']:.1f} with the drafter, speedup {doc['speedup']:.2f}x; "
            f"lossless {'yes' if doc['lossless'] else 'no'}")


__all__ = ["bench_decode", "summary", "NotLossless"]
