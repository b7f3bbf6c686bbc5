"""A run as a job of one or more nodes: launch, follow and stop go through here whatever the
number of nodes. Over several nodes it is one DDP job, one torchrun per target, joined by
torchrun's c10d rendezvous (docs/nodes-internals.md).

`launch` starts the same run id on every target at once (fanout.fan_out), the first target
hosting the rendezvous at its `train_address:train_port`; when any target refuses or fails, the
others are undone (their trainers killed, their slots freed, a new run's folder removed) before
the error is raised. Each target keeps its own run record and lock; the record names the job's
targets (`nodes`), so `status`, `logs`, `stop`, `report` and `export` find the other nodes from
any one of them. The trainer writes node.json on each node (its node rank): rank 0's node holds
the metrics and is what `report` and `export` read.

Library functions: they return data or raise OpsError; never print.
"""
from __future__ import annotations

import queue
import signal
import threading
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

from orchestrator.ssh import agent_call
from orchestrator.ssh import fanout
from orchestrator.ssh.session import owned_session
from orchestrator.errors import Interrupted, OpsError, Terminated, UsageError, get_from
from orchestrator.inventory import Inventory, Target
from orchestrator.runs.options import LaunchOptions
from orchestrator.runs.launch import LaunchResult, launch_on, launch_spec, new_run_id
from orchestrator.runs.status import call_about_run, exit_code_for, job_state, not_found, status_docs
from orchestrator.ssh.session import Session

UNDO_TIMEOUT_S = 30.0


class NodesFailed(OpsError):
    """A launch over several targets failed on some; the others were undone (exit 1)."""


# --- launch -------------------------------------------------------------------------------------

@dataclass
class NodesLaunch:
    """A launched job: its run id, what each node started, the rendezvous (None on one node)."""
    run: str
    nodes: list[LaunchResult]
    endpoint: str | None

    @property
    def target(self) -> str:
        return self.nodes[0].target

    def as_json(self) -> dict:
        """One node: its LaunchResult's document; several: the job's, each node's inside."""
        first = self.nodes[0]
        if len(self.nodes) == 1:
            return first.as_json()
        return {"target": first.target, "run": self.run, "pid": first.pid, "endpoint": self.endpoint,
                "targets": [n.target for n in self.nodes], "nodes": [n.as_json() for n in self.nodes]}


def check_targets(targets: Sequence[Target], opts: LaunchOptions) -> str:
    """The rendezvous endpoint (the first target's train_address:train_port), every target checked
    (a resumed run keeps its own topology)."""
    if opts.topology != "processes" and opts.resume is None:
        raise UsageError(f"several targets ({', '.join(t.name for t in targets)}) run one job under "
                         f"--topology processes (torchrun on each); add --topology processes")
    if opts.gpu_ids is not None:
        raise UsageError("--gpu-ids names GPUs of one target; with several targets use --gpus N")
    for t in targets:
        if not t.train_address:
            raise UsageError(f"{t.name}: a launch over several targets needs `train_address:` in hosts.yaml "
                             f"(targets.{t.name}): the container's address on the training network, "
                             f"which the other nodes dial")
    return f"{targets[0].train_address}:{targets[0].train_port}"


def launch(inv: Inventory, targets: Sequence[Target], opts: LaunchOptions, *,
           session: Session | None = None) -> NodesLaunch:
    """One job over `targets`, all started at once with the same run id: one node, or torchrun on
    each of several, joined at the first one's rendezvous endpoint. A failure on one of several
    undoes the others (NodesFailed); on one node its own error is raised."""
    several = len(targets) > 1
    endpoint = check_targets(targets, opts) if several else None
    run = opts.resume or new_run_id(targets[0].name)
    names = [t.name for t in targets]
    specs = {}
    for i, t in enumerate(targets):
        spec = launch_spec(inv, t, opts, run=run, nnodes=len(targets))
        if several:
            spec.doc["nodes"] = {"targets": names, "index": i, "endpoint": endpoint, "address": t.train_address}
        specs[t.name] = spec
    with owned_session(inv, session) as s:
        try:
            group = fanout.fan_out(targets, lambda t: launch_on(s, t, specs[t.name]), interrupted=s.close)
        except KeyboardInterrupt as e:
            # Its connections closed: an agent still reading the launch (a regen's upload) ends at the
            # short stream and starts nothing; one past it finishes the launch (crash-safe on the target).
            raise launch_interrupted(e, names, run) from None
        if group.failures and not several:
            raise group[names[0]].error
        if group.failures:
            started = [t for t in targets if group[t.name].ok]
            undo = _undo(s, started, run, fresh=opts.resume is None)
            undone = [t.name for t in started if undo[t.name].ok]
            said = f" (run {run} undone on {', '.join(undone)}: nothing left running or locked there)" \
                if undone else ""
            said += "".join(f"; could not undo it on {name} ({err}): stop it with "
                            f"`dflash-ops stop {name} {run} --force`" for name, err in undo.failures.items())
            raise NodesFailed("; ".join(group.failures.values()) + said)
    return NodesLaunch(run=run, nodes=[group[n].value for n in names], endpoint=endpoint)


def launch_interrupted(e: KeyboardInterrupt, names: Sequence[str], run: str) -> Interrupted:
    """The one line of a launch interrupted (Ctrl-C, or SIGTERM as errors.Terminated) while its agents
    ran: the run may have started; how to see it and stop it."""
    signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
    return Interrupted(signum, f"{', '.join(names)}: launch interrupted ({signum.name}): run {run} may have "
                               f"started there; `dflash-ops status {names[0]} {run}` says, "
                               f"`dflash-ops stop {names[0]} {run}` stops it")


def _undo(s: Session, targets: Sequence[Target], run: str, fresh: bool) -> fanout.GroupResult:
    """Kill the run on these targets and free its slots; a new run's folder goes too (a resumed
    run's folder is the user's: it stays, its attempt recorded as stopped)."""
    def one(t: Target) -> None:
        agent_call.call(s.transport(t), t, agent_call.RUNS, ["stop", t.workdir, "--force", "--timeout",
                                                   str(UNDO_TIMEOUT_S), "--", run],
                   what="undo the launch", timeout=UNDO_TIMEOUT_S + 60)
        if fresh:
            agent_call.call(s.transport(t), t, agent_call.RUNS, ["rm", t.workdir, "--", run], what="undo the launch",
                       timeout=120)
    return fanout.fan_out(targets, one)


# --- the nodes of a run -------------------------------------------------------------------------

def run_nodes(inv: Inventory, target: Target, run: str, s: Session) -> tuple[str, list[tuple[Target, dict]]]:
    """(run id, [(target, its status doc)]) for the run on `target`: that target alone for a run on
    one node, every node of the job otherwise (in launch order). NotFound without the run."""
    doc = call_about_run(s, target, run, ["status", target.workdir, "--", run], "read the run", 60)
    if not doc["runs"]:
        raise not_found(target, run)
    mine = doc["runs"][0]
    names = mine.get("nodes") or [target.name]
    missing = [n for n in names if n not in inv.targets]
    if missing:
        raise UsageError(f"run {mine['run']} ran on {', '.join(names)}; hosts.yaml does not define "
                         f"{', '.join(missing)}")
    others = [inv.targets[n] for n in names if n != target.name]
    group = status_docs(s, others, {t.name: [mine["run"]] for t in others}, "read the run")
    docs = {target.name: mine}
    for name, outcome in group.items():
        if outcome.ok and outcome.value["runs"]:
            docs[name] = outcome.value["runs"][0]
        elif outcome.ok:
            docs[name] = {"run": mine["run"], "state": "missing"}
        else:
            raise outcome.error
    return mine["run"], [(inv.targets[n], docs[n]) for n in names]


def rank0(nodes: list[tuple[Target, dict]]) -> Target:
    """The node that ran rank 0 (its node.json), else the first (the run has not met yet)."""
    for t, doc in nodes:
        if (doc.get("node") or {}).get("rank0"):
            return t
    return nodes[0][0]


def rank0_of(inv: Inventory, target: Target, run: str, session: Session | None = None) -> Target:
    """The target whose node ran rank 0 of the run (`target` itself for a run on one node)."""
    with owned_session(inv, session) as s:
        _, nodes = run_nodes(inv, target, run, s)
    return rank0(nodes)


def stop(inv: Inventory, target: Target, run: str, *, force: bool, timeout: float,
         session: Session | None = None) -> list[tuple[str, dict]]:
    """SIGTERM (SIGKILL with force) to the run on every node at once: [(target, stop document)]."""
    with owned_session(inv, session) as s:
        rid, nodes = run_nodes(inv, target, run, s)
        options = ["--timeout", str(timeout)] + (["--force"] if force else []) + ["--", rid]
        group = fanout.fan_out([t for t, _ in nodes], lambda t: agent_call.call(
            s.transport(t), t, agent_call.RUNS, ["stop", t.workdir, *options], what="stop the run",
            timeout=timeout + 60))
    group.raise_failures()
    return [(name, dict(o.value, target=name)) for name, o in group.items()]


# --- logs ---------------------------------------------------------------------------------------

@dataclass
class NodeEvent:
    """An event of one node's follow (follow.Line, Reconnecting, Resumed), tagged with the node."""
    target: str
    event: object


@dataclass
class JobSummary:
    run: str
    state: str
    exit_code: int
    targets: list[str]
    nodes: dict = field(default_factory=dict)      # target -> follow.Summary as JSON
    root_cause: dict | None = None                  # the first failing node's: target, rank, signature, ...
    step: int | None = None
    loss: float | None = None
    tau: float | None = None

    def as_json(self) -> dict:
        return asdict(self)


@dataclass
class Job:
    """The first event of a follow: the run and its nodes (one target for a run on one node)."""
    run: str
    targets: list[str]


@dataclass
class _Ended:
    """A node's follower has ended: its summary, or the exception that ended it."""
    target: str
    summary: object = None
    error: BaseException | None = None


def follow(inv: Inventory, target: Target, run: str = "latest", *, follow: bool = True,
           tail: int | None = None, session: Session | None = None, catalog=None) -> Iterator:
    """Follow every node of the run at once (a run on one node is a job of one): Job first, then a
    NodeEvent per node event as it comes, then the summary: the node's follow.Summary for a job of
    one node, one JobSummary for several. A node that could not be followed raises its error once
    every node has ended; a bug in a follower (not an OpsError) is raised as soon as it happens."""
    from orchestrator.runs import follow as follow_mod

    with owned_session(inv, session) as s:
        rid, nodes = run_nodes(inv, target, run, s)
        names = [t.name for t, _ in nodes]
        yield Job(rid, names)
        events: queue.Queue = queue.Queue()

        def one(t: Target) -> None:
            done = _Ended(t.name)
            try:
                for ev in follow_mod.follow(inv, t, rid, follow=follow, tail=tail, session=s, catalog=catalog):
                    if isinstance(ev, follow_mod.End):
                        done.summary = ev.summary
                    else:
                        events.put(NodeEvent(t.name, ev))
            except BaseException as e:   # noqa: BLE001 - handed to the consumer, which raises it
                done.error = e
            finally:                     # whatever happened, the consumer learns this node ended
                events.put(done)

        for t, _ in nodes:  # a thread each: a follower streams until its node ends, so no pool (fan_out's
            threading.Thread(target=one, args=(t,), daemon=True).start()  # caps workers) may make one wait
        ended: dict[str, _Ended] = {}
        while len(ended) < len(nodes):
            ev = get_from(events)     # in slices: a signal a follower thread takes still ends the follow
            if not isinstance(ev, _Ended):
                yield ev
                continue
            ended[ev.target] = ev
            if ev.error is not None and not isinstance(ev.error, OpsError):
                raise ev.error
        errors = [e for e in (ended[n].error for n in names) if e is not None]
        if errors:          # a node that could not be followed: its error, not a guess at its state
            raise errors[0]
        summaries = {n: ended[n].summary for n in names if ended[n].summary is not None}
        if len(names) == 1:
            if summaries:
                yield summaries[names[0]]
            return
        yield job_summary(rid, names, summaries, rank0(nodes).name)


def job_summary(run: str, targets: list[str], summaries: dict, first: str) -> JobSummary:
    """One summary for the job: failed if any node failed, the root cause from the node that failed
    first (the earliest end, a node whose ranks another's failure ended coming after any other),
    rank 0's step, loss and tau."""
    from trainer.controller_view import EXIT_PEER_FAILED
    states = [summaries[n].state if n in summaries else "failed" for n in targets]
    state = job_state(states)
    head = summaries.get(first) or next(iter(summaries.values()), None)
    cause = None
    failed = [summaries[n] for n in targets if n in summaries and summaries[n].state == "failed"]
    if failed:
        def ended_by_another(x) -> bool:
            ex = x.exit or {}
            return EXIT_PEER_FAILED in (ex.get("exit_code"), (ex.get("root_cause") or {}).get("exitcode"))
        s = min(failed, key=lambda x: (ended_by_another(x), (x.exit or {}).get("ended_ts") or float("inf")))
        rc = (s.exit or {}).get("root_cause") or {}
        cause = {"target": s.target, "rank": rc.get("rank"), "exitcode": rc.get("exitcode"),
                 "error": rc.get("error"), "error_file": rc.get("error_file"), "signature": s.classified}
    return JobSummary(run=run, state=state, exit_code=exit_code_for(state), targets=targets,
                      nodes={n: summaries[n].as_json() for n in targets if n in summaries}, root_cause=cause,
                      step=head.step if head else None, loss=head.loss if head else None,
                      tau=head.tau if head else None)


__all__ = ["launch", "NodesLaunch", "NodesFailed", "check_targets", "run_nodes", "rank0", "rank0_of", "stop",
           "follow", "Job", "NodeEvent", "JobSummary", "job_summary"]
