"""Write-to-temp-then-rename, written once: a file or a folder appears complete or not at all.

The temporary sits beside the destination (same filesystem, so the rename is atomic on POSIX) and is
named `.tmp-NAME-PID`; what a killed writer leaves behind is recognisable as such. On an exception
the temporary is removed and the destination is untouched.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


def temp_beside(dest: Path) -> Path:
    return dest.parent / f".tmp-{dest.name}-{os.getpid()}"


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_best_effort(path: Path) -> None:
    """fsync a folder (or file); some filesystems refuse it on a folder, and a rename stays atomic."""
    try:
        fsync_file(path)
    except OSError:  # some filesystems refuse fsync on a directory; the rename is still atomic
        pass


@contextmanager
def atomic_file(path: str | Path, *, sync: bool = True) -> Iterator[IO[str]]:
    """Open a temporary beside `path` for writing text; on a clean exit it replaces `path` (flushed
    and fsynced first, and the folder after it, unless sync=False)."""
    path = Path(path)
    tmp = temp_beside(path)
    try:
        with tmp.open("w", encoding="utf-8") as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync:
        fsync_best_effort(path.parent)


def umask() -> int:
    """The process's umask, read without setting it (os.umask would change it for every thread a
    moment); 0o022 where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        return 0o022


@contextmanager
def atomic_folder(dest: str | Path) -> Iterator[Path]:
    """A fresh temporary folder beside `dest` to fill; on a clean exit its files are fsynced and it
    replaces `dest` (whatever was there). Each file is readable as a file open() made would be:
    safetensors writes its files 0600, beside the rest's 0644."""
    dest = Path(dest)
    tmp = temp_beside(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        usual = 0o666 & ~umask()
        for f in tmp.iterdir():
            if f.is_file():
                os.chmod(f, (f.stat().st_mode & 0o777) | usual)
            fsync_file(f)
        fsync_best_effort(tmp)
        if dest.exists():
            shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
        os.rename(tmp, dest)
        fsync_best_effort(dest.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after the rename
