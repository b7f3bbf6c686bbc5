"""The trainer's expected failures: each renders itself as one line.

`trainer.exits` maps them to exit codes in one place; anything else is a bug or a crash and
keeps its traceback (the log is scanned for failure signatures, so tracebacks are useful there).
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PEER_FAILED = 3  # a rank of a job over several nodes ended because another rank or node failed first
EXIT_SIGTERM = 143  # 128 + SIGTERM, what a shell reports for a process killed by TERM


class TrainerError(Exception):
    """A failure the trainer understands; `str(err)` is the one line a user sees."""

    exit_code = EXIT_FAILED


class UsageError(TrainerError):
    """Bad input: flags, config keys, files, data, a target that is not a model."""

    exit_code = EXIT_USAGE


class Stopped(TrainerError):
    """SIGTERM arrived before there was anything to checkpoint (e.g. while generating data)."""

    exit_code = EXIT_SIGTERM
