"""Process edge of the trainer: runs a main function and maps its errors to exit codes, in one place.

UsageError and policy errors (bad input) -> one line on stderr, exit 2, no traceback.
TrainerError -> one line, exit 1. Anything else -> its traceback (the log is scanned for failure
signatures, so tracebacks of real crashes are kept), exit 1.

`exit_process` ends the process with a status; a torchrun rank ends without interpreter
finalization (flush, then os._exit, as every path of the trainer that must skip it).
"""
from __future__ import annotations

import gc
import io
import os
import sys
from collections.abc import Callable
from typing import NoReturn, cast

from trainer.errors import EXIT_FAILED, EXIT_USAGE, TrainerError, UsageError


def run(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    from trainer.policies import PolicyError

    try:
        # a log tail sees each line as it is printed; a replaced stdout may lack reconfigure
        cast(io.TextIOWrapper, sys.stdout).reconfigure(line_buffering=True)
    except (AttributeError, ValueError):
        pass
    try:
        return main(argv)
    except (UsageError, PolicyError) as e:
        print(f"trainer: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except TrainerError as e:
        report(e)
        return e.exit_code
    except KeyboardInterrupt:
        print("trainer: interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:
        return EXIT_FAILED


def report(e: TrainerError, where: str = "") -> None:
    """A failure on stderr: its cause's traceback (a worker's crash: where it happened), `where` (a
    hung worker's stack), then the one `trainer: error:` line the signatures read."""
    if e.__cause__ is not None:
        import traceback

        traceback.print_exception(e.__cause__, file=sys.stderr)
    if where:
        print(where, file=sys.stderr)
    print(f"trainer: error: {e}", file=sys.stderr, flush=True)


def in_rank() -> bool:
    """True in a process torchrun started (it sets LOCAL_RANK and WORLD_SIZE)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def exit_process(code: int, *, finalize: bool | None = None) -> NoReturn:
    """End the process with status `code`: the one way the trainer's programs exit.

    finalize=True: `sys.exit` (atexit handlers and finalizers run), every object alive then frozen
    first: the interpreter's last collections would walk all of torch's and transformers' objects
    several times over, most of a short run's exit (docs/decisions.md). Frozen objects are
    left to the OS, as the process's memory is; garbage in cycles goes unfinalized, and nothing
    needs it: files are closed where they are written. finalize=False: flush stdout and
    stderr, then `os._exit`, where finalization could crash or hang after the outcome is known (a
    worker thread stuck in a compile, native state a failed CUDA-graph warm-up left behind).
    The default: finalize, except in a torchrun rank (in_rank()). Gloo's worker threads outlive
    destroy_process_group while DDP holds the group, and one may free a finished collective's
    tensors while the main thread finalizes, aborting the rank (SIGABRT) after its work is done;
    everything a rank writes is written and closed before this.
    """
    if finalize is None:
        finalize = not in_rank()
    if finalize:
        gc.freeze()
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
