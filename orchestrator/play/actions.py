"""The playbook's actions, one function each, dispatched by `ACTIONS` (the names of playbook.ACTIONS):
(run, options) -> (changed, result, detail). Each calls the library function its command calls
(deploy.deploy, probe.probe_target, nodes.launch, follow.follow, export.export, exec.run_one,
runs.status) on the one target of its Run; a failure is an OpsError (or ValueError), which
run.py records as the step's. The steps that run a command on the target (`exec` and its
`unless`/`watch` checks, `export`) hold its stdin through the play's Ending (runstate.py), so an
interrupt ends them there; a `wait-for` stops waiting when the play is interrupted.

Library code: returns data or raises OpsError; never prints (live lines go to `Run.say`).
"""
from __future__ import annotations

import contextlib
import time
from typing import Any

from orchestrator.errors import OpsError
from orchestrator.lines import LineBuffer
from orchestrator.play import playbook as pb, templating as tpl
from orchestrator.play.runstate import Run

WAIT_NOTE_S = 30.0                        # wait-for says it is still waiting this often


def _deploy(run: Run, o: dict):
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


def _probe(run: Run, o: dict):
    from orchestrator.probe import run as probe

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


def _launch(run: Run, o: dict):
    from orchestrator.runs import nodes
    from orchestrator.runs.options import LaunchOptions

    opts = LaunchOptions.build(gpus=o.get("gpus"), gpu_ids=o.get("gpu_ids"), config=o.get("config"),
                               topology=o.get("topology"), compile_policy=o.get("compile_policy"),
                               workers=o.get("workers"),
                               extra=o.get("args", []), name=o.get("name"), env=o.get("env"))
    res = nodes.launch(run.inv, [run.target], opts, session=run.session).nodes[0]  # a job of one node
    return True, res.as_json(), f"run {res.run} (pid {res.pid}, policy {res.compile_policy})"


def _logs(run: Run, o: dict):
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


def _export(run: Run, o: dict):
    from orchestrator.runs import export

    with run.ending.hold(run) as hold:      # interrupted, the export ends on the target (its agent watches stdin)
        res = export.export(run.inv, run.target, o.get("run", "latest"), output=o.get("output") or None,
                            step=o.get("step"), dtype=o.get("dtype", "bfloat16"), force=o.get("force", False),
                            session=run.session, hold=hold)
    return True, res.as_json(), f"run {res.run} step {res.step} -> {res.output}"


def _argv(cmd) -> list[str]:
    return ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)


def _quiet(run: Run, cmd, env) -> tuple[int | None, str]:
    """A check command (unless, watch): its exit status and stdout, nothing shown."""
    from orchestrator.targets.exec import run_one

    with run.ending.hold(run) as hold:
        r = run_one(run.session, run.target, _argv(cmd), env=env, hold=hold)
    if r.error:
        raise OpsError(r.error)
    return r.exit_code, r.stdout.decode(errors="replace")


def _exec(run: Run, o: dict):
    from orchestrator.targets.exec import check_command, run_one

    env = o.get("env") or None
    if "unless" in o:
        code, _ = _quiet(run, o["unless"], env)
        if code == 0:
            return False, {"ran": False}, "not needed (`unless` succeeded)"
    before = _quiet(run, o["watch"], env)[1] if "watch" in o else None
    argv = check_command(o["command"] if "command" in o else _argv(o["shell"]))
    kept: dict[str, list[bytes]] = {"out": [], "err": []}
    shown = {s: LineBuffer(run.say) for s in kept}

    def sink(stream: str):
        def write(_target: str, data: bytes) -> None:
            kept[stream].append(data)
            shown[stream](data)
        return write

    with run.ending.hold(run) as hold:
        r = run_one(run.session, run.target, argv, out=sink("out"), err=sink("err"), env=env, hold=hold)
    for b in shown.values():
        b.flush()
    stdout, stderr = (b"".join(kept[s]).decode(errors="replace") for s in ("out", "err"))
    if r.error:
        raise OpsError(r.error)
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    result: dict[str, Any] = {"ran": True, "exit_code": r.exit_code, "stdout": stdout, "stderr": stderr,
              "value": lines[-1] if lines else ""}
    if r.exit_code != 0:
        last = [line for line in stderr.splitlines() if line.strip()][-1:]
        raise OpsError(f"{run.target.name}: exited {r.exit_code}" + (f": {last[0].strip()}" if last else ""))
    if before is not None:
        after = _quiet(run, o["watch"], env)[1]
        result["watch"] = {"before": before, "after": after}
        changed = after != before
        return changed, result, (f"changed: {after.strip() or '-'} (was {before.strip() or '-'})" if changed
                                 else f"no change ({after.strip() or '-'})")
    return o.get("changes", True), result, result["value"][:120]


def _wait_for(run: Run, o: dict):
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


def _assert(run: Run, o: dict):
    result = run.ctx.lookup(["steps", o["step"]])
    ok, what = tpl.check_assert(o, result)
    if not ok:
        raise OpsError(f"{run.target.name}: assertion failed: {o.get('message') or what}")
    return False, {"passed": True, "checked": what}, what


ACTIONS = {"deploy": _deploy, "probe": _probe, "launch": _launch, "logs": _logs, "export": _export,
           "exec": _exec, "wait-for": _wait_for, "assert": _assert}
assert set(ACTIONS) == set(pb.ACTIONS)

__all__ = ["ACTIONS"]
