"""Click commands of run housekeeping: rm, prune (thin: parse options, call housekeeping, print)."""
from __future__ import annotations

import click

from orchestrator.errors import NotFound, OpsError
from orchestrator.ui import State, emit, json_option, size_text


def _bytes(n: int) -> str:
    """`12345678 bytes (11.8 MiB)`: the exact count, and a size a person reads."""
    return f"{n} bytes" + ("" if n < 1024 else f" ({size_text(n)})")


def _lines(r) -> list[str]:
    verb = "would remove" if r.dry_run else "removed"
    lines = [f"{r.target}: {verb} run {x['run']}" + (f" {x['name']!r}" if x.get("name") else "")
             + f" ({x['state']}" + (f": {x['reason']}" if x.get("reason") else "") + f", {_bytes(x['bytes'])})"
             for x in r.removed]
    lines.append(f"{r.target}: {'would free' if r.dry_run else 'freed'} {_bytes(r.freed)}")
    for other in r.nodes:      # a job's other nodes: their halves of the same runs
        lines += [line.replace(f"{other.target}: {verb} run", f"{other.target}: {verb} the job's half of run")
                  for line in _lines(other)]
    return lines


@click.command()
@click.argument("args", nargs=-1, required=True, metavar="[TARGET] RUN...")
@click.option("--dry-run", is_flag=True, help="Say what would be removed and freed; remove nothing.")
@json_option
@click.pass_obj
def rm(state: State, args, dry_run, as_json):
    """Remove runs (log, checkpoints, records) from the target. A running run is never removed:
    stop it first. Prints what each run freed, in bytes."""
    from orchestrator.runs import housekeeping

    inv = state.inv
    args = list(args)
    target = inv.target(args.pop(0)) if args[0] in inv.targets and len(args) > 1 else inv.default_target()
    res = housekeeping.remove(inv, target, args, dry_run=dry_run)
    if as_json or res.removed:      # nothing removed and a refusal to say: no "freed 0 bytes" before it
        emit(as_json, res.as_json(), "\n".join(_lines(res)))
    for x in res.refused:
        click.echo(f"dflash-ops: {target.name}: run {x['run']} is running; not removed (stop it "
                   f"with `dflash-ops stop {target.name} {x['run']}`)", err=True)
    if res.refused:
        raise OpsError(f"{target.name}: {len(res.refused)} running run(s) not removed")
    if res.missing:
        raise NotFound(f"{target.name}: no run {', '.join(map(repr, res.missing))} "
                       f"(see `dflash-ops status {target.name}`)")


@click.command()
@click.argument("names", nargs=-1, metavar="[TARGET...]")
@click.option("--keep", type=click.IntRange(min=0), required=True, metavar="N",
              help="How many of the newest runs to keep (running runs and regen runs are always kept).")
@click.option("--dry-run", is_flag=True, help="Say what would be removed and freed; remove nothing.")
@json_option
@click.pass_obj
def prune(state: State, names, keep, dry_run, as_json):
    """Remove every ended run but the newest N on each target; running runs are never removed."""
    from orchestrator.runs import housekeeping

    group = housekeeping.prune(state.inv, list(names), keep, dry_run=dry_run)
    doc = {"targets": {n: o.value.as_json() if o.ok else {"error": o.error.render()}
                       for n, o in group.items()}}
    lines = []
    for name, o in group.items():
        if not o.ok:
            lines.append(f"{name}: FAILED: {o.error.render()}")
            continue
        lines += _lines(o.value)
        if o.value.kept:
            lines.append(f"{name}: kept {len(o.value.kept)} run(s): {', '.join(o.value.kept)}")
        for x in o.value.unreadable:     # prune cannot tell whether it ended; rm of it can remove it
            lines.append(f"{name}: kept run {x['run']}, unreadable ({x['reason']}); "
                         f"`dflash-ops rm {name} {x['run']}` removes it")
    emit(as_json, doc, "\n".join(lines))
    group.raise_failures()


__all__ = ["rm", "prune"]
