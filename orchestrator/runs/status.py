"""Reading runs, controller side: which run a command names, the runs of each target as status
rows (a job over several nodes merged into one row), a job's state and exit code, and one run's
reply (metrics), with the NotFound that says where to look. Launch is launch.py; stop, over every
node of a job, is nodes.stop.

Library functions: they return data, never print or exit. The run records live on the target
(WORKDIR/runs/RUN/) and are read by the runs agent (remote/runs/), one round trip per call.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from orchestrator.errors import (EXIT_FAILED, EXIT_OK, EXIT_RUN_FAILED, EXIT_RUN_LOST, EXIT_RUN_RUNNING,
                                 EXIT_RUN_STOPPED, NotFound, UsageError)
from orchestrator.inventory import Inventory, Target
from orchestrator.inventory.names import RUN_ID_RE
from orchestrator.runs.options import BENCH_ID_RE, check_run
from orchestrator.ssh import agent_call
from orchestrator.ssh import fanout
from orchestrator.remote.runs.records import LOST    # stdlib only: the state the runs agent judges
from orchestrator.ssh.session import owned_session
from orchestrator.ssh.session import Session

# `unreadable`: the run's records on the target cannot be used (remote/runs/records.py); how it ended
# is not known, so `logs` exits 1, the exit status of a command that could not tell. `lost`: every
# process of the run ended with no exit status, with its container (stopped or restarted under it).
STATE_EXIT = {"succeeded": EXIT_OK, "failed": EXIT_RUN_FAILED, "running": EXIT_RUN_RUNNING,
              "stopped": EXIT_RUN_STOPPED, LOST: EXIT_RUN_LOST, "unreadable": EXIT_FAILED}


def split_target_run(inv: Inventory, args: Sequence[str]) -> tuple[Target, str]:
    """`[TARGET] [RUN]`: one word is a run of the default target when it looks like a run id
    (or is `latest`, or a bench-decode's bench-PID), else a target (an unknown one is an error that
    suggests a near name)."""
    args = list(args)
    if len(args) > 2:
        raise UsageError(f"expected [TARGET] [RUN], got {' '.join(args)}")
    if len(args) == 2:     # TARGET may be T1,T2 or a group: a run over several nodes, found from the first
        return inv.expand(args[0])[0], check_run(args[1])
    if len(args) == 1:      # a bench-decode running is named bench-PID (status shows it; stop takes it)
        if args[0] not in inv.targets and (args[0] == "latest" or RUN_ID_RE.match(args[0])
                                           or BENCH_ID_RE.match(args[0])):
            return inv.default_target(), args[0]
        return inv.expand(args[0])[0], "latest"
    return inv.default_target(), "latest"


def exit_code_for(state: str) -> int:
    return STATE_EXIT.get(state, EXIT_RUN_FAILED)


# --- status -------------------------------------------------------------------------------------

def status(inv: Inventory, names: Sequence[str] = (), *, all_targets: bool = False,
           runs: Sequence[str] = (), session: Session | None = None) -> tuple[list[dict], dict[str, str]]:
    """(rows, errors): the runs of each target (default: the default target), fetched in
    parallel; a row per run, oldest first per target; errors maps a target that could not be
    read to why."""
    targets = list(inv.targets.values()) if all_targets else inv.select(list(names))
    with owned_session(inv, session) as s:
        group = status_docs(s, targets, {t.name: runs for t in targets}, "read the runs")
        rows, errors = [], group.failures
        for name, outcome in group.items():
            doc = outcome.value
            if not outcome.ok:
                continue
            for r in doc["runs"]:
                rows.append({"target": name, **r})
            for r in doc.get("missing") or []:
                errors[name] = f"{name}: no run {r!r}"
        # A run over several nodes is shown once with all its nodes, those not asked about included.
        asked = {t.name for t in targets}
        more: dict[str, list[str]] = {}
        for r in rows:
            for n in r.get("nodes") or []:
                if n not in asked and n in inv.targets and r["run"] not in more.setdefault(n, []):
                    more[n].append(r["run"])
        extra = status_docs(s, [inv.targets[n] for n in more], more, "read the runs")
        for name, outcome in extra.items():
            if outcome.ok:
                rows.extend({"target": name, **r} for r in outcome.value["runs"])
            else:
                errors[name] = outcome.error.render()
    return group_rows(rows), errors


def status_docs(s: Session, targets: Sequence[Target], runs: Mapping[str, Sequence[str]],
                what: str) -> fanout.GroupResult:
    """The runs agent's status document of each target about the runs `runs[target name]` names
    (every run for []), read in parallel: {target: [runs]} -> GroupResult."""
    return fanout.fan_out(targets, lambda t: agent_call.call(s.transport(t), t, agent_call.RUNS,
                                                       ["status", t.workdir, "--", *runs[t.name]],
                                                       what=what, timeout=60))


STATE_ORDER = ("failed", LOST, "running", "unreadable", "stopped", "succeeded")


def job_state(states: Sequence[str]) -> str:
    """One state for the job: failed if any node failed, else lost if a node's run ended with its
    container, else running while any runs, else unreadable if a node's records are, else stopped if
    any stopped, else succeeded."""
    for state in STATE_ORDER:
        if state in states:
            return state
    return states[0] if states else "failed"


def group_rows(rows: list[dict]) -> list[dict]:
    """Status rows with the nodes of one job merged into one row (rank 0's step, loss, tau), with
    `nodes`: [{target, state, node_rank, ranks, pid, exit}]."""
    out: list[dict] = []
    jobs: dict[str, dict] = {}
    for r in rows:
        if not r.get("nodes") or len(r["nodes"]) < 2:
            out.append(r)
            continue
        job = jobs.get(r["run"])
        node = {"target": r["target"], "state": r["state"], "node_rank": (r.get("node") or {}).get("node_rank"),
                "ranks": (r.get("node") or {}).get("ranks"), "pid": r.get("pid"), "exit": r.get("exit")}
        if job is None:
            job = jobs[r["run"]] = dict(r, nodes=[], node=None)
            out.append(job)
        job["nodes"].append(node)
        if (r.get("node") or {}).get("rank0"):
            job.update({k: r.get(k) for k in ("target", "step", "loss", "tau", "steps_per_s", "eta_s", "exit", "log",
                                               "pid")})
    for job in jobs.values():
        job["state"] = job_state([n["state"] for n in job["nodes"]])
    return out


def not_found(target: Target, run: str) -> NotFound:
    """The error for a run the agent did not find, saying where to look."""
    if run in ("", "latest"):
        return NotFound(f"{target.name}: no runs yet in {target.workdir}/runs; start one with "
                        f"`dflash-ops launch {target.name}`")
    return NotFound(f"{target.name}: no run {run!r} (see `dflash-ops status {target.name}`)")


# --- metrics ------------------------------------------------------------------------------------

def metrics(inv: Inventory, target: Target, run: str = "latest", *,
            session: Session | None = None) -> dict:
    """{"run", "status": {...}, "metrics": [the log's JSON metric lines]}."""
    return _one_run(inv, session, target, run, ["metrics", target.workdir, "--", run], "read the metrics", 300)


def _one_run(inv: Inventory, session: Session | None, target: Target, run: str, args: list[str],
             what: str, timeout: float) -> dict:
    """An agent command about one run: its document with "target" added; NotFound without it."""
    with owned_session(inv, session) as s:
        doc = call_about_run(s, target, run, args, what, timeout)
    doc["target"] = target.name
    return doc


def call_about_run(s: Session, target: Target, run: str, args: list[str], what: str, timeout: float) -> dict:
    """The runs agent's reply to a command about one run; NotFound (saying where to look) when the
    agent does not find the run."""
    try:
        return agent_call.call(s.transport(target), target, agent_call.RUNS, args, what=what, timeout=timeout)
    except agent_call.Refused as e:
        if e.reason == "not_found":
            raise not_found(target, run) from None
        raise


__all__ = ["LOST", "split_target_run", "exit_code_for", "status", "status_docs", "job_state", "group_rows", "not_found",
           "metrics", "call_about_run"]
