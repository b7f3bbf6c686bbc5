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


# ---- the hash cache: a no-change deploy reads no file it has hashed before -------------------------

def _cache_doc(cache):
    import json
    return json.loads(cache.read_text())


def test_manifest_reuses_a_cached_hash_only_for_an_unchanged_file_older_than_the_cache(tmp_path):
    import hashlib
    import json
    import os

    root, cache = tmp_path / "src", tmp_path / "home" / "hash-cache" / "c.json"
    root.mkdir()
    (root / "a.py").write_text("a = 1\n")
    real = hashlib.sha256(b"a = 1\n").hexdigest()
    first = fileset.manifest(root, ["a.py"], cache)
    assert first == {"a.py": [real, 6, False]} and list(_cache_doc(cache)["entries"]) == ["a.py"]
    # A cache written long after the file: its hash is taken as recorded, not read (a planted one shows it)
    entry = _cache_doc(cache)["entries"]["a.py"]
    planted = {"written_ns": entry[1] + 10 * fileset.RACY_NS, "entries": {"a.py": [*entry[:4], "f" * 64]}}
    cache.write_text(json.dumps(planted))
    assert fileset.manifest(root, ["a.py"], cache)["a.py"][0] == "f" * 64
    # ... but not one written within RACY_NS of the file's mtime (git's racily clean rule): read again
    cache.write_text(json.dumps({**planted, "written_ns": entry[1] + fileset.RACY_NS // 2}))
    assert fileset.manifest(root, ["a.py"], cache)["a.py"][0] == real
    # Same size, mtime put back: the ctime moved, so the file is read again
    cache.write_text(json.dumps(planted))
    st = os.stat(root / "a.py")
    (root / "a.py").write_text("b = 2\n")
    os.utime(root / "a.py", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert fileset.manifest(root, ["a.py"], cache)["a.py"][0] == hashlib.sha256(b"b = 2\n").hexdigest()


def test_a_damaged_or_unwritable_hash_cache_is_not_used_and_the_hashes_stay_right(tmp_path):
    import hashlib

    root = tmp_path / "src"
    root.mkdir()
    (root / "a.py").write_text("a = 1\n")
    real = hashlib.sha256(b"a = 1\n").hexdigest()
    damaged = tmp_path / "c.json"
    damaged.write_text("{not json")
    assert fileset.manifest(root, ["a.py"], damaged)["a.py"][0] == real
    assert _cache_doc(damaged)["entries"]["a.py"][4] == real                 # rewritten whole
    blocked = tmp_path / "file" / "c.json"                                    # its folder is a file
    (tmp_path / "file").write_text("")
    assert fileset.manifest(root, ["a.py"], blocked)["a.py"][0] == real


def test_the_hash_cache_lives_under_dflash_ops_home_one_file_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_OPS_HOME", str(tmp_path / "home"))
    a, b = fileset.hash_cache_path(tmp_path / "a"), fileset.hash_cache_path(tmp_path / "b")
    assert a.parent == tmp_path / "home" / "hash-cache" and a != b


@pytest.mark.parametrize("git", [True, False])
def test_the_tools_own_outputs_never_ship_wherever_they_lie_and_whatever_gitignore_says(tmp_path, git):
    """`export RUN -o small-code-dflash` from the checkout once shipped the drafter with the next deploy
    (docs/deploy.md says exports never ship): an export, a built target and a run's output are known by
    their writer's marker file, in a git checkout (untracked, not ignored) and in a plain tree alike."""
    import subprocess

    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    exp = src / "small-code-dflash"
    exp.mkdir()
    for name in ("config.json", "model.safetensors", "dflash_ops.json"):
        (exp / name).write_text("{}")
    run = src / "work" / "runs" / "r1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "trainer-config.json").write_text("{}")
    (run / "checkpoints" / "model.safetensors").write_text("w")
    (src / "notes").mkdir()
    (src / "notes" / "config.json").write_text("{}")     # a config.json alone is the user's: it ships
    if git:
        subprocess.run(["git", "init", "-q", str(src)], check=True)
    assert fileset.collect(src) == ["notes/config.json", "pkg/mod.py"]
    assert fileset.collect(src, all_files=True) == ["notes/config.json", "pkg/mod.py"]
    source = deploy.scan_source(src, src)
    assert source.files == ["notes/config.json", "pkg/mod.py"]
    assert source.left_out == {"small-code-dflash": "an export", "work/runs/r1": "a training run's output"}
