"""Process edge of the trainer: runs a main function and maps its errors to exit codes, in one place.

UsageError and policy errors (bad input) -> one line on stderr, exit 2, no traceback.
TrainerError -> one line, exit 1. Anything else -> its traceback (the log is scanned for failure
signatures, so tracebacks of real crashes are kept), exit 1.

`leave` ends the process with that status; a torchrun rank ends without interpreter finalization
(`exit_now`: flush, then os._exit, as every path of the trainer that must skip it).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn

from trainer.errors import EXIT_FAILED, EXIT_USAGE, TrainerError, UsageError


def run(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    from trainer.policies import PolicyError

    try:
        sys.stdout.reconfigure(line_buffering=True)  # a log tail sees each line as it is printed
    except (AttributeError, ValueError):
        pass
    try:
        return main(argv)
    except (UsageError, PolicyError) as e:
        print(f"trainer: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except TrainerError as e:
        if e.__cause__ is not None:  # a worker's crash: keep where it happened
            import traceback

            traceback.print_exception(e.__cause__, file=sys.stderr)
        print(f"trainer: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("trainer: interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:
        return EXIT_FAILED


def in_rank() -> bool:
    """True in a process torchrun started (it sets LOCAL_RANK and WORLD_SIZE)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def leave(code: int) -> NoReturn:
    """Exit with `code`. A torchrun rank skips interpreter finalization (os._exit, after a flush).

    Gloo's worker threads outlive destroy_process_group while anything (DDP) still holds the group,
    and one of them may drop the last reference to a finished collective's tensors after the main
    thread has begun finalizing: freeing a Python-owned tensor then needs the GIL, the thread is
    unwound from a noexcept destructor, and the rank dies with SIGABRT ("terminate called without an
    active exception") after its work is done, failing the run. Seen on CPU in about one run in ten.
    Everything a rank writes (metrics, checkpoints, results) is written and closed before this.
    """
    if not in_rank():
        sys.exit(code)
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """Flush stdout and stderr, then exit with `code` without interpreter finalization (no atexit
    handlers, no finalizers: where those could crash or hang after the outcome is known)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def train_entry(argv: list[str] | None = None) -> int:
    """`python -m trainer`: flags and config are checked before torch is imported (fast, one line)."""
    from trainer.config import parse

    cfg = parse(argv)
    from trainer.train import main

    return main(cfg)
