"""One writer per output: an exclusive lock beside a file or folder a user names.

`python -m trainer.regen --out F` (and small_lm's `--prompts --out F`, export's `-o DIR`, specdec's
`--json F`) hold an
flock on `.NAME.lock` beside the output for as long as they write it; the lock file holds the
holder's pid and run id (DFLASH_OPS_RUN, which the runs agent sets). A second writer is refused at
once, in one line naming the holder and what to do: two regens appending to one file would double
its rows. The kernel drops the lock of a process that died (SIGKILL, the OOM killer, a full disk),
so the next writer takes it over, and says whose it was. A writer that ends removes the lock file.

Torch-free and stdlib-only.
"""
from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from trainer.errors import UsageError

RUN_ENV = "DFLASH_OPS_RUN"


def lock_path(output: str | Path) -> Path:
    output = Path(output)
    return output.parent / f".{output.name}.lock"


@contextmanager
def output_lock(output: str | Path, flag: str, *, log: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold the lock of `output` (named on the command line as `flag OUTPUT`) for the block; a live
    holder is a UsageError of one line; a dead one's lock is taken over, said through `log`."""
    lock = lock_path(output)
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise UsageError(f"{flag} {output}: cannot create its lock {lock}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise UsageError(f"{flag} {output}: another writer holds it ({_describe(holder)}); wait for it to end "
                             f"or stop it ({_how_to_stop(holder)}), then run again") from None
        try:   # a writer that ended between our open and our flock removed the file we hold: lock the new one
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        previous = _holder(fd)
        if previous and log:
            log(f"{flag} {output}: its previous writer ({_describe(previous)}) died holding the lock; taken over")
        mine = json.dumps({"pid": os.getpid(), "run": os.environ.get(RUN_ENV) or None}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, mine + b"\n", 0)
        yield
    finally:
        try:   # removed while still held, so no other writer ever holds a file that is then removed
            os.unlink(lock)
        except OSError:
            pass
        os.close(fd)


def _holder(fd: int) -> dict | None:
    try:
        doc = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
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
