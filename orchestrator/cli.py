"""Click only: parse options, call one library function, print its result.

Error families map to exit codes in one place, `main()`; expected failures print one line,
`--debug` shows the traceback.
"""
from __future__ import annotations

import json
import os
import sys

import click

from trainer.policies import POLICY_NAMES   # names only: importing it does not import torch

from . import inventory as inv_mod
from .errors import EXIT_FAILED, EXIT_OK, OpsError, TargetsFailed
from .ui import progress_bars, table

CONTEXT = dict(help_option_names=["-h", "--help"], max_content_width=100)


class State:
    def __init__(self, inventory: str | None, debug: bool, ssh_config: str | None = None):
        self.inventory_path, self.debug, self.ssh_config = inventory, debug, ssh_config
        self._inv = None

    @property
    def inv(self) -> inv_mod.Inventory:
        if self._inv is None:
            self._inv = inv_mod.load(self.inventory_path, ssh_config=self.ssh_config)
        return self._inv


def json_option(f):
    """Every command takes --json: one JSON document on stdout, nothing else there."""
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")(f)


def emit(as_json: bool, doc, text: str) -> None:
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))
    else:
        click.echo(text)


@click.group(context_settings=CONTEXT)
@click.option("-i", "--inventory", metavar="PATH", help="hosts.yaml (default: $DFLASH_OPS_INVENTORY, ./hosts.yaml).")
@click.option("-F", "--ssh-config", metavar="PATH", type=click.Path(exists=True, dir_okay=False),
              help="ssh_config file to read (default: the inventory's ssh_config:, else ~/.ssh/config).")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(package_name="dflash-ops")
@click.pass_context
def cli(ctx, inventory, ssh_config, debug):
    """Deploy, probe, launch and follow DFlash drafter training on Proxmox GPU containers."""
    ctx.obj = State(inventory, debug, ssh_config)


# --- targets ---------------------------------------------------------------------------------

@cli.command()
@click.option("--check", is_flag=True, help="Connect to each target in parallel and report what is there.")
@click.argument("names", nargs=-1)
@json_option
@click.pass_obj
def targets(state: State, check, names, as_json):
    """List targets; --check reaches each (container state, python, torch)."""
    from . import targets as targets_mod

    inv = state.inv
    if not check:
        rows = [{"target": t.name, "where": targets_mod.describe(inv, t), "python": t.python,
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
                 c.release, c.error] for c in checks]))
    failed = {c.target: c.error or "failed" for c in checks if not c.ok}
    if failed:
        raise TargetsFailed(failed)


# --- deploy ----------------------------------------------------------------------------------

@cli.command()
@click.argument("names", nargs=-1, metavar="TARGET...")
@click.option("--dry-run", is_flag=True, help="List what would change; send nothing.")
@click.option("--source", metavar="DIR", help="Folder to ship (default: this checkout; required elsewhere).")
@click.option("--install-deps", is_flag=True, help="pip-install the trainer's missing requirements (never torch).")
@click.option("--verify", is_flag=True,
              help="Hash every file of the live release (default: sizes and mtimes, hashes where they differ).")
@json_option
@click.pass_obj
def deploy(state: State, names, dry_run, source, install_deps, verify, as_json):
    """Sync code into WORKDIR/releases/ID on each target and flip WORKDIR/current atomically."""
    from . import deploy as deploy_mod

    root, _ = deploy_mod.source_root(source)      # refuses outside a checkout without --source
    shipping = f"{root} ({'--source' if source else 'this checkout'})"
    results = deploy_mod.deploy(state.inv, list(names), source=source, dry_run=dry_run,
                                install_deps=install_deps, verify=verify,
                                progress=None if as_json else progress_bars(),
                                on_line=lambda t, line: click.echo(f"[{t}] {line}", err=True))
    doc = {"source": str(root), "targets": {n: r.as_json() for n, r in results.items()}}
    lines = [f"shipping {shipping}"]
    for r in results.values():
        if not r.ok:
            lines.append(f"{r.target}: FAILED: {r.error}")
            continue
        if r.dry_run:
            lines.append(f"{r.target}: would send {r.files_sent} file(s) ({_size(r.bytes_sent)}), "
                         f"delete {r.files_deleted}")
            lines += [f"  + {p}" for p in r.changed] + [f"  - {p}" for p in r.deleted]
        elif r.unchanged:
            lines.append(f"{r.target}: up to date at {r.release} ({r.seconds:.2f} s)")
        else:
            lines.append(f"{r.target}: release {r.release}: sent {r.files_sent} file(s) "
                         f"({_size(r.bytes_sent)}), deleted {r.files_deleted} ({r.seconds:.2f} s)")
        if r.repaired:
            lines.append(("  would repair" if r.dry_run else "  repaired")
                         + f" {len(r.repaired)} missing or damaged file(s) of the live release: "
                         + ", ".join(r.repaired[:5])
                         + (" ..." if len(r.repaired) > 5 else ""))
        lines.append(f"  python {r.python}, torch {r.torch or 'not installed'}")
        if r.deps is not None:
            installed = r.deps.get("changed") or []
            lines.append(f"  requirements: installed {', '.join(installed)}" if installed
                         else "  requirements: already installed")
    emit(as_json, doc, "\n".join(lines))
    failed = {r.target: r.error for r in results.values() if not r.ok}
    if failed:
        raise TargetsFailed(failed)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# --- probe -----------------------------------------------------------------------------------

def _policy_list(ctx, param, value: str | None) -> str | None:
    """--policies A,B: known names only, refused before anything connects."""
    if value is None:
        return None
    names = [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in POLICY_NAMES]
    if bad or not names:
        raise click.BadParameter(f"{', '.join(bad) or repr(value)}: not a policy "
                                 f"(choose from {', '.join(POLICY_NAMES)})")
    return ",".join(names)


@cli.command()
@click.argument("names", nargs=-1, metavar="[TARGET...]")
@click.option("--gpus", type=click.IntRange(min=1), help="Worker threads to test (default: the target's gpus, at least 2).")
@click.option("--policies", metavar="A,B", callback=_policy_list,
              help="Only these policies (default: all).")
@click.option("--case-timeout", type=click.IntRange(min=10),
              help="Seconds before one case counts as hung (default: 600 on CUDA, 300 on CPU).")
@click.option("--topologies", type=click.Choice(["threads", "threads,processes"]),
              help="threads: skip the DDP cases (default: both).")
@click.option("--reuse", is_flag=True,
              help="Keep the saved result (WORKDIR/probe.json) when the torch installed now made it.")
@json_option
@click.pass_obj
def probe(state: State, names, gpus, policies, case_timeout, topologies, reuse, as_json):
    """Verify the PyTorch build and find, by experiment, the compile policy for threaded training."""
    from . import probe as probe_mod

    def live(target: str, line: str) -> None:
        click.echo(f"[{target}] {line}", err=True)

    doc = probe_mod.probe(state.inv, list(names), gpus=gpus,
                          policies=policies.split(",") if policies else None,
                          on_line=live, case_timeout=case_timeout, reuse=reuse,
                          topologies=topologies.split(",") if topologies else None)
    blocks = []
    for name, res in doc["targets"].items():
        if not res.get("ok"):
            blocks.append(f"{name}: could not probe: {res.get('error')}")
            continue
        tv = res.get("torch", {})
        head = (f"{name}: torch {tv.get('version')} cuda {tv.get('cuda') or '-'} "
                f"gpus {len(tv.get('gpus') or [])} {', '.join(sorted(set(tv.get('gpus') or [])))}"
                + (f" (the saved result of {res['reused']}, reused)" if res.get("reused") else ""))
        mismatches = (res.get("expect") or {}).get("mismatches") or []
        rows = [[c["policy"], c["topology"], c["threads"], c["outcome"],
                 f"{c['step_ms']:.1f}" if c.get("step_ms") is not None else None,
                 _grad_cell(c), c.get("signature")]
                for c in res.get("cases", [])]
        wrong = [f"  WRONG: {c['policy']} {c['topology']}: {c.get('error')}"
                 for c in res.get("cases", []) if c.get("outcome") == "wrong"]
        blocks.append("\n".join([head, *(f"  MISMATCH: {m}" for m in mismatches),
                                 table(["POLICY", "TOPOLOGY", "N", "OUTCOME", "STEP_MS",
                                        "GRAD_ERR/TOL", "SIGNATURE"], rows), *wrong,
                                 f"chosen policy: {res.get('policy')} ({res.get('reason', '')})",
                                 *([f"for --topology processes: {res['processes_policy']} "
                                    f"({res.get('processes_reason', '')})"]
                                   if res.get("processes_policy") else [])]))
    emit(as_json, doc, "\n\n".join(blocks))
    failed = {n: r.get("error") for n, r in doc["targets"].items() if not r.get("ok")}
    if failed:
        raise TargetsFailed(failed)


def _grad_cell(case: dict) -> str | None:
    """The gradient error against eager and the case's noise-derived tolerance, e.g. `3.1e-07/3e-06`."""
    err, tol = case.get("grad_err"), case.get("grad_tol")
    if err is None and tol is None:
        return None
    return f"{'-' if err is None else f'{err:.2g}'}/{'-' if tol is None else f'{tol:.2g}'}"


# --- exec ------------------------------------------------------------------------------------

class _CommandAfterDashes(click.Command):
    """Everything after the first `--` is the remote command, kept verbatim (click would drop
    the `--` itself and leave no way to tell targets from the command's words)."""

    def parse_args(self, ctx, args):
        if "--" in args:
            i = args.index("--")
            ctx.meta["command"] = list(args[i + 1:])
            args = args[:i]
        else:
            ctx.meta["command"] = []
        return super().parse_args(ctx, args)


@cli.command("exec", cls=_CommandAfterDashes)
@click.argument("names", nargs=-1, metavar="TARGET...")
@click.option("--all", "all_targets", is_flag=True,
              help="Every target hosts.yaml defines (the built-in local only when it is the only one).")
@click.option("--env", "env", multiple=True, metavar="K=V", help="Set a variable for the command (repeatable).")
@json_option
@click.pass_context
def exec_(ctx, names, all_targets, env, as_json):
    """Run a command in each target's container (the node itself for a target without vmid).

    `dflash-ops exec ct200 -- nvidia-smi`: output streams as it comes and the exit status is the
    command's; several targets run in parallel, each line led by `[target]`, exit 1 if any failed.
    """
    from . import exec as exec_mod
    from .envvars import parse_assignments

    state: State = ctx.obj
    argv = exec_mod.check_command(ctx.meta["command"])
    variables = parse_assignments(env)
    targets = exec_mod.select(state.inv, names, all_targets)
    if as_json:
        results = exec_mod.exec_command(state.inv, targets, argv, env=variables)
        emit(True, {"targets": {r.target: r.as_json() for r in results}}, "")
        sys.exit(exec_mod.exit_status(results))
    streams = exec_mod.Streams([t.name for t in targets], sys.stdout.buffer, sys.stderr.buffer)
    results = exec_mod.exec_command(state.inv, targets, argv, env=variables,
                                    out=streams.sink("out"), err=streams.sink("err"))
    streams.flush()
    if len(results) == 1 and results[0].error:
        raise OpsError(results[0].error)
    for r in results:
        if r.error:
            click.echo(f"[{r.target}] dflash-ops: {r.error}", err=True)
        elif len(results) > 1 and not r.ok:
            click.echo(f"[{r.target}] dflash-ops: exit status {r.exit_code}", err=True)
    sys.exit(exec_mod.exit_status(results))


# --- scan ------------------------------------------------------------------------------------

@cli.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@json_option
def scan(files, as_json):
    """Scan saved log files for failure signatures, offline (exit 100 when one is fatal)."""
    from .scan import scan_files
    from .errors import EXIT_RUN_FAILED

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


# --- entry point -----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    if debug:   # library logs (paramiko's transport thread) to stderr
        import logging
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    try:
        code = cli.main(args=argv, prog_name="dflash-ops", standalone_mode=False)
        sys.exit(code or EXIT_OK)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except OpsError as e:
        if debug:
            raise
        click.echo(f"dflash-ops: {e.render()}", err=True)
        sys.exit(e.exit_code)
    except BrokenPipeError:
        # `dflash-ops logs | head`: the reader went away; that is not an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(EXIT_OK)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:
        if debug:
            raise
        click.echo(f"dflash-ops: internal error: {type(e).__name__}: {e} (run with --debug for the traceback)",
                   err=True)
        sys.exit(EXIT_FAILED)


if __name__ == "__main__":
    # `python -m orchestrator.cli` runs this file as __main__, a second copy of the module: hand
    # over to the real one, whose group has every command registered (cli_runs, below).
    from orchestrator.cli import main as _main
    _main()

from . import cli_runs  # noqa: E402,F401  (registers launch, logs, status, stop, report, export)
from . import cli_housekeeping  # noqa: E402,F401  (registers rm, prune)
from . import cli_play  # noqa: E402,F401  (registers play)
