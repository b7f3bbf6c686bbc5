"""Line-tracking YAML: a file read as UTF-8 and composed into nodes, so every error can name the
file, the line and the key (`hosts.yaml:12: targets.ct200.gpu: unknown key (did you mean 'gpus'?)`).

Used by the inventory (inventory.py) and by playbooks (playbook.py). Errors are FileError
(exit 2); `where` is the dotted key path the message names.

Every bound of a local YAML file is here, one rule each (docs/reliability.md, "Limits"): a
regular file (`read_text`: a FIFO, a device or a socket is refused before it is read, so nothing
waits on it) of at most MAX_BYTES of UTF-8; then plain data only (`plain_data`, before anything is
built): nested at most MAX_DEPTH deep, no tags (`!!python/name:...`, `!!str`), no merge keys
(`<<`), no alias inside its own anchor, no NUL character in any value (no command argument can
carry one), and numbers only as plain decimals: YAML 1.1 reads `0310`, `0xC8`, `3:20` and `2_00`
all as 200, which is never what a `vmid:` meant; an integer has at most MAX_INT_DIGITS digits and
a decimal is 0 or between MIN_FLOAT and MAX_FLOAT in size (no inf, no nan, no 1e-320). What range
a key takes (a port, a vmid, a timeout) is its reader's rule, on values these bounds let through.
"""
from __future__ import annotations

import difflib
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import FileError

MAX_BYTES = 1 << 20      # an inventory or a playbook is a few KB; this bounds time and memory
MAX_DEPTH = 32           # mappings and lists inside each other
MAX_INT_DIGITS = 18      # every integer fits in 64 bits; Python's own limit (4300 digits) is never reached
MIN_FLOAT, MAX_FLOAT = 1e-12, 1e18   # a decimal's size, 0 aside
# libyaml when PyYAML has it (a 1 MB file in well under a second); the same resolver either way.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_DECIMAL_INT = re.compile(r"^[-+]?(0|[1-9][0-9]*)$")
_DECIMAL_FLOAT = re.compile(r"^[-+]?([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$")
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


def read_text(path: Path) -> str:
    """The file's text; a file that cannot be read, is not a regular file, is over MAX_BYTES or is
    not UTF-8 is a FileError with its line. Reads at most MAX_BYTES + 1 bytes."""
    return decode(read_bytes(path, MAX_BYTES, _too_big()), str(path))


def read_bytes(path: Path | str, limit: int, too_big: str) -> bytes:
    """At most `limit` bytes of a regular file, else a FileError: opened without waiting (a FIFO
    with no writer would block an open), then refused unless it is a regular file (a FIFO, a
    device such as /dev/zero or /dev/stdin on a terminal, a socket: what a user passes by mistake
    and what would never end)."""
    def irregular(mode: int) -> FileError | None:
        if stat.S_ISREG(mode):
            return None
        return FileError(str(path), None, None, f"not a regular file ({_file_kind(mode)}); name a file")

    try:
        if bad := irregular(os.stat(path).st_mode):      # a socket cannot even be opened (ENXIO)
            raise bad
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise FileError(str(path), None, None, f"cannot read: {e.strerror}") from None
    with open(fd, "rb") as f:
        if bad := irregular(os.fstat(fd).st_mode):       # what was opened, should the name have moved
            raise bad
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise FileError(str(path), None, None, f"cannot read: {e.strerror}") from None
    if len(data) > limit:
        raise FileError(str(path), None, None, too_big)
    return data


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def decode(data: bytes, path: str) -> str:
    """UTF-8 text, else a FileError naming the line of the first byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise FileError(path, line, None,
                        f"not UTF-8 text (byte 0x{data[e.start]:02x}); save the file as UTF-8") from None


def _too_big() -> str:
    return f"larger than {MAX_BYTES // (1 << 20)} MB; an inventory or a playbook is a few KB"


def compose(text: str, file: str):
    """The document's root node (None for an empty document), once `plain_data` holds."""
    if len(text) > MAX_BYTES:
        raise FileError(file, None, None, _too_big())
    try:
        plain_data(text, file)
        return yaml.compose(text, Loader=_LOADER)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        raise FileError(file, line, None, f"not valid YAML: {getattr(e, 'problem', e)}") from None


def plain_data(text: str, file: str) -> None:
    """Refuse what is not plain data, at its line and key, from the parser's events (no recursion,
    so 50,000 nested lists end here rather than in the composer)."""
    open_anchors: list = []        # the anchor (or None) of each collection being read
    frames: list[list] = []        # per open collection: [is a mapping, its key (or index) now, a key is next]
    resolver = yaml.SafeLoader("")
    try:
        for ev in yaml.parse(text, Loader=_LOADER):
            at = ev.start_mark.line + 1 if ev.start_mark else None
            if isinstance(ev, yaml.CollectionEndEvent):
                frames.pop()
                open_anchors.pop()
                _node_read(frames)
                continue
            if not isinstance(ev, yaml.NodeEvent):
                continue
            if frames and frames[-1][0] and frames[-1][2]:       # a mapping's key
                frames[-1][1] = ev.value if isinstance(ev, yaml.ScalarEvent) else "?"
            where = _path(frames)
            tag = getattr(ev, "tag", None)
            if tag is not None:
                raise FileError(file, at, where, f"YAML tag {tag!r}: only plain data is read here "
                                                 "(quote a value that should be a string)")
            if isinstance(ev, yaml.CollectionStartEvent):
                if len(frames) >= MAX_DEPTH:
                    raise FileError(file, at, where, f"nested more than {MAX_DEPTH} levels deep")
                open_anchors.append(ev.anchor)
                frames.append([isinstance(ev, yaml.MappingStartEvent), None if
                               isinstance(ev, yaml.MappingStartEvent) else 0, True])
                continue
            if isinstance(ev, yaml.AliasEvent) and ev.anchor in open_anchors:
                raise FileError(file, at, where, f"alias *{ev.anchor} inside its own anchor (a loop)")
            if isinstance(ev, yaml.ScalarEvent):
                _any_scalar(ev.value, file, at, where)
                if not ev.style:     # plain (libyaml says "")
                    _plain_scalar(ev.value, resolver.resolve(yaml.ScalarNode, ev.value, (True, False)), file, at,
                                  where)
            _node_read(frames)
    finally:
        resolver.dispose()


def _node_read(frames: list[list]) -> None:
    """A whole node has been read: in a mapping a key and its value alternate; in a list the index moves on."""
    if frames:
        top = frames[-1]
        if top[0]:
            top[2] = not top[2]
        else:
            top[1] += 1


def _path(frames: list[list]) -> str | None:
    """`targets.ct200.env.A`, `steps[0].launch.gpus`: where the parser is (None at the top)."""
    out = ""
    for is_map, label, _ in frames:
        if label is None:
            break
        text = str(label) if len(str(label)) <= 40 else str(label)[:37] + "..."
        out += (f".{text}" if out else text) if is_map else f"[{text}]"
    return out or None


def _any_scalar(value: str, file: str, at: int | None, where: str | None) -> None:
    """Text any value may hold: no NUL (`"\\0"`, which no command argument or variable can carry),
    nothing that is not UTF-8 (a lone surrogate, `"\\ud800"`)."""
    if "\x00" in value:
        raise FileError(file, at, where, "a NUL character (\\0) in a value; no command argument or "
                                         "variable can carry one")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise FileError(file, at, where, "text that cannot be encoded as UTF-8 (a lone surrogate)") from None


def _plain_scalar(value: str, tag: str, file: str, at: int | None, where: str | None) -> None:
    if value == "<<":
        raise FileError(file, at, where, "merge keys (<<) are not supported; write the keys out")
    if tag == _INT_TAG and not _DECIMAL_INT.match(value) or tag == _FLOAT_TAG and not _DECIMAL_FLOAT.match(value):
        raise FileError(file, at, where, f"{value!r}: write numbers as plain decimals (YAML 1.1 reads octal, "
                                         "hex, 1:20 and 1_000 spellings); quote it if it is a string")
    if tag == _INT_TAG and (digits := len(value.lstrip("+-"))) > MAX_INT_DIGITS:
        raise FileError(file, at, where, f"an integer of {digits} digits (at most {MAX_INT_DIGITS}); quote "
                                         "it if it is a string")
    if tag == _FLOAT_TAG and not float_in_range(float(value)):
        raise FileError(file, at, where, f"{_short(value)}: a decimal is 0 or between {MIN_FLOAT:g} and "
                                         f"{MAX_FLOAT:g} in size; quote it if it is a string")


def float_in_range(x: float) -> bool:
    """A decimal local input may hold: finite, and 0 or MIN_FLOAT <= |x| <= MAX_FLOAT."""
    return math.isfinite(x) and (x == 0 or MIN_FLOAT <= abs(x) <= MAX_FLOAT)


def _short(value: str) -> str:
    return repr(value) if len(value) <= 40 else repr(value[:20] + "..." + value[-10:])


def line(node) -> int:
    return node.start_mark.line + 1


def scalar(node, want, file: str, where: str):
    """The scalar's value, of type `want` (a type or a tuple of types)."""
    if not isinstance(node, yaml.ScalarNode):
        raise FileError(file, line(node), where, f"expected {type_name(want)}, got a {node_kind(node)}")
    value = construct(node)
    if want is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # `python: 3` is odd but unambiguous; addresses like 10.0.0.1 are str already
    bool_ok = want is bool or (isinstance(want, tuple) and bool in want)    # True is an int to isinstance
    ok = isinstance(value, want) and not (isinstance(value, bool) and not bool_ok)
    if not ok:
        raise FileError(file, line(node), where, f"expected {type_name(want)}, got {node.value!r}")
    return value


def construct(node):
    """The plain Python value of a node (safe types only)."""
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def mapping(node, file: str, where: str) -> dict[str, tuple[Any, int]]:
    """{key: (value node, line of the key)}; a duplicate key is an error naming both lines."""
    if not isinstance(node, yaml.MappingNode):
        raise FileError(file, line(node), where, f"expected a mapping, got a {node_kind(node)}")
    out: dict[str, tuple[Any, int]] = {}
    for knode, vnode in node.value:
        key = str(knode.value)
        kline = line(knode)
        if key in out:
            raise FileError(file, kline, f"{where}.{key}" if where != "(top level)" else key,
                            f"duplicate name (first on line {out[key][1]})")
        out[key] = (vnode, kline)
    return out


def sequence(node, file: str, where: str) -> list:
    """The item nodes of a list."""
    if not isinstance(node, yaml.SequenceNode):
        raise FileError(file, line(node), where, f"expected a list, got a {node_kind(node)}")
    return list(node.value)


def child(node, key: str):
    for knode, vnode in node.value:
        if knode.value == key:
            return vnode
    return None


def line_of(node, key: str, default):
    """The line of `key` in a mapping node, else default."""
    if isinstance(node, yaml.MappingNode):
        for knode, _ in node.value:
            if knode.value == key:
                return line(knode)
    return default


def node_kind(node) -> str:
    return {yaml.MappingNode: "mapping", yaml.SequenceNode: "list"}.get(type(node), "scalar")


def type_name(want) -> str:
    if isinstance(want, tuple):
        return "a string, number or true/false" if str in want else "a number"
    return {str: "a string", int: "an integer", bool: "true or false"}.get(want, want.__name__)


def did_you_mean(word: str, choices) -> str:
    """` (did you mean 'ct200' or 'ct201'?)`: every choice as close as the closest (difflib's ratio,
    cutoff 0.6), in the order given; "" when none is close. One named where two tie would be a guess."""
    choices = list(choices)
    scores = {c: difflib.SequenceMatcher(None, word, c).ratio() for c in choices}
    best = max(scores.values(), default=0.0)
    if best < 0.6:
        return ""
    close = [repr(c) for c in choices if scores[c] == best]
    return f" (did you mean {' or '.join(close) if len(close) < 3 else ', '.join(close[:-1]) + ' or ' + close[-1]}?)"
