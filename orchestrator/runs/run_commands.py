"""Click commands of the run lifecycle: launch, logs, status, stop, report, export.

Thin: parse options, call one function of `nodes.py` / `status.py` /
`report.py`, print. How `logs` shows a run is `logview.py`.
"""
from __future__ import annotations

import shlex
import sys

import click

from orchestrator.errors import NotFound, OpsError, TargetsFailed, UsageError
from orchestrator.runs.logview import Seen, fmt_elapsed, fmt_num, fmt_tau, note, print_job
from orchestrator.runs.options import AUTO, DEFAULT_TOPOLOGY, POLICIES, TOPOLOGIES
from orchestrator.ui import State, emit, json_option, sigterm_raises, table


def _split_launch_args(state: State, args: tuple[str, ...]) -> tuple[list, list[str]]:
    """`[TARGET|T1,T2|GROUP] [-- TRAINER_ARGS...]`: the first word names the target(s) unless it is
    a flag; else the default target."""
    if args and not args[0].startswith("-"):
        return state.inv.expand(args[0]), list(args[1:])   # unknown: a clear error with a suggestion
    return [state.inv.default_target()], list(args)


def _note_cleared(launched) -> None:
    """A note per stale slot lock a launch cleared, on any of its nodes."""
    for n in launched.nodes:
        for c in n.cleared:
            note(f"{n.target}: cleared a stale lock on {c['slot']} left by run {c['run']}")


def _devices(gpu_ids) -> str:
    return f"GPU {', '.join(map(str, gpu_ids))}" if gpu_ids else "CPU"


class PassThroughCommand(click.Command):
    """A command whose words after `--` belong to the program it starts (the trainer, regen): an
    unknown option typed before `--` is refused with the line that has it after `--`, not click's
    bare `No such option`. passthrough: what those words are ("trainer flags"); flags: a function
    giving that program's flags, so that one of them gets no `did you mean` of ours."""

    def __init__(self, *args, passthrough: str = "trainer flags", flags=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.passthrough, self.flags = passthrough, flags

    def parse_args(self, ctx, args):
        typed = list(args)      # click's parser consumes the list it is given
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as e:
            raise UsageError(self._after_dashes(ctx, typed, e)) from None

    def _after_dashes(self, ctx, args: list[str], e: click.NoSuchOption) -> str:
        takes_value = {o: not p.is_flag and not p.count for p in self.params if isinstance(p, click.Option)
                       for o in (*p.opts, *p.secondary_opts)}
        end = args.index("--") if "--" in args else len(args)
        head: list[str] = []
        tail: list[str] = []
        i = 0
        while i < end:      # own options (with their values) and the target stay in front; the rest goes after `--`
            w = args[i]
            name = w.split("=", 1)[0]
            if name in takes_value or (not w.startswith("-") and not tail):
                n = 2 if takes_value.get(name) and "=" not in w else 1
                head += args[i:i + n]
                i += n
            else:
                tail.append(w)
                i += 1
        theirs = self.flags is not None and e.option_name in self.flags()
        near = f" (did you mean {' or '.join(sorted(e.possibilities))}?)" if e.possibilities and not theirs else ""
        what = f"{e.option_name} is not an option of `{ctx.command_path}`{near}"
        if self.flags is not None and not theirs and (e.possibilities or not any(
                f.startswith(e.option_name) for f in self.flags())):   # argparse takes a unique prefix
            # a near name of our own (`--gpu` for --gpus), or a flag the program has neither: moving
            # it after `--` would be no cure
            return (f"{what}, nor one of the {self.passthrough} (`{ctx.command_path} --help`; "
                    "`python -m trainer --help`)")
        fixed = " ".join(shlex.quote(w) for w in [*head, "--", *tail, *args[end + 1:]])
        return f"{what}; {self.passthrough} go after `--`: `{ctx.command_path} {fixed}`"


def trainer_flags() -> set[str]:
    """The trainer's flags (its own parser, torch-free)."""
    from trainer.controller_view import build_parser

    return {o for a in build_parser()._actions for o in a.option_strings}


# --- launch --------------------------------------------------------------------------------------

@click.command(cls=PassThroughCommand, flags=trainer_flags)
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[TARGET] [-- TRAINER_ARGS...]")
@click.option("--gpus", type=click.IntRange(min=0), metavar="N",
              help="GPUs to use (default: all of the target's; 0 = CPU).")
@click.option("--gpu-ids", metavar="I,J", help="Exactly these GPUs of the target (e.g. 0,3); sets --gpus.")
@click.option("--name", metavar="NAME", help="A label for the run, shown by status.")
@click.option("--resume", metavar="RUN",
              help="Continue this stopped or failed run from its last checkpoint (same run id, its own settings).")
@click.option("--config", type=click.Path(dir_okay=False), metavar="FILE",
              help="Trainer YAML config; copied into the run's folder.")
@click.option("--topology", type=click.Choice(TOPOLOGIES), default=DEFAULT_TOPOLOGY,
              show_default=True, help="One thread per device, or one process per device.")
@click.option("--compile-policy", "--policy", "compile_policy", type=click.Choice(POLICIES), default=AUTO,
              show_default=True, help="Compile policy; auto = the probe's choice, resolved by the trainer (run "
              "`dflash-ops probe` first). --policy: the same.")
@click.option("--workers", type=click.IntRange(min=1), metavar="K",
              help="With --gpus 0: CPU worker threads.")
@click.option("--follow", is_flag=True, help="Then follow the log, as `logs --follow` does.")
@click.option("--gate", is_flag=True,
              help="First run the pipeline gate (one row overfit, exported, decoded) with the run's config on the "
                   "target; launch only if it passes (exit 1 naming the stage that broke).")
@click.option("--env", "env", multiple=True, metavar="K=V",
              help="Set a variable for the trainer (repeatable; over hosts.yaml env:).")
@json_option
@click.pass_obj
def launch(state: State, args, gpus, gpu_ids, name, resume, config, topology, compile_policy, workers, follow,
           gate, env, as_json):
    """Start the trainer detached from this session; print the run id.

    Trainer flags go after `--`, e.g. `dflash-ops launch ct200 --gpus 2 -- --steps 500`.
    The run holds its GPUs (a CPU run, --gpus 0, holds the target's one CPU slot) until it ends.
    """
    from orchestrator.runs import nodes
    from orchestrator.ssh.session import owned_session as open_session
    from orchestrator.envvars import parse_assignments
    from orchestrator.runs.options import LaunchOptions

    targets, extra = _split_launch_args(state, args)
    opts = LaunchOptions.build(gpus=gpus, gpu_ids=gpu_ids, config=config, topology=topology,
                               compile_policy=compile_policy, workers=workers, extra=extra, name=name, resume=resume,
                               env=parse_assignments(env))
    # SIGTERM as Ctrl-C: a launch under way is cut off saying which run may have started (nodes.launch)
    with sigterm_raises("launch"), open_session(state.inv) as session:   # one connection for launch and follow
        verdict = _gate(state, session, targets[0], opts, as_json) if gate else None
        res = nodes.launch(state.inv, targets, opts, session=session)
        info = _nodes_info(res) if len(res.nodes) > 1 else _launch_info(res.nodes[0])
        _note_cleared(res)
        if verdict is not None and not as_json:
            note(f"the gate (run {verdict.run}) passed: {_passed_text(verdict)}")
        if not follow:
            if as_json:
                emit(True, {**res.as_json(), **({"gate": verdict.as_json()} if verdict else {})}, "")
            else:
                click.echo(res.run)
                note(info + f"; follow it with `dflash-ops logs {res.target} {res.run}`")
            return
        if not as_json:
            note(info)
        follow_launched(state, session, res, {**res.as_json(), **({"gate": verdict.as_json()} if verdict else {})},
                        as_json)


def _gate(state: State, session, target, opts, as_json: bool):
    """`launch --gate`: the gate on the (first) target, its lines on stderr; its verdict when it
    passed, else GateFailed (exit 1) naming the stage. Ctrl-C while it runs leaves it running and
    launches nothing."""
    from orchestrator.errors import Interrupted
    from orchestrator.runs.gate import GateFailed, run_gate

    started: list[str] = []

    def on_start(run: str) -> None:
        started.append(run)
        if not as_json:
            note(f"{target.name}: gate run {run}: one row overfit, exported and decoded with this run's config "
                 f"before the run starts (minutes; `dflash-ops logs {target.name} {run}` shows it)")

    def on_line(text: str) -> None:
        if not as_json and not text.startswith("{"):     # its result document comes back as the verdict
            click.echo(text, err=True)

    try:
        verdict = run_gate(state.inv, target, opts, session=session, on_line=on_line, on_start=on_start)
    except KeyboardInterrupt as e:
        if not started:
            raise
        import signal

        from orchestrator.errors import Terminated
        signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
        raise Interrupted(signum, f"{target.name}: stopped following gate run {started[0]}, which goes on "
                                  f"(`dflash-ops stop {target.name} {started[0]}` stops it); the run was not "
                                  f"launched") from None
    if not verdict.passed:
        if as_json:
            emit(True, {"gate": verdict.as_json()}, "")
        raise GateFailed(verdict)
    return verdict


def _passed_text(verdict) -> str:
    d = (verdict.doc or {}).get("decode") or {}
    return (f"tau {d.get('tau', 0):.2f} = the block size {d.get('block_size')} on the trained row, decoders "
            f"{', '.join(d.get('decoders') or [])} agree")


def follow_launched(state: State, session, res, doc: dict, as_json: bool) -> None:
    """`--follow` after a launch (launch's, regen's): the run's log as `logs --follow` shows it, over
    the launch's connection; with --json one document at the end, DOC with the follow's under "logs".
    Exits with `logs`' status."""
    from orchestrator.runs import nodes

    seen = Seen() if as_json else None
    summary = print_job(nodes.follow(state.inv, state.inv.target(res.target), res.run, session=session),
                        as_json, seen)
    if seen is not None:        # as_json
        emit(True, {**doc, "logs": {**summary.as_json(), **seen.as_json()}}, "")
    sys.exit(summary.exit_code)


def _launch_info(res) -> str:
    policy_text = (res.compile_policy or f"none: {res.kind} into {res.output}") + (
        " (the trainer resolves it; `status --json` shows its choice)" if res.compile_policy == AUTO else "")
    what = (f"resumed run {res.run} (attempt {res.attempt}, was {res.resumed_from}; "
            if res.attempt > 1 else f"launched run {res.run} (")
    label = f"{res.name!r}, " if res.name else ""
    where = _devices(res.gpu_ids)
    return (f"{res.target}: {what}{label}pid {res.pid}, {where}, release {res.release}, policy {policy_text})"
            + (", env " + " ".join(f"{k}={v}" for k, v in res.env.items()) if res.env else "")
            + (f"; its launch was cut off ({res.cut_off}) after it started" if res.cut_off else "")
            + ("; no supervisor: its slots stay taken until it ends, no exit status" if res.unsupervised else ""))


def _nodes_info(res) -> str:
    first = res.nodes[0]
    verb = (f"resumed run {res.run} (attempt {first.attempt}, was {first.resumed_from})"
            if first.attempt > 1 else f"launched run {res.run}")
    return (f"{verb} on {len(res.nodes)} nodes, rendezvous at {res.endpoint} (on {first.target}): "
            + ", ".join(f"{n.target} pid {n.pid}" for n in res.nodes))


# --- logs ----------------------------------------------------------------------------------------

@click.command()
@click.argument("args", nargs=-1, metavar="[TARGET] [RUN]")
# The default said in the help: click's show_default would print the short name's letter (`[default: f]`).
@click.option("-f", "--follow/--no-follow", default=True,
              help="Stream the log until the run ends (the default), or (--no-follow) print what is there now.")
@click.option("--tail", type=click.IntRange(min=0), metavar="N", help="Start with the last N lines.")
@json_option
@click.pass_obj
def logs(state: State, args, follow, tail, as_json):
    """Print a run's log (default: the latest run) and name the failures in it.

    Exit status: 0 succeeded, 100 failed, 101 still running (--no-follow), 102 not found,
    103 stopped, 1 its records on the target cannot be read (unreadable: the log, then why).
    stdout is the log itself (on a terminal, each step or event once, as a line of text); notes
    and the summary go to stderr. Ctrl-C (exit 130) or SIGTERM (143) stops following; the run goes on.
    """
    from orchestrator.runs import nodes, status as runs

    target, run = runs.split_target_run(state.inv, args)
    seen = Seen() if as_json else None
    with sigterm_raises("logs"):    # SIGTERM as Ctrl-C: the follow stops saying the run goes on (exit 143)
        summary = print_job(nodes.follow(state.inv, target, run, follow=follow, tail=tail), as_json, seen)
    if seen is not None:   # as_json: ONE document, at the end (also with --follow): the summary and each event once
        emit(True, {**summary.as_json(), **seen.as_json()}, "")
    sys.exit(summary.exit_code)


# --- status --------------------------------------------------------------------------------------

@click.command()
@click.argument("names", nargs=-1, metavar="[TARGET...]")
@click.option("--all", "all_targets", is_flag=True, help="Every target of the inventory.")
@json_option
@click.pass_obj
def status(state: State, names, all_targets, as_json):
    """Table of runs on the targets (default: the default target)."""
    from orchestrator.runs import status as runs

    rows, errors = runs.status(state.inv, list(names), all_targets=all_targets)
    text = table(["RUN", "NAME", "TARGET", "STATE", "STEP", "LOSS", "TAU", "STARTED", "ELAPSED", "STEPS/S", "ETA"],
                 [[r["run"], _name(r), _where(r), _state_text(r), r.get("step"), fmt_num(r.get("loss")),
                   fmt_tau(r.get("tau")), r.get("started"), fmt_elapsed(r.get("elapsed_s")),
                   fmt_num(r.get("steps_per_s"), 3), fmt_elapsed(r.get("eta_s"))]
                  for r in rows]) if rows else ("" if errors else "no runs")
    if rows or not errors or as_json:
        emit(as_json, {"runs": rows, "errors": errors}, text)
    for r in rows if not as_json else []:     # its records on the target cannot be used: why, and the way out
        if r["state"] == "unreadable":
            note(f"{r['target']}: run {r['run']} is unreadable: {r.get('reason')}; "
                 f"`dflash-ops rm {r['target']} {r['run']}` removes it")
    if errors:
        if not as_json:
            for name, err in errors.items():
                note(err if err.startswith(f"{name}:") else f"{name}: {err}")
        raise TargetsFailed(errors)


def _name(r: dict) -> str | None:
    """The run's label; a bench-decode's row (run bench-PID) names the run it measures."""
    return f"bench-decode of {r.get('measures')}" if r.get("kind") == "bench-decode" else r.get("name")


def _where(r: dict) -> str:
    """The target, or a job's nodes (rank 0's first once known): ct200,ct300."""
    nodes = [n["target"] for n in r.get("nodes") or [] if isinstance(n, dict)]
    return ",".join(sorted(nodes, key=lambda n: n != r["target"])) if nodes else r["target"]


def _state_text(r: dict) -> str:
    ex = r.get("exit") or {}
    if r["state"] == "failed" and ex.get("signal_name"):
        return f"failed ({ex['signal_name']})"
    if r["state"] == "failed" and ex.get("exit_code") is not None:
        return f"failed (exit {ex['exit_code']})"
    if r["state"] == "failed" and ex.get("lost"):
        # a full disk; "failed (lost)": a record written by an agent from before runs with no exit
        # status had their own state, `lost` (a release deployed earlier keeps its records)
        return "failed (disk full)" if ex.get("disk_full") else "failed (lost)"
    if r["state"] == "lost":      # gone with no exit status: with its container, when the agent could tell
        return "lost (ended with its container)" if ex.get("container_restarted") else "lost"
    if r["state"] == "failed" and ex.get("started") is False:
        return "failed (never started)"
    return "running (no supervisor)" if r["state"] == "running" and r.get("unsupervised") else r["state"]


# --- stop ----------------------------------------------------------------------------------------

@click.command()
@click.argument("args", nargs=-1, metavar="TARGET [RUN]")
@click.option("--force", is_flag=True, help="SIGKILL the run's process group (no checkpoint).")
@click.option("--timeout", type=click.FloatRange(min=1), default=120, show_default=True,
              help="Seconds to wait for the trainer to checkpoint and exit.")
@json_option
@click.pass_obj
def stop(state: State, args, force, timeout, as_json):
    """SIGTERM the run (default: the latest): the trainer checkpoints and exits."""
    from orchestrator.runs import nodes, status as runs

    target, run = runs.split_target_run(state.inv, args)
    try:
        done = nodes.stop(state.inv, target, run, force=force, timeout=timeout)
    except NotFound as e:   # stop's statuses are 0 / 1: no such run is a failure to stop, not 102
        raise OpsError(str(e)) from None
    if len(done) > 1:
        rid = done[0][1]["run"]
        emit(as_json, {"run": rid, "targets": [name for name, _ in done], "nodes": dict(done)},
             "\n".join(_stop_line(name, doc) for name, doc in done))
        late = [name for name, doc in done if doc.get("timed_out")]
        if late:
            raise OpsError(f"run {rid} still running {timeout:g} s after the signal on "
                           f"{', '.join(late)}; kill it with `dflash-ops stop {late[0]} {rid} --force`")
        return
    doc = done[0][1]
    if doc.get("already"):
        benches = doc.get("benches") or []      # bench-decodes running there: what a stop of a measured run may mean
        emit(as_json, doc, f"{target.name}: run {doc['run']} already ended ({doc['state']}); nothing to stop"
             + (f"; bench-decode {benches[0]} runs there: `dflash-ops stop {target.name} {benches[0]}` ends it"
                if benches else ""))
        return
    if doc.get("timed_out"):
        emit(as_json, doc, f"{target.name}: run {doc['run']}: {doc['signal']} sent")
        raise OpsError(f"{target.name}: run {doc['run']} still running {timeout:g} s after "
                       f"{doc['signal']}; kill it with `dflash-ops stop {target.name} {doc['run']} "
                       f"--force`")
    emit(as_json, doc, _stop_line(target.name, doc))


def _stop_line(name: str, doc: dict) -> str:
    if doc.get("already"):
        return f"{name}: run {doc['run']} already ended ({doc['state']})"
    if doc.get("kind") == "bench-decode":
        slots = ", ".join("the CPU slot" if s == "cpu" else f"GPU {str(s)[3:]}" for s in doc.get("slots") or [])
        return (f"{name}: bench-decode {doc['run']} of run {doc.get('measures')} stopped ({doc['signal']}, "
                f"{doc.get('waited_s', 0):.1f} s); {slots or 'its slot'} free")
    ex = doc.get("exit") or {}
    how = f"exit {ex['exit_code']}" if ex.get("exit_code") is not None else ex.get("signal_name") or "ended"
    return f"{name}: run {doc['run']} {doc['state']} ({doc['signal']} -> {how}, {doc.get('waited_s', 0):.1f} s)"


# --- report --------------------------------------------------------------------------------------

@click.command()
@click.argument("args", nargs=-1, metavar="[TARGET] [RUN]")
@click.option("-o", "--out", type=click.Path(dir_okay=False), metavar="PATH",
              help="Where to write the PNG (default: ./dflash-report-RUN.png).")
@json_option
@click.pass_obj
def report(state: State, args, out, as_json):
    """Fetch the run's metrics and write a PNG of loss, acceptance length and throughput, and the
    acceptance rate per block position; print its path and the last eval's tau (rounds, 95% interval)."""
    from orchestrator.runs import nodes, status as runs
    from orchestrator.runs import report as report_mod

    target, run = runs.split_target_run(state.inv, args)
    target = nodes.rank0_of(state.inv, target, run)    # a run over several nodes: rank 0's has the metrics
    doc = runs.metrics(state.inv, target, run)
    path = out or f"dflash-report-{doc['run']}.png"
    st = doc.get("status") or {}
    title = (f"{target.name} run {doc['run']}: {st.get('state')}\n"
             f"policy {st.get('compile_policy')}, release {st.get('release')}")
    try:
        written = report_mod.render(doc["metrics"], path, title=title)
    except ValueError:
        raise OpsError(f"{target.name}: run {doc['run']} has logged no metrics yet") from None
    except OSError as e:
        raise UsageError(f"--out {path}: cannot write: {e.strerror or e}") from None
    ev = report_mod.last_eval(doc["metrics"])
    emit(as_json, {"target": target.name, "run": doc["run"], "path": str(written), "points": len(doc["metrics"]),
                   "state": st.get("state"), "eval": ev, "evals": report_mod.evals(doc["metrics"]),
                   "resumes": report_mod.resumes(doc["metrics"])},
         "\n".join([str(written), *report_mod.summary_lines(doc["metrics"])]))


# --- export --------------------------------------------------------------------------------------

@click.command()
@click.argument("args", nargs=-1, metavar="[TARGET] [RUN]")
@click.option("-o", "--out", "output", type=click.Path(file_okay=False), metavar="DIR",
              help="Where to write the folder (default: ~/.dflash-ops/exports/TARGET/dflash-RUN-stepN).")
@click.option("--step", type=click.IntRange(min=0), metavar="N",
              help="The checkpoint of step N (default: the run's last).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16",
              show_default=True, help="Weight dtype of the exported folder.")
@click.option("--force", is_flag=True, help="Replace DIR if it is an earlier export (or empty); a folder holding "
              "anything else is refused.")
@click.option("--running-ok", is_flag=True, help="Export a run that is still running (its newest checkpoint).")
@click.option("--target-changed-ok", is_flag=True,
              help="Export although the target at the run's --target path changed since it trained (same "
                   "hidden size and vocab); the trained layer ids and mask token are written.")
@json_option
@click.pass_obj
def export(state: State, args, output, step, dtype, force, running_ok, target_changed_ok, as_json):
    """Bring a trained drafter home as a DFlash draft-model folder (SGLang, vLLM, z-lab's dflash).

    RUN defaults to the target's newest succeeded run. The export runs on the target; the folder
    comes back over the same connection, checked against sizes and sha256 hashes, and appears
    at DIR only when complete.
    """
    from orchestrator.runs import export as export_mod
    from orchestrator.runs import nodes, status as runs
    from orchestrator.ui import progress_bars

    target, run = runs.split_target_run(state.inv, args)
    if run != "latest":     # a run over several nodes: rank 0's node (RUN default: this target's newest succeeded)
        target = nodes.rank0_of(state.inv, target, run)
    with sigterm_raises(f"{target.name}: export"):     # SIGTERM too ends it on the target first
        res = export_mod.export(state.inv, target, run, output=output, step=step, dtype=dtype, force=force,
                                running_ok=running_ok, target_changed_ok=target_changed_ok,
                                progress=None if as_json else progress_bars())
    size = f"{res.bytes / 2**20:.1f} MiB" if res.bytes >= 2**20 else f"{res.bytes} bytes"
    emit(as_json, res.as_json(), f"{res.output}")
    if not as_json:
        if res.running:
            note(f"{target.name}: run {res.run} is still running: this is its checkpoint of step {res.step}")
        if res.target_changed:
            note(f"{target.name}: the target changed since run {res.run} trained ({', '.join(res.target_changed)}); "
                  "exported with the trained layer ids and mask token")
        note(f"{target.name}: run {res.run} step {res.step} exported ({res.dtype}, {len(res.files)} files, "
              f"{size}, {res.seconds:.1f} s); serve it with `--speculative-draft-model-path {res.output}`")
