"""The remote agent's parts (orchestrator/remote/) read with ast, for the tests of how they join into
one program (tests/test_agent.py, tests/test_runs_agent.py): once joined, every part's top-level name
lives in the one namespace they share."""
import ast


def top_level_names(tree: ast.Module) -> set[str]:
    """The names a part binds at its top level: its functions and classes, its assignments' targets and
    what it imports (a relative import's names too: the part that defines them binds them first)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names
