"""Which files a deploy ships: gitignore semantics as pure functions, then a real tree."""
import pytest

from orchestrator.deploy import fileset, sync as deploy


def ignored(patterns, path, is_dir=False, base=""):
    rules = [r for r in (fileset.compile_pattern(p, base) for p in patterns) if r]
    return fileset.is_ignored(path, is_dir, rules)


@pytest.mark.parametrize("patterns, path, is_dir, expect", [
    (["*.log"], "a.log", False, True),
    (["*.log"], "deep/down/a.log", False, True),
    (["*.log", "!keep.log"], "keep.log", False, False),
    (["/build"], "build", True, True),
    (["/build"], "sub/build", True, False),
    (["out/"], "out", False, False),
    (["out/"], "x/out", True, True),
    (["docs/*.md"], "docs/a.md", False, True),
    (["docs/*.md"], "docs/sub/a.md", False, False),
    (["**/tmp"], "a/b/tmp", True, True),
    (["a/**/z"], "a/z", False, True),
    (["a/**/z"], "a/b/c/z", False, True),
    (["logs/**"], "logs/x/y", False, True),
    (["# comment", ""], "# comment", False, False),
    (["\\#hash"], "#hash", False, True),
    (["f?.txt"], "f1.txt", False, True),
    (["f[0-9].txt"], "f7.txt", False, True),
    (["f[!0-9].txt"], "f7.txt", False, False),
])
def test_gitignore_rules(patterns, path, is_dir, expect):
    assert ignored(patterns, path, is_dir) is expect


def test_nested_ignore_file_is_relative_to_its_folder():
    assert ignored(["/x.txt"], "sub/x.txt", base="sub")
    assert not ignored(["/x.txt"], "x.txt", base="sub")


def test_collect_honours_ignore_files_and_never_ships_git_or_venv(tmp_path):
    (tmp_path / ".git" / "info").mkdir(parents=True)
    (tmp_path / ".git" / "info" / "exclude").write_text("secret.txt\n")
    (tmp_path / ".git" / "HEAD").write_text("ref\n")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("")
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "__pycache__" / "m.pyc").write_text("")
    (tmp_path / "pkg" / "m.py").write_text("x = 1\n")
    (tmp_path / "pkg" / ".gitignore").write_text("*.tmp\n")
    (tmp_path / "pkg" / "a.tmp").write_text("")
    (tmp_path / "a.tmp").write_text("")
    (tmp_path / ".gitignore").write_text("/out/\n")
    (tmp_path / ".dflashignore").write_text("data/\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "big.bin").write_text("")
    (tmp_path / "secret.txt").write_text("")
    (tmp_path / "name with 'quotes' and ü.py").write_text("")
    files = fileset.collect(tmp_path)
    assert files == [".dflashignore", ".gitignore", "a.tmp", "name with 'quotes' and ü.py",
                     "pkg/.gitignore", "pkg/m.py"]


def test_plan_sends_changed_and_new_and_deletes_gone():
    local = {"a": ["h1", 1, False], "b": ["h2", 1, False], "c": ["h3", 1, True]}
    remote = {"a": ["h1", 1, False], "b": ["old", 1, False], "c": ["h3", 1, False], "gone": ["h", 1, False]}
    assert deploy.plan(local, remote) == (["b", "c"], ["gone"])
    assert deploy.plan(local, {}) == (["a", "b", "c"], [])
    assert deploy.plan(local, local) == ([], [])
