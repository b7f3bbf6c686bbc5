"""Turn a byte stream into whole text lines (for live progress from a remote program)."""
from __future__ import annotations

from typing import Callable


class LineBuffer:
    """Feed bytes; `emit(line)` is called once per complete line (without the newline)."""

    def __init__(self, emit: Callable[[str], None]):
        self.emit, self.pending = emit, b""

    def __call__(self, data: bytes) -> None:
        self.pending += data
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            self.emit(line.decode("utf-8", errors="replace"))

    def flush(self) -> None:
        if self.pending:
            self.emit(self.pending.decode("utf-8", errors="replace"))
            self.pending = b""
