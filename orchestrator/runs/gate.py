"""`launch --gate`: the pipeline gate (`python -m trainer.gate`) on the target before the real run.

The gate is a run of kind `gate` (remote/runs/kinds.py): the same launch as a training run (slots,
supervisor, exit.json, `logs`, `status` and `rm` work on it), with the real run's config, trainer
arguments, compile policy and env, on one device of the real run's (the first of --gpu-ids, else one
GPU where the run has any, else the CPU). It overfits one row, exports, decodes that row and passes only
when every draft is accepted; its verdict is the last JSON line of its log (also RUNDIR/gate.json).
The caller launches the real run only after `run_gate` returned a verdict that passed.

Library functions: they return data or raise OpsError; never print (lines go to the caller's on_line).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Callable

from orchestrator.errors import OpsError, StepFailed, UsageError
from orchestrator.inventory import Inventory, Target
from orchestrator.runs import nodes
from orchestrator.runs.launch import check_gpus, launch_spec
from orchestrator.runs.options import LaunchOptions
from orchestrator.ssh.session import Session

# What each stage's failure means, in the words `launch --gate` prints (trainer/gate.py's stages).
BROKE = {"row": "the target could not continue the row's prompt",
         "train": "the loss did not fall",
         "export": "the export does not load",
         "decode": "the decoders disagree (or do not accept the whole block)"}


class GateFailed(OpsError):
    """The gate ran and a stage failed (exit 1): the real run was not launched."""

    def __init__(self, verdict: "Verdict"):
        self.verdict = verdict
        stage = verdict.stage or "?"
        why = verdict.error or "no verdict in its log"
        why = why[len(stage) + 2:] if why.startswith(f"{stage}: ") else why     # trainer.gate leads with the stage
        super().__init__(f"{verdict.target}: the gate failed at {stage}: {BROKE.get(stage, 'see its log')} "
                         f"({why}); the run was not launched "
                         f"(`dflash-ops logs {verdict.target} {verdict.run}` shows the gate's log)")


@dataclass
class Verdict:
    """The gate run's result: passed, else the stage that broke (row, train, export, decode) and why."""
    target: str
    run: str
    passed: bool
    stage: str | None = None
    error: str | None = None
    doc: dict | None = None          # trainer.gate's result document (each stage's figures)
    exit_code: int = 0               # `logs`' exit status of the gate run (0 succeeded, 100 failed, 103 stopped)

    def as_json(self) -> dict:
        return {"target": self.target, "run": self.run, "passed": self.passed, "stage": self.stage,
                "error": self.error, "result": self.doc}


def gate_options(opts: LaunchOptions, target: Target) -> LaunchOptions:
    """The gate's launch options for the real run's `opts` on `target`: the same config, arguments,
    policy and env on one of its devices, labelled as its gate."""
    if opts.resume is not None:
        raise UsageError("--gate checks a new run's pipeline before it starts; a resumed run continues one that "
                         "started: drop --gate (or --resume)")
    gpus = check_gpus(opts, target) or 0        # the real run's request, checked (exit 2) before the gate runs
    ids = opts.gpu_ids[:1] if opts.gpu_ids else None
    label = f"gate of {opts.name}"[:64] if opts.name else "gate"
    return replace(opts, kind="gate", gpus=min(gpus, 1), gpu_ids=ids, workers=None, name=label)


def verdict_of(target: str, run: str, lines: list[str], exit_code: int) -> Verdict:
    """The gate's verdict from its log: the last line that is trainer.gate's result document."""
    doc = None
    for text in reversed(lines):
        if text.startswith("{") and '"passed"' in text:
            try:
                doc = json.loads(text)
                break
            except ValueError:
                continue
    if doc is None:      # it ended before its verdict (killed, stopped, bad input): the log says why
        what = {103: "it was stopped"}.get(exit_code, "it ended without a verdict")
        last = next((t for t in reversed(lines) if t.strip()), "")
        return Verdict(target, run, False, None, f"{what}: {last[-300:]}", None, exit_code)
    passed = bool(doc.get("passed")) and exit_code == 0
    return Verdict(target, run, passed, None if passed else doc.get("failed"), doc.get("error"), doc, exit_code)


def run_gate(inv: Inventory, target: Target, opts: LaunchOptions, *, session: Session,
             on_line: Callable[[str], None] = lambda text: None,
             on_start: Callable[[str], None] = lambda run: None) -> Verdict:
    """Launch the gate for the real run's `opts` on `target`, follow it to its end (each log line to
    on_line; on_start(run id) once it runs) and return its verdict. The real run's own checks (its
    trainer flags and config, GPUs) are made first, so a typo is exit 2 before the gate takes minutes."""
    from orchestrator.runs import follow as follow_mod

    launch_spec(inv, target, opts)              # the real run's checks (UsageError), nothing sent
    gopts = gate_options(opts, target)
    started = nodes.launch(inv, [target], gopts, session=session)
    run = started.run
    on_start(run)
    lines: list[str] = []
    summary = None
    for ev in follow_mod.follow(inv, target, run, session=session):
        if isinstance(ev, follow_mod.Line):
            lines.append(ev.text)
            del lines[:-200]                    # the verdict is the last JSON line; keep a bounded tail
            on_line(ev.text)
        elif isinstance(ev, follow_mod.End):
            summary = ev.summary
    if summary is None:
        raise StepFailed(target.name, "follow the gate", 1, f"the follow of gate run {run} ended without its end")
    return verdict_of(target.name, run, lines, summary.exit_code)


__all__ = ["run_gate", "gate_options", "verdict_of", "Verdict", "GateFailed", "BROKE"]
