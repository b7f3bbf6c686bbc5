"""The process table, from /proc: each process's parent and state. Torch-free, stdlib only; the
probe walks a case's tree with it (torchrun's ranks included, in sessions of their own) and a node's
launcher finds its ranks."""
from __future__ import annotations

import os


def table() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, state letter)} for every process; {} where there is no /proc. A process
    that ends while the table is read is left out."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    found = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state, parent = f.read().rsplit(b")", 1)[1].split()[:2]   # the name may hold ")"
            found[int(name)] = (int(parent), state.decode())
        except (OSError, ValueError):
            continue       # ended meanwhile
    return found


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` that still run (a zombie has ended, not yet reaped)."""
    return [p for p, (parent, state) in table().items() if parent == pid and state != "Z"]


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (children, theirs, ...), ended but unreaped ones included."""
    kids: dict[int, list[int]] = {}
    for p, (parent, _) in table().items():
        kids.setdefault(parent, []).append(p)
    found, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
