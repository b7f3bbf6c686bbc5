"""Turn a byte stream into whole lines: live progress from a remote program (LineBuffer, ByteLines),
exec's `[target] ` lines (Prefixed), the last line of an exec step's output (LastLine). In time linear
in the stream's size: each feed is looked at once, and only the line under way is held; with a limit
(PIECE), a longer line comes in pieces, so that what is held is bounded too."""
from __future__ import annotations

from typing import Callable

PIECE = 64 * 1024       # a line longer than this is shown in pieces of at most this many bytes


def cut_point(buf, end: int, start: int = 0) -> int:
    """`end`, moved back at most 3 bytes (never to `start`) so that a piece of buf[start:] cut there does
    not split a UTF-8 character (the next byte is not a continuation byte)."""
    k = end
    while k > start + 1 and k > end - 3 and k < len(buf) and (buf[k] & 0xC0) == 0x80:
        k -= 1
    return k


def pieces(line: bytes, limit: int | None) -> list[bytes]:
    """A line as pieces of at most `limit` bytes (itself when shorter, or for None), cut at cut_point."""
    if limit is None or len(line) <= limit:
        return [line]
    out, start = [], 0
    while len(line) - start > limit:
        k = cut_point(line, start + limit, start)
        out.append(line[start:k])
        start = k
    out.append(line[start:])
    return out


def feeds(data: bytes, limit: int | None) -> list[bytes]:
    """data as feeds of at most `limit` bytes (itself when shorter, or for None): a feed can then
    complete at most one line longer than `limit`, the one under way when it came."""
    if limit is None or len(data) <= limit:
        return [bytes(data)]
    view = memoryview(data)
    return [bytes(view[i:i + limit]) for i in range(0, len(data), limit)]


def cut_overflow(pending: bytearray, limit: int) -> list[bytes]:
    """The pieces of at most `limit` bytes cut from the front of a line under way longer than `limit`,
    taken out of `pending` (which keeps 1..limit bytes: a newline next ends them); [] when it fits."""
    out, start = [], 0
    while len(pending) - start > limit:
        k = cut_point(pending, start + limit, start)
        out.append(bytes(pending[start:k]))
        start = k
    del pending[:start]
    return out


class ByteLines:
    """Feed bytes; `on_lines(lines)` gets the lines each feed completes (without their newlines), in one
    list. With `limit`, a line longer than that many bytes comes as pieces of at most `limit` bytes, each
    a line of its own (cut where no UTF-8 character is split): what waits for a newline is less than
    `limit` bytes (plus the feed under way). flush(): the line under way, if any, as a last line."""

    def __init__(self, on_lines: Callable[[list[bytes]], None], limit: int | None = None):
        if limit is not None and limit < 4:
            raise ValueError("limit: at least 4 bytes (one UTF-8 character)")
        self.on_lines, self.limit = on_lines, limit
        self.pending = bytearray()

    def __call__(self, data: bytes) -> None:
        for feed in feeds(data, self.limit) if data else ():
            self._feed(feed)

    def _feed(self, data: bytes) -> None:
        """data: at most `limit` bytes, so only the line that began before it can be longer."""
        *whole, tail = data.split(b"\n")
        out: list[bytes] = []
        if whole:
            first = whole[0]
            if self.pending:            # the line under way ends here (held: < limit)
                first = bytes(self.pending) + first
                self.pending.clear()
            out = pieces(first, self.limit)
            out += whole[1:]
        self.pending += tail
        if self.limit is not None:
            out += cut_overflow(self.pending, self.limit)
        if out:
            self.on_lines(out)

    def flush(self) -> None:
        if self.pending:
            line = bytes(self.pending)
            self.pending.clear()
            self.on_lines([line])


class Prefixed:
    """A sink that writes whole lines, each led by `prefix`, through `write` (once per feed that ends a
    line); a partial line waits for its end (or for flush()). A line longer than `limit` bytes is written
    in pieces of at most `limit`, each a line of its own, so what waits is less than `limit` bytes. The
    lines of a feed are prefixed by one bytes.replace, not one by one: a stream of short lines (`yes`)
    costs what a stream without newlines costs."""

    def __init__(self, prefix: bytes, write: Callable[[bytes], None], limit: int = PIECE):
        if limit < 4:
            raise ValueError("limit: at least 4 bytes (one UTF-8 character)")
        self.prefix, self.write, self.limit = prefix, write, limit
        self.pending = bytearray()

    def __call__(self, data: bytes) -> None:
        for feed in feeds(data, self.limit):
            self._feed(feed)

    def _feed(self, data: bytes) -> None:
        """data: at most `limit` bytes, so a line that starts and ends in it is no longer than `limit`."""
        first = data.find(b"\n")
        if first < 0:
            self.pending += data
            cut = cut_overflow(self.pending, self.limit)
            if cut:
                self.write(b"".join(self.prefix + piece + b"\n" for piece in cut))
            return
        last = data.rfind(b"\n")
        head = bytes(self.pending) + data[:first]       # the line under way ends here
        out = [self.prefix + p + b"\n" for p in pieces(head, self.limit)]
        if last > first:            # whole lines between: one replace
            out.append(self.prefix + data[first + 1:last + 1].replace(b"\n", b"\n" + self.prefix)[:-len(self.prefix)]
                       if self.prefix else data[first + 1:last + 1])
        self.pending = bytearray(data[last + 1:])
        self.write(b"".join(out))

    def flush(self) -> None:
        if self.pending:
            line = bytes(self.pending)
            self.pending.clear()
            self.write(self.prefix + line + b"\n")


class LineBuffer:
    """Feed bytes; `emit(line)` is called once per complete line (without the newline). With `limit`, a
    longer line comes in pieces (ByteLines)."""

    def __init__(self, emit: Callable[[str], None], limit: int | None = None):
        self.emit = emit
        self.lines = ByteLines(self._emit, limit)

    def _emit(self, lines: list[bytes]) -> None:
        for line in lines:
            self.emit(line.decode("utf-8", errors="replace"))

    def __call__(self, data: bytes) -> None:
        self.lines(data)

    def flush(self) -> None:
        self.lines.flush()


class LastLine:
    """Feed bytes; `value`: the last line that is not blank, stripped, as text (its first `limit`
    bytes: `cut` says it was longer), as `text.splitlines()` would end on it. Holds at most `limit`
    bytes of the line under way and of the last one; linear in what it is fed."""

    def __init__(self, limit: int):
        self.limit = limit
        self.line, self.line_cut, self.line_blank = bytearray(), False, True    # the line under way
        self.last, self.last_cut = b"", False

    def _take(self, line: bytes, cut: bool) -> None:
        self.last, self.last_cut = line, cut

    def __call__(self, data: bytes) -> None:
        if not data:
            return
        *whole, tail = bytes(data).split(b"\n")
        if whole:
            for line in reversed(whole[1:]):        # the last line here that is not blank, if any
                if line and not line.isspace():
                    self._take(line[:self.limit], len(line) > self.limit)
                    break
            else:
                first = whole[0]
                if not self.line_blank or (first and not first.isspace()):
                    room = self.limit - len(self.line)
                    self._take(bytes(self.line) + first[:max(room, 0)], self.line_cut or len(first) > room)
            self.line, self.line_cut, self.line_blank = bytearray(), False, True
        if tail:
            room = self.limit - len(self.line)
            if room > 0:
                self.line += tail[:room]
            self.line_cut = self.line_cut or len(tail) > room
            self.line_blank = self.line_blank and tail.isspace()

    def flush(self) -> None:
        """The line under way, without its newline, is a line too (as splitlines() reads a last line)."""
        if not self.line_blank:
            self._take(bytes(self.line), self.line_cut)
        self.line, self.line_cut, self.line_blank = bytearray(), False, True

    @property
    def cut(self) -> bool:
        return self.last_cut

    @property
    def value(self) -> str:
        lines = [s.strip() for s in self.last.decode("utf-8", errors="replace").splitlines() if s.strip()]
        return lines[-1] if lines else ""
