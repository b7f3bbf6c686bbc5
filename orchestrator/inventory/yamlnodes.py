"""Line-tracking YAML: a file read as UTF-8 and composed into nodes, so every error can name the
file, the line and the key (`hosts.yaml:12: targets.ct200.gpu: unknown key (did you mean 'gpus'?)`).

Used by the inventory (inventory.py) and by playbooks (playbook.py). Errors are FileError
(exit 2); `where` is the dotted key path the message names.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml

from orchestrator.errors import FileError


def read_text(path: Path) -> str:
    """The file's text; a file that cannot be read or is not UTF-8 is a FileError with its line."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise FileError(str(path), None, None, f"cannot read: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise FileError(str(path), line, None,
                        f"not UTF-8 text (byte 0x{data[e.start]:02x}); save the file as UTF-8") from None


def compose(text: str, file: str):
    """The document's root node (None for an empty document)."""
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        raise FileError(file, line, None, f"not valid YAML: {getattr(e, 'problem', e)}") from None


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
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
