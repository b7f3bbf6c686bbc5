"""`rm` and `prune`: remove ended runs (their logs, checkpoints and records) from a target.

A running run is never removed: `rm` refuses it (naming how to stop it), `prune` keeps it. Both
say what they freed, in bytes. The judging and removing happen on the target, in one agent call
per target, under the runs' slot guard (remote/runs/housekeeping.py). Library code: returns data.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

from orchestrator.ssh import agent
from orchestrator.errors import UsageError
from orchestrator.inventory import Inventory, Target
from orchestrator.runs.options import check_run
from orchestrator.ssh.session import Session


@dataclass
class Removal:
    """What one target freed (or would free, dry_run)."""
    target: str
    removed: list[dict] = field(default_factory=list)    # {"run", "state", "name", "bytes"}
    refused: list[dict] = field(default_factory=list)    # running runs named to rm
    missing: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)        # prune: the newest N and running ones
    freed: int = 0
    dry_run: bool = False

    def as_json(self) -> dict:
        return asdict(self)


def _removal(target: Target, doc: dict) -> Removal:
    return Removal(target.name, doc.get("removed") or [], doc.get("refused") or [],
                   doc.get("missing") or [], doc.get("kept") or [], int(doc.get("freed") or 0),
                   bool(doc.get("dry_run")))


def remove(inv: Inventory, target: Target, runs: Sequence[str], *, dry_run: bool = False,
           session: Session | None = None) -> Removal:
    """Remove the named runs of one target; running ones are refused (left in .refused)."""
    if not runs:
        raise UsageError("name the runs to remove (see `dflash-ops status`)")
    args = ["rm", target.workdir] + (["--dry-run"] if dry_run else []) + ["--", *map(check_run, runs)]
    with agent.session(inv, session) as s:
        return _removal(target, agent.call(s.transport(target), target, agent.RUNS, args,
                                           what="remove runs", timeout=600))


def prune(inv: Inventory, names: Sequence[str], keep: int, *, dry_run: bool = False,
          session: Session | None = None) -> agent.GroupResult:
    """On each target in parallel, remove every ended run but the newest `keep`: a GroupResult
    of Removal."""
    if keep < 0:
        raise UsageError("--keep must be >= 0")
    args = ["--keep", str(keep)] + (["--dry-run"] if dry_run else [])
    with agent.session(inv, session) as s:
        return agent.fan_out(inv.select(list(names)), lambda t: _removal(t, agent.call(
            s.transport(t), t, agent.RUNS, ["prune", t.workdir, *args], what="prune runs", timeout=600)))


__all__ = ["remove", "prune", "Removal"]
