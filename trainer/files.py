"""Write-to-temp-then-rename, written once: a file or a folder appears complete or not at all.

The temporary sits beside the destination (same filesystem, so the rename is atomic on POSIX) and is
named `.tmp-NAME-PID`; what a killed writer leaves behind is recognisable as such. On an exception
the temporary is removed and the destination is untouched.
"""
from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


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


class NotOurs(ValueError):
    """The destination exists and is not what this writer makes: it is never replaced (trainer/owned.py)."""

    def __init__(self, dest: Path, why: str):
        super().__init__(f"{dest}: {why}; nothing was replaced (remove it yourself, or name another folder)")
        self.dest, self.why = dest, why


@contextmanager
def atomic_folder(dest: str | Path, *, replaces: Callable[[Path], str | None]) -> Iterator[Path]:
    """A fresh temporary folder beside `dest` to fill; on a clean exit its files are fsynced and it
    takes `dest`'s place. An existing `dest` is replaced only where `replaces(dest)` says it may (None;
    else NotOurs with its reason, checked before the filling and again before the swap), and only by
    renames: the old folder moves aside (`.old-NAME-PID`), the new one in, then the old is removed, so a
    kill at any point leaves the old folder or the new one whole, never a mix and never neither
    (a kill between the two renames leaves both beside, the old one under its hidden name).
    Each file is readable as a file open() made would be: safetensors writes its files 0600, beside
    the rest's 0644."""
    dest = Path(dest)
    if why := replaces(dest):
        raise NotOurs(dest, why)
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
        swap_in(tmp, dest, replaces)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after the rename


def swap_in(new: Path, dest: Path, replaces: Callable[[Path], str | None]) -> None:
    """Put the complete folder `new` at `dest`. An existing `dest` that `replaces` allows (NotOurs
    otherwise, `new` left for the caller to remove) is exchanged with `new` in one atomic rename where
    the kernel and filesystem can (renameat2 RENAME_EXCHANGE: `dest` is whole at every instant), else
    moved aside then replaced (a kill between the two renames leaves the old one whole under
    `.old-NAME-PID`); the old folder is removed last."""
    if not os.path.lexists(dest):
        os.rename(new, dest)
        fsync_best_effort(dest.parent)
        return
    if why := replaces(dest):
        raise NotOurs(dest, why)
    if _exchange(new, dest):
        old = new
    else:
        old = dest.with_name(f".old-{dest.name}-{os.getpid()}")
        os.rename(dest, old)
        os.rename(new, dest)
    fsync_best_effort(dest.parent)
    shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where that is not available."""
    global _renameat2
    if _renameat2 is None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            _renameat2 = libc.renameat2
            _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        except (OSError, AttributeError):
            _renameat2 = False
    if not _renameat2:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    import ctypes

    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):   # a filesystem without exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


_renameat2: Any = None     # libc.renameat2 once looked up; False where there is none
