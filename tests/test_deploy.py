"""deploy against the real sshd + pct stand-in: incremental, atomic, honest about failures."""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator import inventory
from orchestrator.deploy import sync as deploy
from orchestrator.ssh.agent_call import RELEASE, source as agent_source
from orchestrator.ssh.session import Session

WORKDIR = "/srv/ct/dflash"


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "src"
    for i in range(1000):
        p = root / f"pkg{i % 10}" / f"mod_{i}.py"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"VALUE = {i}\n")
    (root / "dir with space").mkdir()
    (root / "dir with space" / "it's \"quoted\" ünï.txt").write_text("odd name\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / ".gitignore").write_text("*.log\n")
    (root / "noise.log").write_text("never shipped\n")
    return root


@pytest.fixture
def env(sshd, fakepct, make_inventory):
    fakepct.create(200)
    fakepct.create(201)
    path = make_inventory({
        "ct200": {"host": "node", "vmid": 200, "python": sys.executable, "workdir": WORKDIR},
        "ct201": {"host": "node", "vmid": 201, "python": sys.executable, "workdir": WORKDIR}})
    return inventory.load(str(path)), path, fakepct


def live(fakepct, vmid) -> Path:
    cur = fakepct.private(vmid) / "dflash" / "current"
    return (cur.parent / os.readlink(cur)).resolve()


def test_incremental_deploy_end_to_end(env, tree):
    inv, _, pct = env
    first = deploy.deploy(inv, ["ct200"], source=str(tree))["ct200"]
    assert first.ok, first.error
    assert first.files_sent == 1003 and first.files_deleted == 0
    rel = live(pct, 200)
    assert (rel / "dir with space" / "it's \"quoted\" ünï.txt").read_text() == "odd name\n"
    assert os.access(rel / "run.sh", os.X_OK) and not (rel / "noise.log").exists()
    assert first.python and first.torch   # the target's python ran and torch was found

    again = deploy.deploy(inv, ["ct200"], source=str(tree))["ct200"]
    assert (again.ok, again.files_sent, again.bytes_sent, again.unchanged) == (True, 0, 0, True)
    assert again.release == first.release

    (tree / "pkg3" / "mod_3.py").write_text("VALUE = 'changed'\n")
    one = deploy.deploy(inv, ["ct200"], source=str(tree))["ct200"]
    assert (one.files_sent, one.changed) == (1, ["pkg3/mod_3.py"])
    assert (live(pct, 200) / "pkg3" / "mod_3.py").read_text() == "VALUE = 'changed'\n"
    # The previous release is untouched: files are shared as links but never written in place.
    assert (rel / "pkg3" / "mod_3.py").read_text() == "VALUE = 3\n"

    (tree / "pkg4" / "mod_4.py").unlink()
    gone = deploy.deploy(inv, ["ct200"], source=str(tree))["ct200"]
    assert (gone.files_sent, gone.files_deleted, gone.deleted) == (0, 1, ["pkg4/mod_4.py"])
    assert not (live(pct, 200) / "pkg4" / "mod_4.py").exists()


def test_keeps_the_last_five_releases(env, tmp_path):
    inv, _, pct = env
    src = tmp_path / "small"
    src.mkdir()
    for i in range(7):
        (src / "f.txt").write_text(str(i))
        assert deploy.deploy(inv, ["ct200"], source=str(src))["ct200"].ok
    releases = sorted(os.listdir(pct.private(200) / "dflash" / "releases"))
    assert len(releases) == 5 and live(pct, 200).name == releases[-1]
    assert (live(pct, 200) / "f.txt").read_text() == "6"


def test_parallel_targets_one_connection_and_private_filesystems(env, tree):
    inv, _, pct = env
    with Session(inv) as s:
        res = deploy.deploy(inv, ["ct200", "ct201"], source=str(tree), session=s)
        assert all(r.ok and r.files_sent == 1003 for r in res.values())
        assert s.connections == 1
    (tree / "pkg0" / "mod_0.py").write_text("x\n")
    res = deploy.deploy(inv, ["ct201"], source=str(tree))
    assert res["ct201"].files_sent == 1
    assert (live(pct, 200) / "pkg0" / "mod_0.py").read_text() == "VALUE = 0\n"


def test_dry_run_sends_nothing(env, tree):
    inv, path, pct = env
    r = cli("-i", path, "deploy", "ct200", "--dry-run", "--source", tree, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)["targets"]["ct200"]
    assert doc["ok"] and doc["files_sent"] == 1003 and doc["release"] is None
    assert not (pct.private(200) / "dflash" / "current").exists()


def test_killed_connection_mid_transfer_leaves_a_complete_release(env, tree, sshd):
    inv, _, pct = env
    assert deploy.deploy(inv, ["ct200"], source=str(tree))["ct200"].ok
    before = live(pct, 200)
    (tree / "big.bin").write_bytes(os.urandom(48 << 20))
    releases = pct.private(200) / "dflash" / "releases"

    def killer():
        deadline = time.time() + 60
        while time.time() < deadline:
            if any(n.endswith(".partial") for n in os.listdir(releases)):
                sshd.kill_connections()
                return
            time.sleep(0.01)

    k = threading.Thread(target=killer)
    k.start()
    res = deploy.deploy(inv, ["ct200"], source=str(tree))["ct200"]
    k.join()
    cur = live(pct, 200)
    # Either the drop came before the flip (old release live) or after it (new one complete).
    manifest = json.loads((cur / ".dflash-manifest.json").read_text())
    assert all((cur / p).is_file() for p in manifest)
    if not res.ok:
        assert cur == before and "big.bin" not in manifest
    again = deploy.deploy(inv, ["ct200"], source=str(tree))["ct200"]
    assert again.ok, again.error
    assert (live(pct, 200) / "big.bin").stat().st_size == 48 << 20
    assert not any(n.endswith(".partial") for n in os.listdir(releases))


def test_cli_errors_and_exit_codes(env, tree, sshd, make_inventory):
    inv, path, pct = env
    pct.stop(201)
    r = cli("-i", path, "deploy", "ct201", "--source", tree)
    assert r.returncode == 1
    assert "container 201: is stopped, not running; start it with `pct start 201`" in r.stdout + r.stderr
    assert "Traceback" not in r.stderr

    bad_key = make_inventory({"t": {"host": "node", "vmid": 200, "python": sys.executable, "workdir": WORKDIR}},
                             hosts={"node": {"known_hosts": str(sshd.known_hosts_empty)}})
    r = cli("-i", bad_key, "deploy", "t", "--source", tree)
    assert r.returncode == 1 and "unknown host key" in r.stdout and "Traceback" not in r.stderr

    r = cli("-i", path, "deploy", "ct2000", "--source", tree)
    assert r.returncode == 2 and "did you mean 'ct200'" in r.stderr

    missing_python = make_inventory({"t": {"host": "node", "vmid": 200, "python": "/nope/python", "workdir": WORKDIR}})
    r = cli("-i", missing_python, "deploy", "t", "--source", tree)
    assert r.returncode == 1 and "python '/nope/python' not found" in r.stdout

    r = cli("-i", path, "deploy", "ct200", "--source", tree / "no such folder")
    assert r.returncode == 2 and "not a folder" in r.stderr and "Traceback" not in r.stderr
    empty = tree.parent / "empty"
    empty.mkdir()
    r = cli("-i", path, "deploy", "ct200", "--source", empty)   # found while the target is read
    assert r.returncode == 2 and "nothing to deploy" in r.stderr and "Traceback" not in r.stderr


def test_agent_reads_installed_versions_as_importlib_metadata_does():
    # In a fresh python, as on the target: the .dist-info path must answer by itself, without
    # importing importlib.metadata (that import is the cost it exists to avoid; were it reached
    # as the fallback, the versions would match whatever the fast path does).
    from importlib import metadata
    names = ["torch", "PyYAML", "pyyaml", "typing-extensions", "paramiko"]
    source = agent_source(RELEASE)
    code = (source[:source.index("def main(")]
            + f"\nprint(json.dumps([[dist_version(n) for n in {names!r}], 'importlib.metadata' in sys.modules]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    versions, metadata_imported = json.loads(r.stdout)
    assert versions == [metadata.version(n) for n in names] and not metadata_imported
    r = subprocess.run([sys.executable, "-c", code.replace(repr(names), "['no-such-distribution']")],
                       capture_output=True, text=True, timeout=60)
    assert json.loads(r.stdout)[0] == [None]        # unknown: the fallback answers None


def test_paramiko_is_imported_without_invoke_and_invoke_still_imports_after():
    # from 8 threads at once, as parallel targets connect: each gets the whole module
    code = ("import sys, threading; from orchestrator.ssh import transport; got = []\n"
            "ts = [threading.Thread(target=lambda: got.append(transport._paramiko().SSHClient)) for _ in range(8)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n"
            "assert len(got) == 8 and 'invoke' not in sys.modules; import invoke; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_paramiko_is_imported_without_importlib_metadata_and_knows_its_own_version():
    from importlib import metadata
    # paramiko's __init__ asks importlib.metadata for its version (the SSH banner carries it); the
    # stand-in answers from the .dist-info folder's name, and the real module imports as ever after
    code = ("import sys; from orchestrator.inventory import sshconfig; p = sshconfig.paramiko()\n"
            "assert 'importlib.metadata' not in sys.modules\n"
            "from importlib import metadata\n"
            "assert metadata.version('paramiko') == p.__version__ and metadata.version('click')\n"
            "print(p.transport.Transport._CLIENT_ID)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"paramiko_{metadata.version('paramiko')}", r.stderr


def test_targets_check_table_and_json(env):
    inv, path, pct = env
    pct.stop(201)
    r = cli("-i", path, "targets", "--check", "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)["targets"]
    assert doc["ct200"]["ok"] and doc["ct200"]["container"] == "running" and doc["ct200"]["python"]
    assert not doc["ct201"]["ok"] and "stopped" in doc["ct201"]["error"]
    assert doc["local"]["ok"]


def test_install_deps_never_touches_torch(env, tmp_path):
    inv, _, pct = env
    src = tmp_path / "proj"
    (src / "trainer").mkdir(parents=True)
    (src / "trainer" / "requirements.txt").write_text("torch>=99  # must be skipped\nPyYAML>=5\n")
    res = deploy.deploy(inv, ["ct200"], source=str(src), install_deps=True)["ct200"]
    assert res.ok, res.error
    assert res.deps["installed"] and res.deps["requirements"] == ["PyYAML>=5"]
    assert res.deps["torch"] == res.torch   # still the target's own build


def test_from_a_git_checkout_only_what_git_tracks_or_would_ships(env, tmp_path):
    """Exports, run outputs and venvs left in a checkout never ship: git's own view of the source
    (tracked + untracked not ignored, its global excludes included), less .dflashignore;
    --all-files ships everything."""
    inv, _, pct = env
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "mod.py").write_text("A = 1\n")
    (repo / ".gitignore").write_text("/out/\n*.safetensors\n")
    (repo / ".dflashignore").write_text("notes.txt\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "init"], check=True)
    (repo / "new.py").write_text("untracked, not ignored: ships\n")
    (repo / "notes.txt").write_text(".dflashignore'd\n")
    (repo / "out" / "dflash-ct200").mkdir(parents=True)
    (repo / "out" / "dflash-ct200" / "config.json").write_text("{}")
    (repo / "pkg" / "model.safetensors").write_bytes(b"\0" * 4096)
    (repo / "gone.py").write_text("tracked, then deleted\n")
    subprocess.run([*git, "add", "gone.py"], check=True)
    (repo / "gone.py").unlink()
    excludes = tmp_path / "global-excludes"          # the user's own core.excludesFile
    excludes.write_text("scratch/\n")
    (repo / "scratch").mkdir()
    (repo / "scratch" / "big.bin").write_bytes(b"x")
    subprocess.run([*git, "config", "core.excludesFile", str(excludes)], check=True)

    res = deploy.deploy(inv, ["ct200"], source=str(repo))["ct200"]
    assert res.ok, res.error
    assert sorted(p.relative_to(live(pct, 200)).as_posix() for p in live(pct, 200).rglob("*")
                  if p.is_file() and not p.name.startswith(".dflash-")) == \
        [".dflashignore", ".gitignore", "new.py", "pkg/mod.py"]
    every = deploy.deploy(inv, ["ct200"], source=str(repo), all_files=True, dry_run=True)["ct200"]
    assert sorted(every.changed) == ["out/dflash-ct200/config.json", "pkg/model.safetensors",
                                     "scratch/big.bin"]   # .dflashignore still holds
