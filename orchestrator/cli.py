"""The entry point: the root group, its global options, every feature's commands registered, and
`main()`, where error families map to exit codes in one place; expected failures print one line,
`--debug` shows the traceback.

The commands live with their feature (targets/, deploy/, probe/, runs/, play/); this module
imports them, and none of them imports it.
"""
from __future__ import annotations

import atexit
import difflib
import gc
import importlib
import os
import sys

import click

from orchestrator.errors import EXIT_FAILED, EXIT_OK, OpsError
from orchestrator.ui import State

CONTEXT = dict(help_option_names=["-h", "--help"], max_content_width=100)

# Every command: its name, and the module and attribute that define it (`--help` lists them sorted,
# as click does). A command's module is imported when the command runs (or `--help` lists them all): a
# no-change `deploy` then imports deploy's modules only, not those of probe, runs and play: imports are
# most of the controller's own CPU, which is what a loaded machine charges every command (docs/decisions.md,
# "deploy and SSH", has the figures).
COMMANDS = {
    "targets": ("orchestrator.targets.target_commands", "targets"),
    "exec": ("orchestrator.targets.target_commands", "exec_"),
    "scan": ("orchestrator.targets.target_commands", "scan"),
    "deploy": ("orchestrator.deploy.deploy_commands", "deploy"),
    "probe": ("orchestrator.probe.probe_commands", "probe"),
    "launch": ("orchestrator.runs.run_commands", "launch"),
    "regen": ("orchestrator.runs.regen_commands", "regen"),
    "logs": ("orchestrator.runs.run_commands", "logs"),
    "status": ("orchestrator.runs.run_commands", "status"),
    "stop": ("orchestrator.runs.run_commands", "stop"),
    "report": ("orchestrator.runs.run_commands", "report"),
    "export": ("orchestrator.runs.run_commands", "export"),
    "tensorboard": ("orchestrator.runs.tensorboard_commands", "tensorboard"),
    "bench-decode": ("orchestrator.runs.bench_commands", "bench_decode"),
    "rm": ("orchestrator.runs.cleanup_commands", "rm"),
    "prune": ("orchestrator.runs.cleanup_commands", "prune"),
    "play": ("orchestrator.play.play_commands", "play"),
}


class Commands(click.Group):
    """The root group, its commands imported on first use (COMMANDS)."""

    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attribute = COMMANDS[name]
        return getattr(importlib.import_module(module), attribute)

    def resolve_command(self, ctx, args):
        """A misspelled command gets the "did you mean" that a misspelled option gets."""
        name = args[0] if args else ""
        if name and not name.startswith("-") and name not in COMMANDS:
            close = difflib.get_close_matches(name, sorted(COMMANDS), n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (commands: {', '.join(sorted(COMMANDS))})"
            raise click.UsageError(f"No such command '{name}'{hint}.", ctx)
        return super().resolve_command(ctx, args)


@click.group(cls=Commands, context_settings=CONTEXT)
@click.option("-i", "--inventory", metavar="PATH", help="hosts.yaml (default: $DFLASH_OPS_INVENTORY, ./hosts.yaml).")
@click.option("-F", "--ssh-config", metavar="PATH", type=click.Path(exists=True, dir_okay=False),
              help="ssh_config file to read (default: the inventory's ssh_config:, else ~/.ssh/config).")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(package_name="dflash-ops")
@click.pass_context
def cli(ctx, inventory, ssh_config, debug):
    """Deploy, probe, launch and follow DFlash drafter training on Proxmox GPU containers."""
    ctx.obj = State(inventory, debug, ssh_config)


# --- entry point -----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    # At exit the interpreter's last collections walk every object of every module imported
    # (paramiko's, cryptography's), several times over: about a tenth of a no-change deploy.
    # Frozen, they are left to the OS, as the process's memory is; garbage in cycles then goes
    # unfinalized, and nothing needs it: files and connections are closed where they are used.
    atexit.register(gc.freeze)
    from orchestrator import waits
    waits.note = lambda target, what, s: click.echo(
        f"dflash-ops: {target}: still waiting on the target to {what} ({s:.0f} s)", err=True)
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
    main()
