"""JSONL files as the trainer reads them: (line number, value) per non-empty line, bad input named
by file:line. Torch-free, so the controller checks a prompts file with it before it uploads one."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Iterator

from trainer.errors import UsageError


MAX_LINE_BYTES = 64 << 20     # one row: far more than any conversation a target's context takes


def read_jsonl(path: str, flag: str) -> list[tuple[int, object]]:
    """(line number, value) for each non-empty line of a JSONL file; bad JSON or text that is not
    UTF-8 is a UsageError naming file:line, a missing, unreadable or empty file one naming the
    option (`flag`)."""
    return list(iter_jsonl(path, flag))


def iter_jsonl(path: str, flag: str) -> Iterator[tuple[int, object]]:
    """read_jsonl's values one at a time, as they are read: memory bounded by a line (a line over
    MAX_LINE_BYTES is refused, file:line, before more of it is read), whatever the number of rows."""
    values = 0
    try:
        with _regular_file(path, flag) as f:
            n = 0
            while raw := f.readline(MAX_LINE_BYTES + 1):
                n += 1
                if len(raw) > MAX_LINE_BYTES:
                    raise UsageError(f"{path}:{n}: a line of more than {MAX_LINE_BYTES >> 20} MiB")
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:     # as hosts.yaml's and --config's: the byte named
                    raise UsageError(f"{path}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                     f"{e.start + 1}); save the file as UTF-8") from None
                if not line.strip():
                    continue
                line = line.rstrip("\r\n")     # an error's column is then on the row's own line
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    what = "a NUL byte" if line[e.pos:e.pos + 1] == "\0" else e.msg.removesuffix(" at")
                    raise UsageError(f"{path}:{n}: not JSON: {what} at column {e.colno}") from None
                except RecursionError:
                    raise UsageError(f"{path}:{n}: not JSON: nested too deeply") from None
                values += 1
                yield n, value
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read: {e.strerror or e}") from None
    if not values:
        raise UsageError(f"{flag} {path}: no rows")


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _regular_file(path: str, flag: str):
    """The file open for reading, refused unless it is a regular file: opened without waiting (a
    FIFO with no writer would block the open, and a read of it or of a device may never end)."""
    def check(mode: int) -> None:
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a plain file")
            raise UsageError(f"{flag} {path}: not a regular file ({kind}); name a file")

    try:
        check(os.stat(path).st_mode)           # a socket cannot even be opened (ENXIO)
        fd = os.open(Path(path), os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: no such file") from None
    f = open(fd, "rb")
    try:
        check(os.fstat(fd).st_mode)            # what was opened, should the name have moved
    except UsageError:
        f.close()
        raise
    return f
