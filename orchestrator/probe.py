"""`probe`: run the probe program (`python -m trainer.probe`, shipped in the release) on each
target in one round trip, targets in parallel, and collect its JSON document.

The program itself (build report, compile modes, the policy x topology matrix, the choice and
WORKDIR/probe.json) lives in trainer/probe.py: it needs only torch and runs on the target.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import playbooks

from .errors import OpsError, StepFailed, UsageError
from .inventory import Inventory, Target
from .lines import LineBuffer
from .transport import Session

TOTAL_TIMEOUT_S = 4 * 3600   # the program's own per-case timeouts end hung cases long before


def probe_argv(target: Target, threads: int, *, policies: list[str] | None = None,
               case_timeout: float | None = None) -> list[str]:
    """The command run on the target (playbooks/probe.sh): pure, so tests can assert on it."""
    args = ["--threads", str(threads)]
    if case_timeout:   # else the program's default: 600 s a case on CUDA, 300 s on CPU
        args += ["--timeout", str(int(case_timeout))]
    if target.expect:
        args += ["--expect", json.dumps(dict(target.expect))]
    if policies:
        args += ["--policies", ",".join(policies)]
    return playbooks.argv("probe.sh", target.workdir, target.python, *args)


def probe_target(session: Session, target: Target, threads: int, *, policies=None,
                 on_line: Callable[[str, str], None] | None = None,
                 case_timeout: float | None = None) -> dict:
    t = session.transport(target)
    lines = LineBuffer(lambda line: on_line(target.name, line)) if on_line else None
    tail: list[str] = []

    def keep(data: bytes) -> None:
        tail.append(data.decode(errors="replace"))
        del tail[:-50]
        if lines:
            lines(data)

    start = time.monotonic()
    r = t.run(probe_argv(target, threads, policies=policies, case_timeout=case_timeout),
              stderr=keep, timeout=TOTAL_TIMEOUT_S)
    if lines:
        lines.flush()
    err = "".join(tail)
    if r.exit_code == 86:
        raise UsageError(f"{target.name}: no release deployed; run `dflash-ops deploy {target.name}` first")
    if r.exit_code != 0:
        raise StepFailed(target.name, "python -m trainer.probe", r.exit_code, err)
    try:
        doc = json.loads(r.stdout.decode())
    except ValueError:
        raise StepFailed(target.name, "python -m trainer.probe", r.exit_code,
                         "the probe printed no JSON document") from None
    doc["ok"] = True
    doc["seconds"] = round(time.monotonic() - start, 2)
    return doc


def probe(inventory: Inventory, names: list[str], *, gpus: int | None = None,
          policies: list[str] | None = None, on_line=None, case_timeout: float | None = None,
          session: Session | None = None) -> dict:
    """{"targets": {NAME: probe document | {"ok": False, "error": ...}}}"""
    targets = inventory.select(names)
    own = session is None
    session = session or Session(inventory)

    def one(target: Target) -> tuple[str, dict]:
        threads = max(2, gpus if gpus is not None else target.gpus)
        try:
            return target.name, probe_target(session, target, threads, policies=policies,
                                             on_line=on_line, case_timeout=case_timeout)
        except OpsError as e:
            return target.name, {"ok": False, "error": e.render(), "cases": [], "policy": None}

    try:
        with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
            return {"targets": dict(pool.map(one, targets))}
    finally:
        if own:
            session.close()
