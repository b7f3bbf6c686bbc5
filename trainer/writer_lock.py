"""One writer per output: an exclusive lock beside a file or folder a user names.

`python -m trainer.regen --out F` (and small_lm's `--prompts --out F`, export's `-o DIR`, specdec's
`--json F`) hold an
flock on `.NAME.lock` beside the output for as long as they write it; the lock file holds the
holder's pid and run id (DFLASH_OPS_RUN, which the runs agent sets). A second writer is refused at
once, in one line naming the holder and what to do: two regens appending to one file would double
its rows. The kernel drops the lock of a process that died (SIGKILL, the OOM killer, a full disk),
so the next writer takes it over, and says whose it was. A writer that ends removes the lock file.
The lock itself is trainer/lock_file.py's, which the controller's play lock shares.

Torch-free and stdlib-only.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from trainer.errors import UsageError
from trainer.lock_file import LockHeld, LockUnopened, lock_file

RUN_ENV = "DFLASH_OPS_RUN"


def lock_path(output: str | Path) -> Path:
    output = Path(output)
    return output.parent / f".{output.name}.lock"


@contextmanager
def output_lock(output: str | Path, flag: str, *, log: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold the lock of `output` (named on the command line as `flag OUTPUT`) for the block; a live
    holder is a UsageError of one line; a dead one's lock is taken over, said through `log`."""
    lock = lock_path(output)
    mine = json.dumps({"pid": os.getpid(), "run": os.environ.get(RUN_ENV) or None}).encode()
    with ExitStack() as held:
        try:   # removed when the writer ends (lock_file's remove): a finished writer leaves no lock file
            said = held.enter_context(lock_file(lock, mine + b"\n", remove=True))
        except LockUnopened as e:
            raise UsageError(f"{flag} {output}: cannot create its lock {lock}: {e.error.strerror or e.error}") from None
        except LockHeld as e:
            holder = _holder(e.said)
            raise UsageError(f"{flag} {output}: another writer holds it ({_describe(holder)}); wait for it to end "
                             f"or stop it ({_how_to_stop(holder)}), then run again") from None
        previous = _holder(said)
        if previous and log:
            log(f"{flag} {output}: its previous writer ({_describe(previous)}) died holding the lock; taken over")
        yield


def _holder(said: bytes) -> dict | None:
    try:
        doc = json.loads(said or b"null")
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("pid"), int) else None


def _describe(holder: dict | None) -> str:
    if holder is None:
        return "a process that has not said which yet"
    return f"pid {holder['pid']}" + (f", run {holder['run']}" if holder.get("run") else "")


def _how_to_stop(holder: dict | None) -> str:
    if holder and holder.get("run"):
        return f"`dflash-ops stop TARGET {holder['run']}`"
    if holder:
        return f"`kill {holder['pid']}`"
    return "the process writing it"
