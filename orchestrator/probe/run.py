"""`probe`: run the probe program (`python -m trainer.probe`, shipped in the release) on each
target through the runs agent's `probe` command, targets in parallel, and collect its document.

The program itself (build report, compile modes, the policy x topology matrix, the choice and
WORKDIR/probe.json) lives in trainer/probe/program.py: it needs only torch and runs on the target.
"""
from __future__ import annotations

import json
import time
from typing import Callable

from orchestrator.ssh import agent
from orchestrator.errors import OpsError
from orchestrator.inventory import Inventory, Target
from orchestrator.lines import LineBuffer
from orchestrator.ssh.session import Session

TOTAL_TIMEOUT_S = 4 * 3600   # the program's own per-case timeouts end hung cases long before


def probe_args(target: Target, threads: int, *, policies: list[str] | None = None,
               case_timeout: float | None = None, reuse: bool = False,
               topologies: list[str] | None = None, fresh: bool = False) -> list[str]:
    """The agent command run on the target: pure, so tests can assert on it. The probe's own
    arguments are values, after `--`."""
    args = ["--threads", str(threads)]
    if case_timeout:   # else the program's default: 600 s a case on CUDA, 300 s on CPU
        args += ["--timeout", str(int(case_timeout))]
    if target.expect:
        args += ["--expect", json.dumps(dict(target.expect))]
    if policies:
        args += ["--policies", ",".join(policies)]
    if topologies:
        args += ["--topologies", ",".join(topologies)]
    if fresh:
        args += ["--fresh"]
    return ["probe", target.workdir, *(["--reuse"] if reuse else []), "--", *args]


def probe_target(session: Session, target: Target, threads: int, *, policies=None,
                 on_line: Callable[[str, str], None] | None = None,
                 case_timeout: float | None = None, reuse: bool = False,
                 topologies: list[str] | None = None, fresh: bool = False) -> dict:
    """The probe's document for one target. reuse: the saved WORKDIR/probe.json when the torch
    installed now made it (the document then has "reused": the time it was made)."""
    lines = LineBuffer(lambda line: on_line(target.name, line)) if on_line else None
    start = time.monotonic()
    try:
        doc = agent.call(session.transport(target), target, agent.RUNS,
                         probe_args(target, threads, policies=policies, case_timeout=case_timeout,
                                    reuse=reuse, topologies=topologies, fresh=fresh),
                         what="python -m trainer.probe", stderr=lines or (lambda data: None),
                         timeout=TOTAL_TIMEOUT_S)["probe"]
    except agent.Refused as e:
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


def probe(inventory: Inventory, names: list[str], *, gpus: int | None = None,
          policies: list[str] | None = None, on_line=None, case_timeout: float | None = None,
          reuse: bool = False, topologies: list[str] | None = None, fresh: bool = False,
          session: Session | None = None) -> dict:
    """{"targets": {NAME: probe document | {"ok": False, "error": ...}}}"""
    targets = inventory.select(names)
    with agent.session(inventory, session) as s:
        group = agent.fan_out(targets, lambda target: probe_target(
            s, target, max(2, gpus if gpus is not None else target.gpus), policies=policies,
            on_line=on_line, case_timeout=case_timeout, reuse=reuse, topologies=topologies, fresh=fresh))
    return {"targets": {name: o.value if o.ok else
                        {"ok": False, "error": o.error.render(), "cases": [], "policy": None}
                        for name, o in group.items()}}
