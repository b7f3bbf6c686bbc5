"""Line-tracking YAML: a file read as UTF-8 and composed into nodes, so every error can name the
file, the line and the key (`hosts.yaml:12: targets.ct200.gpu: unknown key (did you mean 'gpus'?)`).

Used by the inventory (inventory.py) and by playbooks (playbook.py). Errors are FileError
(exit 2); `where` is the dotted key path the message names.

Only plain data gets in (`plain_data`, before anything is built): at most MAX_BYTES, nested at
most MAX_DEPTH deep, no tags (`!!python/name:...`, `!!str`), no merge keys (`<<`), no alias
inside its own anchor, and numbers only as plain decimals: YAML 1.1 reads `0310`, `0xC8`, `3:20`
and `2_00` all as 200, which is never what a `vmid:` meant.
"""
from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import FileError

MAX_BYTES = 1 << 20      # an inventory or a playbook is a few KB; this bounds time and memory
MAX_DEPTH = 32           # mappings and lists inside each other
# libyaml when PyYAML has it (a 1 MB file in well under a second); the same resolver either way.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_DECIMAL_INT = re.compile(r"^[-+]?(0|[1-9][0-9]*)$")
_DECIMAL_FLOAT = re.compile(r"^[-+]?([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$")
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


def read_text(path: Path) -> str:
    """The file's text; a file that cannot be read, is over MAX_BYTES or is not UTF-8 is a
    FileError with its line. Reads at most MAX_BYTES + 1 bytes (`-i /dev/zero` ends at once)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise FileError(str(path), None, None, f"cannot read: {e.strerror}") from None
    if len(data) > MAX_BYTES:
        raise FileError(str(path), None, None, _too_big())
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise FileError(str(path), line, None,
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
    """Refuse what is not plain data, at its line, from the parser's events (no recursion, so
    50,000 nested lists end here rather than in the composer)."""
    depth = 0
    open_anchors: list = []        # the anchor (or None) of each collection being read
    resolver = yaml.SafeLoader("")
    try:
        for ev in yaml.parse(text, Loader=_LOADER):
            at = ev.start_mark.line + 1 if ev.start_mark else None
            tag = getattr(ev, "tag", None)        # only node events have one
            if tag is not None:
                raise FileError(file, at, None, f"YAML tag {tag!r}: only plain data is read here "
                                                "(quote a value that should be a string)")
            if isinstance(ev, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise FileError(file, at, None, f"nested more than {MAX_DEPTH} levels deep")
                open_anchors.append(ev.anchor)
            elif isinstance(ev, yaml.CollectionEndEvent):
                depth -= 1
                open_anchors.pop()
            elif isinstance(ev, yaml.AliasEvent) and ev.anchor in open_anchors:
                raise FileError(file, at, None, f"alias *{ev.anchor} inside its own anchor (a loop)")
            elif isinstance(ev, yaml.ScalarEvent) and not ev.style:     # plain (libyaml says "")
                _plain_scalar(ev.value, resolver.resolve(yaml.ScalarNode, ev.value, (True, False)), file, at)
    finally:
        resolver.dispose()


def _plain_scalar(value: str, tag: str, file: str, at: int | None) -> None:
    if value == "<<":
        raise FileError(file, at, None, "merge keys (<<) are not supported; write the keys out")
    if tag == _INT_TAG and not _DECIMAL_INT.match(value) or tag == _FLOAT_TAG and not _DECIMAL_FLOAT.match(value):
        raise FileError(file, at, None, f"{value!r}: write numbers as plain decimals (YAML 1.1 reads octal, "
                                        "hex, 1:20 and 1_000 spellings); quote it if it is a string")


def line(node) -> int:
    return node.start_mark.line + 1


def scalar(node, want, file: str, where: str):
    """The scalar's value, of type `want` (a type or a tuple of types)."""
    if not isinstance(node, yaml.ScalarNode):
        raise FileError(file, line(node), where, f"expected {type_name(want)}, got a {node_kind(node)}")
    value = construct(node)
    if want is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # `python: 3` is odd but unambiguous; addresses like 10.0.0.1 are str already
    ok = isinstance(value, want) and not (isinstance(value, bool) and want is not bool)
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
