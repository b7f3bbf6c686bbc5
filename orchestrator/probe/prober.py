"""`probe`: run the probe program (`python -m trainer.probe`, shipped in the release) on each
target through the runs agent's `probe` command, targets in parallel, and collect its document.

The program itself (build report, compile modes, the policy x topology matrix, the choice and
WORKDIR/probe.json) lives in trainer/probe/program.py: it needs only torch and runs on the target.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable

from trainer.controller_view import EMULATE_ALONE   # torch-free

from orchestrator.ssh import agent_call
from orchestrator.ssh import fanout
from orchestrator.ssh.session import owned_session
from orchestrator.errors import OpsError, UsageError
from orchestrator.inventory import Inventory, Target
from orchestrator.lines import LineBuffer
from orchestrator.ssh.session import Session

TOTAL_TIMEOUT_S = 4 * 3600   # the program's own per-case timeouts end hung cases long before
REUSE_IS_BF16 = ("--reuse keeps the saved result, which is bf16's; a --precision fp8* probe is "
                 "reported, never saved: drop --reuse (its cases' verdicts are still reused)")


@dataclass(frozen=True)
class Matrix:
    """What to ask of the probe on a target: the program's arguments (after `--`) and whether the
    saved result may stand instead (reuse, the agent's own option). Empty or None: the program's
    default (every policy but max-autotune-no-cudagraphs; both topologies on CUDA; 600 s a case on
    CUDA, 300 on CPU; bf16). A combination that cannot work is refused here, before anything connects."""
    policies: tuple[str, ...] = ()
    topologies: tuple[str, ...] = ()
    case_timeout: float | None = None
    fresh: bool = False                # run every case again instead of reusing the kept verdicts
    precision: str = "bf16"            # fp8*: the trainer's fp8 path, reported, never saved as the choice
    fp8_emulate: bool = False          # fp8's rounding without FP8 hardware (a CPU target)
    reuse: bool = False                # the saved WORKDIR/probe.json when the torch installed now made it

    def __post_init__(self):
        if self.fp8_emulate and self.precision == "bf16":
            raise UsageError(EMULATE_ALONE)
        if self.reuse and self.precision != "bf16":
            raise UsageError(REUSE_IS_BF16)


def probe_args(target: Target, threads: int, matrix: Matrix = Matrix()) -> list[str]:
    """The agent command run on the target: pure, so tests can assert on it. The probe's own
    arguments are values, after `--`."""
    args = ["--threads", str(threads)]
    if matrix.case_timeout:
        args += ["--timeout", str(int(matrix.case_timeout))]
    if target.expect:
        args += ["--expect", json.dumps(dict(target.expect))]
    if matrix.policies:
        args += ["--policies", ",".join(matrix.policies)]
    if matrix.topologies:
        args += ["--topologies", ",".join(matrix.topologies)]
    if matrix.fresh:
        args += ["--fresh"]
    if matrix.precision != "bf16":
        args += ["--precision", matrix.precision, *(["--fp8-emulate"] if matrix.fp8_emulate else [])]
    return ["probe", target.workdir, *(["--reuse"] if matrix.reuse else []), "--", *args]


def probe_target(session: Session, target: Target, threads: int, matrix: Matrix = Matrix(), *,
                 on_line: Callable[[str, str], None] | None = None) -> dict:
    """The probe's document for one target (with matrix.reuse and the saved result standing, that
    result, with "reused": the time it was made)."""
    lines = LineBuffer(lambda line: on_line(target.name, line)) if on_line else None
    start = time.monotonic()
    try:
        doc = agent_call.call(session.transport(target), target, agent_call.RUNS,
                         probe_args(target, threads, matrix),
                         what="python -m trainer.probe", stderr=lines or (lambda data: None),
                         timeout=TOTAL_TIMEOUT_S)["probe"]
    except agent_call.Refused as e:
        if e.reason == "no_release":
            raise OpsError(f"{target.name}: no release deployed in {target.workdir}; "
                           f"run `dflash-ops deploy {target.name}` first") from None
        raise
    finally:
        if lines:
            lines.flush()
    doc["ok"] = True
    doc["seconds"] = round(time.monotonic() - start, 2)
    return doc


def probe(inventory: Inventory, names: list[str], matrix: Matrix = Matrix(), *, gpus: int | None = None,
          on_line=None, session: Session | None = None) -> dict:
    """{"targets": {NAME: probe document | {"ok": False, "error": ...}}}"""
    targets = inventory.select(names)
    with owned_session(inventory, session) as s:
        group = fanout.fan_out(targets, lambda target: probe_target(
            s, target, max(2, gpus if gpus is not None else target.gpus), matrix, on_line=on_line))
    return {"targets": {name: o.value if o.ok else
                        {"ok": False, "error": o.error.render(), "cases": [], "policy": None}
                        for name, o in group.items()}}
