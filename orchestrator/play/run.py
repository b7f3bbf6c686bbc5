"""`play`: run a playbook (playbook.py) on targets, steps in order on each target, targets in
parallel through the one fan-out (agent.fan_out), one connection per host for the whole play.

Each step calls the library function its command calls (deploy.deploy, probe.probe_target,
nodes.launch, follow.follow, export.export, exec.run_one, runs.status) and records a result: its
status (`changed`, `ok`: ran and changed nothing, `failed`, `skipped` before --from, `not_run`
after a failure), a one-line detail and its JSON document, which later steps read through
`{{ steps.NAME... }}` and `assert`. The first failure stops that target; the others go on.

Results are also kept on this machine ($DFLASH_OPS_HOME/plays/, default ~/.dflash-ops/plays/),
one file per playbook and target, so `--from STEP` can resume: the steps before STEP are not run
again and their recorded results stand in for them. One player per playbook and target: a play
holds an flock beside that record (`.TARGET.lock`, its pid and start inside) while it runs, and a
second play of the same playbook on the same target is refused in one line naming the first; the
kernel drops the lock of a play that died (SIGKILL), so the next one goes ahead.

Interrupted (Ctrl-C; SIGTERM too where the caller runs it under ui.sigterm_raises), a play ends as
`exec` does: each `exec` or `export` step's command runs with a held stdin (transport.Hold, one
Ending for the play), told the signal's name, so it ends on the target (exec's process group, SIGKILL
after the grace; export's agent and worker); no step starts after it; a `wait-for` stops waiting.
The targets' threads are daemons: a step that cannot be told (a `logs`, a `deploy`) is cut off where
it stands when the controller exits, as if killed. The players' locks are released, the steps that
ended are in the record, and errors.Interrupted (exit 130 / 143) says in one line where each target
stopped and how to resume.

Library code: returns data or raises OpsError; never prints (live lines go to `on_line`).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from orchestrator.ssh import agent
from orchestrator.play import playbook as pb, templating as tpl
from orchestrator.errors import FileError, Interrupted, OpsError, Terminated
from orchestrator.inventory import Inventory, Target
from orchestrator.lines import LineBuffer
from orchestrator.ssh.session import Session
from orchestrator.ssh.transport import Hold

OnLine = Callable[[str, str], None]      # (target, text) -> None
WAIT_NOTE_S = 30.0                        # wait-for says it is still waiting this often


@dataclass
class StepResult:
    name: str
    action: str
    status: str = "not_run"     # changed | ok | failed | skipped | not_run | planned (--dry-run)
    seconds: float = 0.0
    detail: str = ""
    error: str | None = None
    result: Any = None

    def as_json(self) -> dict:
        return asdict(self)


@dataclass
class TargetPlay:
    target: str
    steps: list[StepResult] = field(default_factory=list)

    @property
    def failed(self) -> StepResult | None:
        return next((s for s in self.steps if s.status == "failed"), None)

    @property
    def ok(self) -> bool:
        return self.failed is None

    @property
    def changed(self) -> list[str]:
        return [s.name for s in self.steps if s.status == "changed"]

    def as_json(self) -> dict:
        failed = self.failed
        return {"ok": self.ok, "changed": len(self.changed), "failed_step": failed.name if failed else None,
                "error": failed.error if failed else None, "steps": [s.as_json() for s in self.steps]}


# --- variables ------------------------------------------------------------------------------

def variables(book: pb.Playbook, target: Target, given: Mapping[str, str]) -> dict:
    """What `{{ NAME }}` means on this target: the file's vars, the target's keys, --var (later wins)."""
    keys = {}
    for key in pb.TARGET_KEYS:      # `target` is the target's name; a key it leaves unset reads as ""
        value = target.name if key == "target" else getattr(target, key)
        keys[key] = "" if value is None else value
    return {**book.vars, **keys, **given,
            "playbook_dir": str(Path(book.path).resolve().parent)}


def check_options(book: pb.Playbook, targets: list[Target], given: Mapping[str, str], start: int) -> None:
    """Render every step's options on every target before anything runs: a value of the wrong
    type is FILE:LINE: KEY (exit 2). Options that read earlier steps' results wait for them."""
    for target in targets:
        ctx = tpl.Context(variables(book, target, given))
        for i, step in enumerate(book.steps[start:], start):
            for opt, value in step.options.items():
                try:
                    options_value(step, opt, value, ctx)
                except tpl.Missing:
                    continue
                except (ValueError, OpsError) as e:
                    raise FileError(book.path, step.lines[opt], step.where(i, opt),
                                    f"{e} (on {target.name})") from None


def options_value(step: pb.Step, opt: str, value, ctx: tpl.Context):
    kind = pb.ACTIONS[step.action][opt]
    shell = kind == "shell" or (kind == "cmd" and isinstance(value, str))
    return tpl.convert(kind, tpl.render(value, ctx, shell=shell))


def rendered(step: pb.Step, ctx: tpl.Context) -> dict:
    return {opt: options_value(step, opt, value, ctx) for opt, value in step.options.items()}


def preview(step: pb.Step, ctx: tpl.Context) -> dict:
    """The step's options as --dry-run shows them: values filled in, results of steps that have
    not run yet as <steps.NAME.KEY>."""
    ctx = tpl.Context(ctx.variables, ctx.results, preview=True)
    out = {}
    for opt, value in step.options.items():
        try:
            out[opt] = options_value(step, opt, value, ctx)
        except ValueError:      # a placeholder where a number goes: shown as written
            out[opt] = value
    return out


# --- the record kept for --from ---------------------------------------------------------------

def record_path(book: pb.Playbook, target: str) -> Path:
    home = Path(os.environ.get("DFLASH_OPS_HOME", Path.home() / ".dflash-ops"))
    real = str(Path(book.path).resolve())
    key = f"{Path(real).stem}-{hashlib.sha256(real.encode()).hexdigest()[:8]}"
    return home / "plays" / key / f"{target}.json"


def load_record(book: pb.Playbook, target: str) -> dict:
    try:
        doc = json.loads(record_path(book, target).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc.get("results") or {} if isinstance(doc, dict) else {}


class Busy(OpsError):
    """Another play of this playbook runs on the target (exit 1)."""


@contextlib.contextmanager
def one_player(book: pb.Playbook, target: str):
    """Held while this process plays `book` on `target`: Busy when another live process holds it."""
    path = record_path(book, target)
    lock = path.with_name(f".{path.stem}.lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        yield          # no lock where no record can be kept either (save_record says nothing then)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
            except ValueError:
                holder = {}
            raise Busy(f"{target}: {Path(book.path).name} is being played there already (pid {holder.get('pid')}, "
                       f"since {holder.get('since')}); wait for it to end or stop it, then run again "
                       f"(`--from STEP` resumes at a step)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode(), 0)
        for left in path.parent.glob(f".{path.name}.*"):    # save_record's temporaries of a killed player
            left.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)       # the lock goes with it; the file stays (removing it would race a next player)


def save_record(book: pb.Playbook, target: str, results: dict) -> None:
    path = record_path(book, target)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"playbook": str(Path(book.path).resolve()), "results": results},
                                  default=str), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass    # no record: a later --from past these steps says what it misses


# --- running --------------------------------------------------------------------------------

ENDING_WAIT_S = 5.0     # how long an interrupted play waits for its steps' commands to end (exec's wait)


class Ending:
    """A play's interrupt, shared by its targets: the held stdin (transport.Hold) of every step command
    under way is told the signal's name once end() is called (exec's watcher then ends its process
    group); a hold made after that never starts its command."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holds: dict[Hold, Run] = {}
        self.signal: str | None = None
        self.untold: list[tuple[Hold, Run]] = []
        self.event = threading.Event()      # set by end(): a wait-for stops waiting

    @contextlib.contextmanager
    def hold(self, run: Run) -> Iterator[Hold]:
        h = Hold()
        with self.lock:
            told = self.signal
            if told is None:
                self.holds[h] = run
        if told is not None:
            h.end(told)
        try:
            yield h
        finally:
            with self.lock:
                self.holds.pop(h, None)

    def end(self, name: str) -> None:
        """Tell every command under way (called again after a Ctrl-C cut it short, it goes on)."""
        with self.lock:
            if self.signal is None:
                self.signal, self.untold = name, list(self.holds.items())
        self.event.set()
        while self.untold:
            h, run = self.untold[0]
            if h.end(self.signal, timeout=ENDING_WAIT_S) == Hold.RUNNING:    # idempotent
                run.told = True
            self.untold.pop(0)


@dataclass
class Run:
    """One target's play: where it runs and what its templates see."""
    inv: Inventory
    session: Session
    target: Target
    ctx: tpl.Context
    on_line: OnLine
    ending: Ending = field(default_factory=Ending)
    at: int | None = None       # the step under way or next (its index); None once the target's play ended
    busy: bool = False          # step `at` was entered (under way, or ended by the interrupt)
    told: bool = False          # its command was told to end by the interrupt

    def say(self, text: str) -> None:
        self.on_line(self.target.name, text)


def play(inv: Inventory, book: pb.Playbook, targets: list[Target], *, given: Mapping[str, str] | None = None,
         start: str | None = None, dry_run: bool = False, on_line: OnLine | None = None,
         session: Session | None = None) -> list[TargetPlay]:
    """Run the playbook on every target in parallel (steps in order on each); one TargetPlay per
    target, in the order given. start: the step to resume at (--from)."""
    given = dict(given or {})
    first = book.index(start) if start else 0
    check_options(book, targets, given, first)
    say = on_line or (lambda target, text: None)
    if dry_run:
        return [_dry_run(book, t, given, first) for t in targets]
    with contextlib.ExitStack() as players, agent.session(inv, session) as s:
        for t in targets:
            players.enter_context(one_player(book, t.name))
        ending = Ending()
        runs = {t.name: Run(inv, s, t, tpl.Context(variables(book, t, given)), say, ending) for t in targets}
        return _each_target(book, runs, first)


def _each_target(book: pb.Playbook, runs: dict[str, Run], first: int) -> list[TargetPlay]:
    """_play_target on every target, a daemon thread each (at most agent.MAX_WORKERS at work): an
    interrupted play must not wait for a step that cannot be told to end (exec_command's way)."""
    done = {name: threading.Event() for name in runs}
    plays: dict[str, TargetPlay] = {}
    bugs: list[BaseException] = []
    slots = threading.Semaphore(agent.MAX_WORKERS)

    def one(run: Run) -> None:
        try:
            with slots:
                if run.ending.signal is None:
                    plays[run.target.name] = _play_target(run, book, first)
        except BaseException as e:  # noqa: BLE001 - _play_target keeps each step's error; anything else is a bug
            bugs.append(e)
        finally:
            done[run.target.name].set()

    try:
        for run in runs.values():
            threading.Thread(target=one, args=(run,), name=f"play {run.target.name}", daemon=True).start()
        for event in done.values():
            event.wait()
    except KeyboardInterrupt as e:      # Ctrl-C, or SIGTERM as errors.Terminated (ui.sigterm_raises)
        signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
        raise _interrupted(signum, book, runs, done, plays) from None
    if bugs:
        raise bugs[0]
    return [plays[name] for name in runs]


def _interrupted(signum: signal.Signals, book: pb.Playbook, runs: dict[str, Run],
                 done: dict[str, threading.Event], plays: dict[str, TargetPlay]) -> Interrupted:
    """Every step's command told to end, up to ENDING_WAIT_S for the targets' threads to stop (a
    second Ctrl-C meanwhile stops the waiting only); the one line saying where each target stopped."""
    ending = next(iter(runs.values())).ending
    deadline = time.monotonic() + ENDING_WAIT_S
    while ending.signal is None or ending.untold:
        try:        # a Ctrl-C pressed again meanwhile must not leave a command untold
            ending.end(signum.name[3:])
        except KeyboardInterrupt:
            pass
    try:
        for event in done.values():
            event.wait(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        pass
    total, parts = len(book.steps), []
    for name, run in runs.items():
        if run.at is None:
            parts.append(f"{name} {'had ended' if name in plays else 'had not started'}")
            continue
        step = book.steps[run.at].name
        where = f"{name} stopped {'in' if run.busy else 'before'} step {step!r} ({run.at + 1}/{total})"
        if run.told:
            where += (", its command was ended" if done[name].is_set() else f", its command's end not confirmed "
                      f"within {ENDING_WAIT_S:g} s (it ends when the node sees this connection close)")
        elif run.busy and not done[name].is_set():
            where = f"{name} cut off in step {step!r} ({run.at + 1}/{total})"
        parts.append(f"{where}; resume with `dflash-ops play {book.path} {name} --from {step}`")
    return Interrupted(signum, f"interrupted ({signum.name}): {'; '.join(parts)}")


def _dry_run(book: pb.Playbook, target: Target, given: Mapping[str, str], first: int) -> TargetPlay:
    ctx = tpl.Context(variables(book, target, given))
    return TargetPlay(target.name, [StepResult(s.name, s.action, status="skipped" if i < first else "planned",
                                               result=None if i < first else preview(s, ctx))
                                    for i, s in enumerate(book.steps)])


def _play_target(run: Run, book: pb.Playbook, first: int) -> TargetPlay:
    out = TargetPlay(run.target.name, [StepResult(s.name, s.action) for s in book.steps])
    earlier = load_record(book, run.target.name) if first else {}
    results = {name: earlier[name] for name in book.names[:first] if name in earlier}
    run.ctx.results.update(results)
    for res in out.steps[:first]:
        res.status, res.detail = "skipped", "before --from"
    total = len(book.steps)
    for i in range(first, total):
        step, res = book.steps[i], out.steps[i]
        run.at, run.busy = i, False
        if run.ending.signal is not None:       # interrupted: no step starts
            return out
        run.busy = True
        run.say(f"step {i + 1}/{total} {step.name} ({step.action})")
        t0 = time.monotonic()
        try:
            changed, res.result, res.detail = ACTIONS[step.action](run, rendered(step, run.ctx))
            res.status = "changed" if changed else "ok"
        except (OpsError, ValueError) as e:
            res.status, res.error = "failed", e.render() if isinstance(e, OpsError) else str(e)
        res.seconds = round(time.monotonic() - t0, 2)
        if res.result is not None:
            run.ctx.results[step.name] = res.result
            results[step.name] = res.result
            save_record(book, run.target.name, results)
        if res.status == "failed" and run.ending.signal is not None:
            run.say(f"{step.name}: interrupted (SIG{run.ending.signal}) after {res.seconds:.1f} s")
            return out
        if res.status == "failed":
            run.say(f"{step.name}: FAILED ({res.seconds:.1f} s): {res.error}")
            break
        run.say(f"{step.name}: {res.status} ({res.seconds:.1f} s){': ' + res.detail if res.detail else ''}")
    run.at = None
    return out


# --- the actions: (run, options) -> (changed, result, detail) --------------------------------------

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

__all__ = ["play", "StepResult", "TargetPlay", "variables", "record_path"]
