"""JSONL files as the trainer reads them: (line number, value) per non-empty line, bad input named
by file:line. Torch-free, so the controller checks a prompts file with it before it uploads one."""
from __future__ import annotations

import json
from pathlib import Path

from trainer.errors import UsageError


def read_jsonl(path: str, flag: str) -> list[tuple[int, object]]:
    """(line number, value) for each non-empty line of a JSONL file; bad JSON or text that is not
    UTF-8 is a UsageError naming file:line, a missing, unreadable or empty file one naming the
    option (`flag`)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{flag} {path}: no such file")
    values = []
    try:
        with p.open("rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise UsageError(f"{path}:{n}: not UTF-8 text") from None
                if not line.strip():
                    continue
                try:
                    values.append((n, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise UsageError(f"{path}:{n}: not JSON: {e.msg}") from None
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read: {e.strerror or e}") from None
    if not values:
        raise UsageError(f"{flag} {path}: no rows")
    return values
