"""`play`: run a playbook (playbook.py) on targets, steps in order on each target, targets in
parallel through the one fan-out (fanout.fan_out), one connection per host for the whole play.

This module holds the play's options and variables, the record kept for --from with the player's
lock, and the running of the targets; each step is its action in actions.py (the library function
its command calls), given the target's PlayOnTarget (on_target.py). A step records a result: its status
(`changed`, `ok`: ran and changed nothing, `failed`, `skipped` before --from, `not_run` after a
failure), a one-line detail and its JSON document, which later steps read through
`{{ steps.NAME... }}` and `assert`. The first failure stops that target; the others go on.

Results are also kept on this machine ($DFLASH_OPS_HOME/plays/, default ~/.dflash-ops/plays/),
one file per playbook and target, so `--from STEP` can resume: the steps before STEP are not run
again and their recorded results stand in for them. One player per playbook and target: a play
holds an flock beside that record (`.TARGET.lock`, its pid and start inside) while it runs, and a
second play of the same playbook on the same target is refused in one line naming the first; the
kernel drops the lock of a play that died (SIGKILL), so the next one goes ahead.

Interrupted (Ctrl-C; SIGTERM too where the caller runs it under ui.sigterm_raises), a play ends as
`exec` does: each `exec` or `export` step's command runs with a held stdin (hold.Hold, one
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
import hashlib
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from orchestrator.ssh import fanout
from orchestrator.ssh.session import owned_session
from orchestrator.play import playbook as pb, templating as tpl
from orchestrator.play.actions import ACTIONS
from orchestrator.play.on_target import ENDING_WAIT_S, Ending, OnLine, PlayOnTarget
from orchestrator.errors import FileError, Interrupted, OpsError, Terminated, wait_for_event
from orchestrator.inventory import Inventory, Target
from orchestrator.ssh.session import Session
from trainer.controller_view import LockHeld, LockUnopened, lock_file   # torch-free, stdlib only


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
    type, or a launch the target can never run (more GPUs than it has, a GPU id it does not have),
    is FILE:LINE: KEY (exit 2). Options that read earlier steps' results wait for them."""
    for target in targets:
        ctx = tpl.Context(variables(book, target, given))
        for i, step in enumerate(book.steps[start:], start):
            known = {}
            for opt, value in step.options.items():
                try:
                    known[opt] = options_value(step, opt, value, ctx)
                except tpl.Missing:
                    continue
                except (ValueError, OpsError) as e:
                    raise FileError(book.path, step.lines[opt], step.where(i, opt),
                                    f"{e} (on {target.name})") from None
            if step.action == "export" and known.get("output"):    # a folder it may not replace: before any step
                from orchestrator.runs.export import check_output

                try:
                    check_output(known["output"], bool(known.get("force")), target)
                except OpsError as e:
                    raise FileError(book.path, step.lines["output"], step.where(i, "output"),
                                    f"{e} (on {target.name})") from None
            if step.action == "launch":     # GPUs the target does not have: bad input, before any step
                _check_launch(book, i, step, known, target)


def _check_launch(book: pb.Playbook, i: int, step: pb.Step, known: dict, target: Target) -> None:
    """A launch step's GPUs against the target, as `launch` checks them (runs/launch.check_gpus)."""
    from orchestrator.runs.launch import check_gpus
    from orchestrator.runs.options import LaunchOptions

    try:
        check_gpus(LaunchOptions.build(gpus=known.get("gpus"), gpu_ids=known.get("gpu_ids")), target)
    except OpsError as e:
        opt = next((o for o in ("gpu_ids", "gpus") if o in step.options), None)
        said = str(e).removeprefix(f"{target.name}: ")
        raise FileError(book.path, step.lines[opt] if opt else step.line, step.where(i, opt),
                        f"{said} (on {target.name})") from None


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
    except (OSError, ValueError, RecursionError):     # no record, or one that cannot be read: none
        return {}
    return doc.get("results") or {} if isinstance(doc, dict) else {}


class Busy(OpsError):
    """Another play of this playbook runs on the target (exit 1)."""


@contextlib.contextmanager
def one_player(book: pb.Playbook, target: str):
    """Held while this process plays `book` on `target`: Busy when another live process holds it.
    The lock is the trainer's (trainer/lock_file.py, as its one writer per output), kept beside the record."""
    path = record_path(book, target)
    lock = path.with_name(f".{path.stem}.lock")
    mine = json.dumps({"pid": os.getpid(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode()
    with contextlib.ExitStack() as held:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            yield          # no lock where no record can be kept either (save_record says nothing then)
            return
        try:   # the file stays when the play ends (removing it would race a next player)
            held.enter_context(lock_file(lock, mine, remove=False))
        except LockUnopened:
            yield
            return
        except LockHeld as e:
            try:
                holder = json.loads(e.said or b"{}")
            except ValueError:
                holder = {}
            raise Busy(f"{target}: {Path(book.path).name} is being played there already (pid {holder.get('pid')}, "
                       f"since {holder.get('since')}); wait for it to end or stop it, then run again "
                       f"(`--from STEP` resumes at a step)") from None
        for left in path.parent.glob(f".{path.name}.*"):    # save_record's temporaries of a killed player
            left.unlink(missing_ok=True)
        yield


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
    with contextlib.ExitStack() as players, owned_session(inv, session) as s:
        for t in targets:
            players.enter_context(one_player(book, t.name))
        ending = Ending()
        runs = {t.name: PlayOnTarget(inv, s, t, tpl.Context(variables(book, t, given)), say, ending) for t in targets}
        return _each_target(book, runs, first)


def _each_target(book: pb.Playbook, runs: dict[str, PlayOnTarget], first: int) -> list[TargetPlay]:
    """_play_target on every target, a daemon thread each (at most fanout.MAX_WORKERS at work): an
    interrupted play must not wait for a step that cannot be told to end (exec_command's way)."""
    done = {name: threading.Event() for name in runs}
    plays: dict[str, TargetPlay] = {}
    bugs: list[BaseException] = []
    slots = threading.Semaphore(fanout.MAX_WORKERS)

    def one(run: PlayOnTarget) -> None:
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
            wait_for_event(event)
    except KeyboardInterrupt as e:      # Ctrl-C, or SIGTERM as errors.Terminated (ui.sigterm_raises)
        signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
        raise _interrupted(signum, book, runs, done, plays) from None
    if bugs:
        raise bugs[0]
    return [plays[name] for name in runs]


def _interrupted(signum: signal.Signals, book: pb.Playbook, runs: dict[str, PlayOnTarget],
                 done: dict[str, threading.Event], plays: dict[str, TargetPlay]) -> Interrupted:
    """Every step's command told to end, up to ENDING_WAIT_S for the targets' threads to stop (a
    second Ctrl-C meanwhile stops the waiting only); the one line saying where each target stopped."""
    ending = next(iter(runs.values())).ending
    deadline = time.monotonic() + ENDING_WAIT_S
    while True:
        try:        # a Ctrl-C pressed again between two tellings: all told again (Hold.end is idempotent)
            ending.end(signum.name[3:])
            break
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


def _play_target(run: PlayOnTarget, book: pb.Playbook, first: int) -> TargetPlay:
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


__all__ = ["play", "StepResult", "TargetPlay", "variables", "record_path"]
