"""`rm` and `prune`: remove ended runs (their logs, checkpoints and records) from a target.

A running run is never removed: `rm` refuses it (naming how to stop it), `prune` keeps it. Both
say what they freed, in bytes. A job over several nodes is one run: `rm` of it on one node removes
it on every node of the job (one node's half alone would leave the other's `logs` answering
"no run" for a run that exists). The judging and removing happen on the target, in one agent call
per target, under the runs' slot guard (remote/runs/housekeeping.py). Library code: returns data.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

from orchestrator.ssh import agent_call
from orchestrator.ssh import fanout
from orchestrator.ssh.session import owned_session
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
    unreadable: list[dict] = field(default_factory=list)  # prune: {"run", "reason"}, kept (rm removes one)
    freed: int = 0
    dry_run: bool = False
    nodes: list["Removal"] = field(default_factory=list)   # rm of a job's run: the other nodes' halves

    def as_json(self) -> dict:
        return asdict(self)


def _removal(target: Target, doc: dict) -> Removal:
    return Removal(target.name, doc.get("removed") or [], doc.get("refused") or [],
                   doc.get("missing") or [], doc.get("kept") or [], doc.get("unreadable") or [],
                   int(doc.get("freed") or 0), bool(doc.get("dry_run")))


def remove(inv: Inventory, target: Target, runs: Sequence[str], *, dry_run: bool = False,
           session: Session | None = None) -> Removal:
    """Remove the named runs of one target; running ones are refused (left in .refused). A run of a
    job over several nodes is removed on every node of the job (in .nodes, one Removal each), after
    the named target's; a node hosts.yaml no longer defines is refused before anything is removed."""
    if not runs:
        raise UsageError("name the runs to remove (see `dflash-ops status`)")
    runs = [check_run(r) for r in runs]
    opts = ["--dry-run"] if dry_run else []
    with owned_session(inv, session) as s:
        doc = agent_call.call(s.transport(target), target, agent_call.RUNS, ["status", target.workdir, "--", *runs],
                         what="read the runs", timeout=60)
        elsewhere: dict[str, list[str]] = {}      # other node -> the job runs it holds a half of
        for r in doc["runs"]:
            for name in r.get("nodes") or []:
                if name == target.name:
                    continue
                if name not in inv.targets:
                    raise UsageError(f"run {r['run']} ran on {', '.join(r['nodes'])}; hosts.yaml does not "
                                     f"define {name}, so its half there cannot be removed with the rest")
                elsewhere.setdefault(name, []).append(r["run"])
        res = _removal(target, agent_call.call(s.transport(target), target, agent_call.RUNS,
                                          ["rm", target.workdir, *opts, "--", *runs],
                                          what="remove runs", timeout=600))
        gone = {x["run"] for x in res.removed}   # a running job stays whole: its halves are left too
        for name, job_runs in elsewhere.items():
            mine = [r for r in job_runs if r in gone]
            if mine:
                t = inv.targets[name]
                res.nodes.append(_removal(t, agent_call.call(s.transport(t), t, agent_call.RUNS,
                                                        ["rm", t.workdir, *opts, "--", *mine],
                                                        what="remove the job's half", timeout=600)))
        return res


def prune(inv: Inventory, names: Sequence[str], keep: int, *, dry_run: bool = False,
          session: Session | None = None) -> fanout.GroupResult:
    """On each target in parallel, remove every ended run but the newest `keep`: a GroupResult
    of Removal."""
    if keep < 0:
        raise UsageError("--keep must be >= 0")
    args = ["--keep", str(keep)] + (["--dry-run"] if dry_run else [])
    with owned_session(inv, session) as s:
        return fanout.fan_out(inv.select(list(names)), lambda t: _removal(t, agent_call.call(
            s.transport(t), t, agent_call.RUNS, ["prune", t.workdir, *args], what="prune runs", timeout=600)))


__all__ = ["remove", "prune", "Removal"]
