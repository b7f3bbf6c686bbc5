"""Click command `play`: run a playbook (playbook.py, run.py) and print a table per target and step.

Live lines (each step's start and end, its output, the log it follows) go to stderr led by
`[target] `; stdout holds the summary table, or with --json one document.
"""
from __future__ import annotations

import json
import threading

import click

from orchestrator.errors import TargetsFailed
from orchestrator.ui import State, emit, json_option, sigterm_raises, table


@click.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.argument("names", nargs=-1, metavar="[TARGET...]")
@click.option("--from", "start", metavar="STEP", help="Resume at this step (earlier steps' recorded results stand).")
@click.option("--dry-run", is_flag=True, help="Print what would run on each target; connect nowhere.")
@click.option("--var", "var", multiple=True, metavar="K=V", help="Set a playbook variable (repeatable).")
@json_option
@click.pass_obj
def play(state: State, file, names, start, dry_run, var, as_json):
    """Run a playbook: named steps (deploy, probe, launch, logs, export, exec, wait-for, assert)
    in order on each target, targets in parallel; the first failure stops that target.

    Exit status: 0 every target ran every step, 1 a step failed on some target, 2 a mistake in the
    playbook, its variables or the inventory (FILE:LINE: KEY: message), 130 / 143 interrupted by
    SIGINT / SIGTERM (the steps' commands ended; one line says where each target stopped).
    """
    from orchestrator.play import player as play_mod
    from orchestrator.play import playbook
    from orchestrator.envvars import parse_assignments

    given = parse_assignments(var, what="--var")
    book = playbook.load(file, given)
    targets = state.inv.select(list(names))
    lock = threading.Lock()

    def live(target: str, text: str) -> None:
        lead = f"[{target}] "     # text: a line, or several joined by newlines (an exec step's, a chunk at a time)
        with lock:
            click.echo(lead + text.replace("\n", "\n" + lead), err=True)

    with sigterm_raises("play"):    # SIGTERM as Ctrl-C: each step's command is ended, the play says where it stopped
        plays = play_mod.play(state.inv, book, targets, given=given, start=start, dry_run=dry_run, on_line=live)
    doc = {"playbook": file, "from": start, "dry_run": dry_run, "targets": {p.target: p.as_json() for p in plays}}
    if dry_run:
        emit(as_json, doc, "\n".join(_planned(p) for p in plays))
        return
    ran = ("changed", "ok", "failed")
    rows = [[p.target, s.name, s.action, s.status.replace("_", " "), f"{s.seconds:.1f}" if s.status in ran else None,
             s.error or s.detail or None] for p in plays for s in p.steps]
    verdicts = []
    for p in plays:
        failed = p.failed
        if failed:
            verdicts.append(f"{p.target}: FAILED at step {failed.name!r}; resume with "
                            f"`dflash-ops play {file} {p.target} --from {failed.name}`")
        elif p.changed:
            verdicts.append(f"{p.target}: ok, {len(p.changed)} step(s) changed something: {', '.join(p.changed)}")
        else:
            verdicts.append(f"{p.target}: ok, nothing changed")
    emit(as_json, doc, table(["TARGET", "STEP", "ACTION", "STATUS", "SECONDS", "DETAIL"], rows)
         + "\n\n" + "\n".join(verdicts))
    failures = {p.target: f"step {f.name!r}: {f.error}" for p in plays if (f := p.failed) is not None}   # not p.ok
    if failures:
        raise TargetsFailed(failures)


def _planned(p) -> str:
    """--dry-run: each step that would run, with its options as they would be given."""
    steps = [s for s in p.steps if s.status == "planned"]
    lines = [f"{p.target}: would run {len(steps)} step(s)"
             + (f" (from {steps[0].name})" if len(steps) < len(p.steps) and steps else "")]
    for s in steps:
        lines.append(f"  {s.name} ({s.action})")
        for opt, value in (s.result or {}).items():
            text = value if isinstance(value, str) else json.dumps(value)
            first, *rest = text.rstrip("\n").split("\n") or [""]
            lines.append(f"    {opt}: {first}")
            lines += [f"    {' ' * len(opt)}  {r}" for r in rest]
    return "\n".join(lines)
