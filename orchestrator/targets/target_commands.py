"""Click commands targets, exec and scan (thin: parse options, call the library, print)."""
from __future__ import annotations

import difflib
import sys
from typing import Any

import click

from orchestrator.errors import OpsError, TargetsFailed
from orchestrator.ui import State, emit, json_option, table


@click.command()
@click.option("--check", is_flag=True, help="Connect to each target in parallel and report what is there.")
@click.argument("names", nargs=-1)
@json_option
@click.pass_obj
def targets(state: State, check, names, as_json):
    """List targets; --check reaches each (container state, python, torch).

    --check judges the targets named (all when none): exit 1 when any failed. The built-in `local`
    without torch is shown, not judged, unless it is named, is `default:` or is the only target.
    """
    from orchestrator.targets import check as targets_mod

    inv = state.inv
    if not check:
        rows: list[dict[str, Any]] = [{"target": t.name, "where": targets_mod.describe(inv, t), "python": t.python,
                 "workdir": t.workdir, "gpus": t.gpus, "default": t.name == inv.default_target().name}
                for t in (inv.select(names) if names else inv.targets.values())]
        emit(as_json, {"targets": rows},
             table(["TARGET", "WHERE", "GPUS", "WORKDIR", "PYTHON"],
                   [[r["target"] + (" *" if r["default"] else ""), r["where"], r["gpus"], r["workdir"],
                     r["python"]] for r in rows]))
        return
    checks = targets_mod.check(inv, list(names))
    emit(as_json, {"targets": {c.target: c.as_json() for c in checks}},
         table(["TARGET", "OK", "WHERE", "CONTAINER", "PYTHON", "TORCH", "RELEASE", "ERROR"],
               [[c.target, "yes" if c.ok else "NO", c.where, c.container, c.python, c.torch,
                 c.release, c.error or c.note] for c in checks]))
    if not as_json:     # what would break training there, one line each with its remedy (in --json: warnings)
        for c in checks:
            for w in c.warnings:
                click.echo(f"dflash-ops: {c.target}: {w}", err=True)
    failed = {c.target: c.error or "failed" for c in checks if not c.ok}
    if failed:
        raise TargetsFailed(failed)



class _CommandAfterDashes(click.Command):
    """Everything after the first `--` is the remote command, kept verbatim (click would drop
    the `--` itself and leave no way to tell targets from the command's words). A command typed
    without `--` is refused with the line that has it."""

    def collect_usage_pieces(self, ctx):
        return super().collect_usage_pieces(ctx) + ["-- CMD..."]

    def parse_args(self, ctx, args):
        if "--" in args:
            i = args.index("--")
            ctx.meta["command"] = list(args[i + 1:])
            args = args[:i]
        else:
            ctx.meta["command"] = []
            head, rest = _split_exec_words(ctx, args)
            if rest:
                raise click.UsageError("the command goes after `--`: `dflash-ops exec "
                                       + " ".join([*head, "--", *rest]) + "`", ctx)
        return super().parse_args(ctx, args)


def _split_exec_words(ctx, args: list[str]) -> tuple[list[str], list[str]]:
    """exec's words typed without `--`: (its own options and the targets, the command's words).
    Without an inventory to tell targets by, the first word is taken for the target."""
    try:
        inv = ctx.find_object(State).inv
        known = inv.names_targets
    except Exception:  # noqa: BLE001 - a broken inventory is reported by the command itself
        known = None
    head, i = [], 0
    while i < len(args):
        w = args[i]
        if w in ("--all", "--json", "--help") or w.startswith("--env="):
            head.append(w)
        elif w == "--env":
            head += args[i:i + 2]
            i += 1
        elif known(w) if known else not any(not h.startswith("-") for h in head):
            head.append(w)
        else:
            break
        i += 1
    rest = list(args[i:])
    if rest and known and difflib.get_close_matches(rest[0], list(inv.targets), n=1):
        return head, []     # a target's typo, not a command: the inventory names it
    return head, rest


@click.command("exec", cls=_CommandAfterDashes)
@click.argument("names", nargs=-1, metavar="TARGET...")
@click.option("--all", "all_targets", is_flag=True,
              help="Every target hosts.yaml defines (the built-in local only when it is the only one).")
@click.option("--env", "env", multiple=True, metavar="K=V", help="Set a variable for the command (repeatable).")
@json_option
@click.pass_context
def exec_(ctx, names, all_targets, env, as_json) -> None:
    """Run a command in each target's container (the node itself for a target without vmid).

    `dflash-ops exec ct200 -- nvidia-smi`: output streams as it comes and the exit status is the
    command's; several targets run in parallel, each line led by `[target]`, exit 1 if any failed.
    --json keeps the first MiB of each target's stdout and of its stderr (the rest counted: stdout_bytes,
    stdout_truncated). Ctrl-C (or SIGTERM) ends the command on every target, exit 130 (143).
    """
    from orchestrator.targets import exec as exec_mod
    from orchestrator.envvars import parse_assignments

    state: State = ctx.obj
    targets = exec_mod.select(state.inv, names, all_targets)     # an unknown target first: it may be a typo
    argv = exec_mod.check_command(ctx.meta["command"])
    variables = parse_assignments(env)
    if as_json:
        results = exec_mod.exec_command(state.inv, targets, argv, env=variables, keep=exec_mod.KEEP_BYTES)
        emit(True, {"targets": {r.target: r.as_json() for r in results}}, "")
        sys.exit(exec_mod.exit_status(results))
    streams = exec_mod.Streams([t.name for t in targets], sys.stdout.buffer, sys.stderr.buffer)
    try:
        results = exec_mod.exec_command(state.inv, targets, argv, env=variables,
                                        out=streams.sink("out"), err=streams.sink("err"))
    finally:
        streams.flush()     # interrupted too: the lines so far, whole, before the line saying so
    if len(results) == 1 and results[0].error:
        raise OpsError(results[0].error)
    if len(results) == 1 and results[0].note:
        click.echo(f"dflash-ops: {results[0].note}", err=True)
    for r in results:
        if r.error:
            click.echo(f"[{r.target}] dflash-ops: {r.error}", err=True)
        elif len(results) > 1 and not r.ok:
            click.echo(f"[{r.target}] dflash-ops: exit status {r.exit_code}"
                       + (f": {r.note.split(': ', 1)[1]}" if r.note else ""), err=True)
    sys.exit(exec_mod.exit_status(results))


# --- scan ------------------------------------------------------------------------------------

@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@json_option
def scan(files, as_json):
    """Scan saved log files for failure signatures, offline (exit 100 when one is fatal)."""
    from orchestrator.targets.scan import scan_files
    from orchestrator.errors import EXIT_RUN_FAILED

    doc = scan_files(list(files))
    lines, fatal = [], False
    for path, hits in doc["files"].items():
        for h in hits:
            fatal |= h["severity"] == "fatal"
            lines.append(f"{path}:{h['line']}: {h['severity']}: {h['signature']}: {h.get('meaning', '')}")
            if h.get("remedy"):
                lines.append(f"    what to do: {h['remedy']}")
    if not lines:
        lines.append("no failure signatures found")
    emit(as_json, doc, "\n".join(lines))
    if fatal:
        sys.exit(EXIT_RUN_FAILED)

