"""Process edge of the trainer: runs a main function and maps its errors to exit codes, in one place.

UsageError and policy errors (bad input) -> one line on stderr, exit 2, no traceback.
TrainerError -> one line, exit 1. Anything else -> its traceback (the log is scanned for failure
signatures, so tracebacks of real crashes are kept), exit 1.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

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


def train_entry(argv: list[str] | None = None) -> int:
    """`python -m trainer`: flags and config are checked before torch is imported (fast, one line)."""
    from trainer.config import parse

    cfg = parse(argv)
    from trainer.train import main

    return main(cfg)
