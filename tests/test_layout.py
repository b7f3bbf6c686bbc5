"""The house's layout, read from the source with `ast` (nothing is imported): no import circle
between modules, none between a top package's first-level packages (orchestrator's cli, ui,
inventory, ssh, runs, ...; trainer's likewise), the controller never imports torch, and it imports
the trainer only through trainer/controller_view.py. Files are cut by job, never by a line count, so
no length is checked here."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOPS = ("orchestrator", "trainer")


def _modules() -> dict[str, Path]:
    """Every module of the top packages by dotted name (a package by its __init__.py)."""
    found = {}
    for top in TOPS:
        for path in sorted((REPO / top).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _in_function(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside a function body (they run when called, not at import)."""
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inside


def _imports(name: str) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import statement of module `name`, absolute
    or relative, at any depth. `from pkg import x` names the module pkg.x when there is one, else
    pkg; `import a.b.c` names a.b.c. Names outside the top packages are kept as written."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    late = _in_function(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) not in late) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            for a in node.names:
                full = f"{base}.{a.name}"
                found.append((full if full in MODULES else base, id(node) not in late))
    return found


def _graph(top: str) -> dict[str, set[str]]:
    """Module -> the modules of the same top package it imports (itself left out)."""
    return {name: {m for m, _ in _imports(name) if m in MODULES and m != name and _top(m) == top}
            for name in MODULES if _top(name) == top}


def _top(name: str) -> str:
    return name.split(".")[0]


def _first_level(name: str) -> str:
    """orchestrator.runs.launch -> orchestrator.runs; orchestrator.cli -> orchestrator.cli."""
    return ".".join(name.split(".")[:2])


def _circles(graph: dict[str, set[str]]) -> list[tuple[list[str], set[str]]]:
    """Per strongly connected part of the graph with more than one node: one circle in it
    (a -> ... -> a) and all its nodes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[set[str]] = []

    def connect(v: str) -> None:            # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                parts.append(part)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [(_one_circle(graph, part), part) for part in parts]


def _one_circle(graph: dict[str, set[str]], part: set[str]) -> list[str]:
    """A shortest path from the part's first node back to itself, through the part."""
    start = min(part)
    paths = {w: [start, w] for w in graph[start] if w in part}
    while start not in paths:
        paths = {w: path + [w] for v, path in sorted(paths.items()) for w in sorted(graph[v])
                 if w in part and w not in path[1:]} | paths
    return paths[start]


def _show(circles: list[tuple[list[str], set[str]]]) -> str:
    return "\n".join(f"{' -> '.join(circle)}   (all tied up: {', '.join(sorted(part))})"
                     for circle, part in circles)


@pytest.mark.parametrize("top", TOPS)
def test_no_import_circle_between_modules(top):
    circles = _circles(_graph(top))
    assert not circles, f"import circles in {top}/:\n{_show(circles)}"


@pytest.mark.parametrize("top", TOPS)
def test_no_import_circle_between_first_level_packages(top):
    """Arrows between orchestrator's (trainer's) first-level packages and modules go one way."""
    packages: dict[str, set[str]] = {}
    for name, imported in _graph(top).items():
        packages.setdefault(_first_level(name), set()).update(
            _first_level(m) for m in imported if _first_level(m) != _first_level(name))
    circles = _circles(packages)
    assert not circles, f"import circles between {top}'s packages:\n{_show(circles)}"


def test_the_controller_never_imports_torch():
    """No orchestrator module imports torch, anywhere in it; and nothing orchestrator imports at
    module level (trainer.controller_view, what it imports, their packages) does at module level."""
    direct = sorted(name for name in MODULES if _top(name) == "orchestrator"
                    if any(_top(m) == "torch" for m, _ in _imports(name)))
    assert not direct, f"import torch: {direct}"
    seen, todo, chains = set(), [(n, [n]) for n in MODULES if _top(n) == "orchestrator"], []
    while todo:
        name, chain = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for m, at_import in _imports(name):
            if not at_import:
                continue
            if _top(m) == "torch":
                chains.append(" -> ".join(chain + [m]))
            parents = [".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 2)]
            todo += [(p, chain + [p]) for p in parents if p in MODULES]   # a package runs its __init__
    assert not chains, "the controller imports torch through:\n" + "\n".join(chains)


VIEW = "trainer.controller_view"


def test_the_controller_sees_the_trainer_through_one_module():
    """Every import of trainer in orchestrator/, at module level or inside a function, is of
    trainer.controller_view: that module is the whole seam, so what the controller depends on is
    listed in one place. (orchestrator/remote/ runs `python -m trainer` on the target; it imports
    nothing of it.)"""
    def through_view(m: str) -> bool:
        return m == VIEW or m.startswith(VIEW + ".")

    stray = sorted(f"{name} imports {m}" for name in MODULES if _top(name) == "orchestrator"
                   for m, _ in _imports(name) if _top(m) == "trainer" and not through_view(m))
    assert not stray, "the controller reaches the trainer beside trainer.controller_view:\n" + "\n".join(stray)
    assert any(through_view(m) for name in MODULES if _top(name) == "orchestrator" for m, _ in _imports(name))


# One job on two or three sides (controller, agent on the target, trainer program), or Python's own
# names: the only base names two product files may share (docs/architecture.md, "Names").
SHARED_NAMES = {"__init__.py", "__main__.py", "export.py", "regen.py", "gate.py", "follow.py", "housekeeping.py",
                "tensorboard.py", "errors.py"}


def test_a_file_name_says_its_job_without_its_folder():
    by_name: dict[str, list[str]] = {}
    for path in MODULES.values():
        by_name.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1 and name not in SHARED_NAMES}
    assert not shared, f"product files that share a base name (rename one, or say why in SHARED_NAMES): {shared}"
