"""A lock file that names its holder: an exclusive flock on a file whose content says who holds it.

The one mechanism under the trainer's one writer per output (writer_lock.py) and, through
trainer.controller_view, the controller's one player per playbook and target (orchestrator/play/player.py).
Each caller names its file, writes what it says of itself, and words its own refusal: this module
only takes, reads and lets go. The flock is taken without waiting, so a live holder is refused at
once (LockHeld, with what it wrote); the kernel drops the lock of a process that died however it
died (SIGKILL, the OOM killer, a full disk), so the next taker takes it over and is told what the
dead one wrote.

Torch-free and stdlib-only: the controller imports it where there is no torch.
"""
from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class LockHeld(Exception):
    """A live process holds the lock; `said` is what it wrote in the file (b"" when unreadable)."""

    def __init__(self, said: bytes) -> None:
        super().__init__("the lock is held")
        self.said = said


class LockUnopened(Exception):
    """The lock file could not be opened or created; `error` is the OSError."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


@contextmanager
def lock_file(path: str | Path, mine: bytes, *, remove: bool) -> Iterator[bytes]:
    """Hold the flock of `path` (created if missing) for the block, with `mine` as the file's content;
    yields what the previous holder left in it (b"" when nothing: a dead holder's otherwise). A live
    holder is LockHeld, a file that cannot be opened LockUnopened; other OSErrors pass as they are.

    remove: the file is removed when the block ends, while still held, so no other taker ever holds
    a file that is then removed (a taker that opened the old file finds it gone and opens the new
    one); else the file stays, and the next taker opens the same one."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise LockUnopened(e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            said = _said(fd)
            os.close(fd)
            raise LockHeld(said) from None
        except BaseException:
            os.close(fd)
            raise
        try:   # a holder that ended between our open and our flock removed the file we hold: lock the new one
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        previous = _said(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, mine, 0)
        yield previous
    finally:
        if remove:
            try:
                os.unlink(path)
            except OSError:
                pass
        os.close(fd)       # the lock goes with it


def _said(fd: int) -> bytes:
    try:
        return os.pread(fd, 4096, 0)
    except OSError:
        return b""
