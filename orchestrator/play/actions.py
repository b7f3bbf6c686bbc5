"""The playbook's actions, one function each, dispatched by `ACTIONS` (the names of playbook.ACTIONS):
(run, options) -> (changed, result, detail). Each calls the library function its command calls
(deploy.deploy, probe.probe_target, nodes.launch, follow.follow, export.export, exec.run_one,
runs.status) on the one target of its PlayOnTarget; a failure is an OpsError (or ValueError), which
run.py records as the step's. The steps that run a command on the target (`exec` and its
`unless`/`watch` checks, `export`) hold its stdin through the play's Ending (on_target.py), so an
interrupt ends them there; a `wait-for` stops waiting when the play is interrupted.

Library code: returns data or raises OpsError; never prints (live lines go to `PlayOnTarget.say`).
"""
from __future__ import annotations

import contextlib
import hashlib
import time
from typing import Any

from orchestrator.errors import OpsError
from orchestrator.lines import PIECE, ByteLines, LastLine, LineBuffer
from orchestrator.play import playbook as pb, templating as tpl
from orchestrator.play.on_target import PlayOnTarget
from orchestrator.ssh.transport import Kept

WAIT_NOTE_S = 20.0                        # wait-for says it is still waiting this often
VALUE_BYTES = 64 * 1024                   # an exec step's `value` (its last line) keeps this much of it


def _deploy(run: PlayOnTarget, o: dict):
    from orchestrator.deploy import sync as deploy

    res = deploy.deploy(run.inv, [run.target.name], source=o.get("source") or None,
                        install_deps=o.get("install_deps", False), verify=o.get("verify", False), session=run.session,
                        on_line=lambda _t, line: run.say(line))[run.target.name]
    if not res.ok:
        raise OpsError(res.error or "deploy failed")
    installed = (res.deps or {}).get("changed") or []
    detail = (f"up to date at {res.release}" if res.unchanged else
              f"release {res.release}: sent {res.files_sent} file(s), deleted {res.files_deleted}")
    if res.deps is not None:
        detail += (f"; requirements: installed {', '.join(installed)}" if installed
                   else "; requirements already installed")
    return (not res.unchanged) or bool(installed), res.as_json(), detail


def _probe(run: PlayOnTarget, o: dict):
    from orchestrator.probe import prober as probe

    t = run.target
    lines = LineBuffer(run.say)
    matrix = probe.Matrix(policies=tuple(o.get("policies") or ()), topologies=tuple(o.get("topologies") or ()),
                          case_timeout=o.get("case_timeout"), reuse=o.get("reuse", False))
    doc = probe.probe_target(run.session, t, max(2, o.get("gpus") or t.gpus), matrix,
                             on_line=lambda _t, line: lines(line.encode() + b"\n"))
    mismatches = (doc.get("expect") or {}).get("mismatches") or []
    if mismatches:
        raise OpsError(f"{t.name}: the torch build does not match `expect:`: {'; '.join(mismatches)}")
    if not doc.get("policy"):
        raise OpsError(f"{t.name}: no compile policy works: {doc.get('reason')}")
    detail = f"torch {(doc.get('torch') or {}).get('version')}, policy {doc['policy']}"
    if doc.get("reused"):
        detail += f" (the saved result of {doc['reused']})"
    return False, doc, detail


def _launch(run: PlayOnTarget, o: dict):
    from orchestrator.runs import nodes
    from orchestrator.runs.options import LaunchOptions

    opts = LaunchOptions.build(gpus=o.get("gpus"), gpu_ids=o.get("gpu_ids"), config=o.get("config"),
                               topology=o.get("topology"), compile_policy=o.get("compile_policy"),
                               workers=o.get("workers"),
                               extra=o.get("args", []), name=o.get("name"), env=o.get("env"))
    verdict = None
    if o.get("gate"):       # the pipeline gate first, with the same options; the run only if it passes
        from orchestrator.runs.gate import GateFailed, run_gate

        verdict = run_gate(run.inv, run.target, opts, session=run.session, on_line=run.say,
                           on_start=lambda gate_run: run.say(f"gate run {gate_run}: one row overfit, exported and "
                                                             f"decoded before the run starts"))
        if not verdict.passed:
            raise GateFailed(verdict)
    res = nodes.launch(run.inv, [run.target], opts, session=run.session).nodes[0]  # a job of one node
    doc = {**res.as_json(), **({"gate": verdict.as_json()} if verdict else {})}
    return True, doc, (f"run {res.run} (pid {res.pid}, policy {res.compile_policy})"
                       + (f", after gate run {verdict.run} passed" if verdict else ""))


def _logs(run: PlayOnTarget, o: dict):
    from orchestrator.runs.follow import End, Line, Reconnecting, follow

    summary = None
    with contextlib.closing(follow(run.inv, run.target, o.get("run", "latest"), session=run.session)) as events:
        for ev in events:
            if isinstance(ev, Line):
                run.say(ev.text)
            elif isinstance(ev, Reconnecting):
                run.say(f"connection lost ({ev.reason}); reconnecting in {ev.delay:g} s")
            elif isinstance(ev, End):
                summary = ev.summary
    if summary is None:
        raise OpsError(f"{run.target.name}: the log stream ended without a summary")
    detail = (f"run {summary.run} {summary.state}: step {summary.step}, loss {summary.loss}, "
              f"tau {summary.tau}")
    if summary.state != "succeeded":
        raise OpsError(f"{run.target.name}: {detail}" + (f", cause {summary.classified}" if summary.classified else ""))
    return False, summary.as_json(), detail


def _export(run: PlayOnTarget, o: dict):
    from orchestrator.runs import export

    with run.ending.hold(run) as hold:      # interrupted, the export ends on the target (its agent watches stdin)
        res = export.export(run.inv, run.target, o.get("run", "latest"), output=o.get("output") or None,
                            step=o.get("step"), dtype=o.get("dtype", "bfloat16"), force=o.get("force", False),
                            session=run.session, hold=hold)
    return True, res.as_json(), f"run {res.run} step {res.step} -> {res.output}"


def _argv(cmd) -> list[str]:
    return ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)


def _quiet(run: PlayOnTarget, cmd, env) -> tuple[int | None, str, str]:
    """A check command (unless, watch): its exit status, its stdout (the first KEEP_BYTES) and the
    sha256 of all of it (what `watch` compares), nothing shown."""
    from orchestrator.targets.exec import KEEP_BYTES, run_one

    kept, digest = Kept(KEEP_BYTES), hashlib.sha256()

    def out(_target: str, data: bytes) -> None:
        kept(data)
        digest.update(data)
    with run.ending.hold(run) as hold:
        r = run_one(run.session, run.target, _argv(cmd), out=out, env=env, hold=hold, keep=KEEP_BYTES)
    if r.error:
        raise OpsError(r.error)
    return r.exit_code, kept.value().decode(errors="replace"), digest.hexdigest()


def _exec(run: PlayOnTarget, o: dict):
    """The result holds each stream once, bounded: its first KEEP_BYTES (`stdout_truncated`,
    `stdout_bytes`: all it wrote), and `value`, the last line of stdout that is not blank (its first
    VALUE_BYTES, `value_truncated`); the live lines show all of it (a line over lines.PIECE in pieces)."""
    from orchestrator.targets.exec import KEEP_BYTES, check_command, run_one

    env = o.get("env") or None
    if "unless" in o:
        code, _, _ = _quiet(run, o["unless"], env)
        if code == 0:
            return False, {"ran": False}, "not needed (`unless` succeeded)"
    before = _quiet(run, o["watch"], env) if "watch" in o else None
    argv = check_command(o["command"] if "command" in o else _argv(o["shell"]))
    kept = {s: Kept(KEEP_BYTES) for s in ("out", "err")}
    last = {s: LastLine(VALUE_BYTES) for s in kept}
    # shown as it comes: the whole lines of each chunk in one live line (a line over lines.PIECE in pieces)
    shown = {s: ByteLines(lambda lines: run.say(b"\n".join(lines).decode(errors="replace")), PIECE)
             for s in kept}

    def sink(stream: str):
        def write(_target: str, data: bytes) -> None:
            kept[stream](data)
            last[stream](data)
            shown[stream](data)
        return write

    with run.ending.hold(run) as hold:
        r = run_one(run.session, run.target, argv, out=sink("out"), err=sink("err"), env=env, hold=hold)
    for s in kept:
        shown[s].flush()
        last[s].flush()
    if r.error:
        raise OpsError(r.error)
    result: dict[str, Any] = {"ran": True, "exit_code": r.exit_code,
                              "stdout": kept["out"].value().decode(errors="replace"),
                              "stderr": kept["err"].value().decode(errors="replace"),
                              "value": last["out"].value,
                              "stdout_bytes": kept["out"].total, "stdout_truncated": kept["out"].cut,
                              "stderr_bytes": kept["err"].total, "stderr_truncated": kept["err"].cut,
                              "value_truncated": last["out"].cut}
    if r.exit_code != 0:
        why = last["err"].value
        raise OpsError(f"{run.target.name}: exited {r.exit_code}" + (f": {why}" if why else ""))
    if before is not None:
        after = _quiet(run, o["watch"], env)
        result["watch"] = {"before": before[1], "after": after[1]}
        changed = after[2] != before[2]
        was, now = before[1].strip() or "-", after[1].strip() or "-"
        return changed, result, (f"changed: {now} (was {was})" if changed else f"no change ({now})")
    return o.get("changes", True), result, result["value"][:120]


def _wait_for(run: PlayOnTarget, o: dict):
    from orchestrator.runs import status as runs

    want = o.get("state") or ["succeeded"]
    name, timeout, every = o.get("run", "latest"), o.get("timeout", 3600.0), max(0.2, o.get("every", 5.0))
    t0 = time.monotonic()
    noted = t0
    while True:
        rows, errors = runs.status(run.inv, [run.target.name], runs=[] if name == "latest" else [name],
                                   session=run.session)
        if errors:
            raise OpsError(next(iter(errors.values())))
        if not rows:
            raise runs.not_found(run.target, name)
        row = rows[-1]
        state = row["state"]
        if state in want or ("ended" in want and state != "running"):
            return False, row, f"run {row['run']} {state}"
        if state != "running":
            raise OpsError(f"{run.target.name}: run {row['run']} ended {state} (waited for {', '.join(want)})")
        now = time.monotonic()
        if now - t0 > timeout:
            raise OpsError(f"{run.target.name}: run {row['run']} still running after {timeout:g} s "
                           f"(waited for {', '.join(want)})")
        if now - noted >= WAIT_NOTE_S:
            noted = now
            run.say(f"still waiting for run {row['run']} ({state}, step {row.get('step')}, {now - t0:.0f} s)")
        if run.ending.event.wait(every):
            raise OpsError(f"{run.target.name}: interrupted while waiting for run {row['run']}")


def _assert(run: PlayOnTarget, o: dict):
    result = run.ctx.lookup(["steps", o["step"]])
    ok, what = tpl.check_assert(o, result)
    if not ok:
        raise OpsError(f"{run.target.name}: assertion failed: {o.get('message') or what}")
    return False, {"passed": True, "checked": what}, what


ACTIONS = {"deploy": _deploy, "probe": _probe, "launch": _launch, "logs": _logs, "export": _export,
           "exec": _exec, "wait-for": _wait_for, "assert": _assert}
assert set(ACTIONS) == set(pb.ACTIONS)

__all__ = ["ACTIONS"]
