"""deploy under concurrency, damage, odd links and full disks, against
the real sshd + pct stand-in. Races are forced, not hoped for: a deploy is held mid-stream by
its progress callback (it then holds the deploy lock and owns a `.partial` folder)."""
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from trainer_quick import wait_for

from orchestrator import inventory
from orchestrator.deploy import sync as deploy
from orchestrator.ssh.agent_call import RELEASE, source as agent_source
from orchestrator.ssh.session import Session

WORKDIR = "/srv/ct/dflash"


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture
def env(sshd, fakepct, make_inventory):
    fakepct.create(200)
    path = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable,
                                     "workdir": WORKDIR}})
    return inventory.load(str(path)), path, fakepct.private(200) / "dflash"


def make_tree(root: Path, n: int, tag: str) -> Path:
    for i in range(n):
        p = root / f"pkg{i % 10}" / f"mod_{i}.py"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"VALUE = {i!r} + {tag!r}\n")
    return root


def live(wd: Path) -> Path:
    return (wd / os.readlink(wd / "current")).resolve() if (wd / "current").is_symlink() else None


def assert_complete(wd: Path, source: Path | None = None) -> dict:
    """`current` is a release whose every manifest file is there with the manifest's hash (and,
    given a source, that release is exactly the source's file set)."""
    cur = live(wd)
    manifest = json.loads((cur / ".dflash-manifest.json").read_text())
    for rel, (sha, size, _) in manifest.items():
        data = (cur / rel).read_bytes()
        assert len(data) == size and hashlib.sha256(data).hexdigest() == sha, rel
    if source is not None:
        assert manifest == deploy.scan_source(source, source).manifest
    return manifest


def partials(wd: Path) -> list[str]:
    return [n for n in os.listdir(wd / "releases") if n.endswith(".partial")] \
        if (wd / "releases").is_dir() else []




class Held:
    """A deploy run in a thread and held mid-stream (after the first bytes) until released."""

    def __init__(self, inv, source):
        self.reached, self.go, self.result = threading.Event(), threading.Event(), None

        def progress(target, total):
            def update(n):
                self.reached.set()
                assert self.go.wait(120)
            return update

        def run():
            self.result = deploy.deploy(inv, ["ct200"], source=str(source), progress=progress)["ct200"]

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def finish(self):
        self.go.set()
        self.thread.join(120)
        return self.result


# ---- case 1: concurrent deploys ---------------------------------------------------------------

def test_overlapping_deploys_never_flip_to_an_incomplete_release(env, tmp_path):
    inv, path, wd = env
    a = make_tree(tmp_path / "a", 300, "a")
    b = make_tree(tmp_path / "b", 300, "b")
    assert deploy.deploy(inv, ["ct200"], source=str(a))["ct200"].ok
    for i in range(4):
        (a / "big.bin").write_bytes(os.urandom(2 << 20))           # new content every round
        (a / f"new_{i}.py").write_text(f"N = {i}\n")
        held = Held(inv, a)
        try:
            assert held.reached.wait(60), "the first deploy never started streaming"
            owned = wait_for(lambda: partials(wd))
            assert len(owned) == 1      # the held deploy's own folder, under the lock
            r = cli("-i", path, "deploy", "ct200", "--source", b)
            assert r.returncode == 1 and "Traceback" not in r.stderr
            assert "is deploying to /srv/ct/dflash; try again when it ends" in r.stdout, r.stdout
            assert "ct200: FAILED: ct200: another deploy (pid " in r.stdout   # names the holder
            assert "exited" not in r.stdout and "by " in r.stdout
            assert partials(wd) == owned    # the live deploy's folder was left alone
        finally:
            res = held.finish()
        assert res.ok, res.error
        assert live(wd).name == res.release
        assert_complete(wd, a)
        again = deploy.deploy(inv, ["ct200"], source=str(a))["ct200"]
        assert again.ok and again.unchanged and not again.repaired
    assert not partials(wd)


def test_a_deploy_planned_before_another_flipped_plans_again(env, tmp_path):
    inv, _, wd = env
    a = make_tree(tmp_path / "a", 200, "a")
    b = make_tree(tmp_path / "b", 200, "b")
    assert deploy.deploy(inv, ["ct200"], source=str(a))["ct200"].ok
    (a / "extra.py").write_text("X = 1\n")
    read, go = threading.Event(), threading.Event()
    out = {}

    def get_source():               # called once B has read the live manifest
        read.set()
        assert go.wait(60)
        return deploy.scan_source(b, b)

    def run_b():
        with Session(inv) as s:
            out["b"] = deploy.deploy_target(s, inv.target("ct200"), get_source)

    t = threading.Thread(target=run_b)
    t.start()
    assert read.wait(60)
    first = deploy.deploy(inv, ["ct200"], source=str(a))["ct200"]   # flips while B is planning
    assert first.ok, first.error
    go.set()
    t.join(60)
    assert out["b"].ok, out["b"].error
    assert live(wd).name == out["b"].release
    assert_complete(wd, b)


def test_a_dead_deploy_frees_the_lock_and_its_leftovers_go(env, tmp_path):
    inv, path, wd = env
    a = make_tree(tmp_path / "a", 50, "a")
    assert deploy.deploy(inv, ["ct200"], source=str(a))["ct200"].ok
    (wd / "releases" / "20000101-000000.000000-dead.partial").mkdir()
    holder = subprocess.Popen([sys.executable, "-c",
                               "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); f.truncate(0); "
                               "f.write('{\"pid\": 4242, \"by\": \"alice@laptop\", \"release\": \"R\", "
                               "\"since\": \"T\"}'); f.flush(); print('held', flush=True); time.sleep(600)",
                               str(wd / ".deploy.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (a / "new.py").write_text("N = 1\n")
        r = cli("-i", path, "deploy", "ct200", "--source", a)
        assert r.returncode == 1
        assert "another deploy (pid 4242, by alice@laptop, release R, since T) is deploying" in r.stdout
        assert partials(wd) == ["20000101-000000.000000-dead.partial"]    # not ours to delete
    finally:
        holder.kill()               # SIGKILL: the kernel drops its flock
        holder.wait()
    r = cli("-i", path, "deploy", "ct200", "--source", a)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not partials(wd)
    assert_complete(wd, a)


# ---- case 2: a damaged live release is repaired ----------------------------------------------

def test_damage_to_the_live_release_is_found_and_repaired(env, tmp_path):
    inv, path, wd = env
    src = make_tree(tmp_path / "src", 100, "s")
    assert deploy.deploy(inv, ["ct200"], source=str(src))["ct200"].ok
    cur = live(wd)
    (cur / "pkg1" / "mod_1.py").unlink()                       # deleted
    (cur / "pkg2" / "mod_2.py").write_text("tampered\n")      # changed (size and mtime)
    r = cli("-i", path, "deploy", "ct200", "--source", src, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)["targets"]["ct200"]
    assert doc["repaired"] == ["pkg1/mod_1.py", "pkg2/mod_2.py"] and not doc["unchanged"]
    assert doc["files_sent"] == 2
    assert_complete(wd, src)

    # Same size, mtime put back: the cheap check cannot see it; --verify hashes everything.
    victim = live(wd) / "pkg3" / "mod_3.py"
    st = victim.stat()
    victim.write_bytes(victim.read_bytes().upper())
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = cli("-i", path, "deploy", "ct200", "--source", src)
    assert r.returncode == 0 and "up to date" in r.stdout
    r = cli("-i", path, "deploy", "ct200", "--source", src, "--verify")
    assert r.returncode == 0 and "repaired 1 missing or damaged file(s)" in r.stdout, r.stdout
    assert_complete(wd, src)

    # And later changes build on the repaired release (they used to fail with FileNotFoundError).
    (live(wd) / "pkg4" / "mod_4.py").unlink()
    (src / "pkg5" / "mod_5.py").write_text("changed\n")
    res = deploy.deploy(inv, ["ct200"], source=str(src))["ct200"]
    assert res.ok, res.error
    assert res.repaired == ["pkg4/mod_4.py"] and res.changed == ["pkg4/mod_4.py", "pkg5/mod_5.py"]
    assert_complete(wd, src)
    again = deploy.deploy(inv, ["ct200"], source=str(src))["ct200"]
    assert again.ok and again.unchanged

    # A release from before stat records (or one that lost it) is hashed once and recorded.
    (live(wd) / ".dflash-stat.json").unlink()
    again = deploy.deploy(inv, ["ct200"], source=str(src))["ct200"]
    assert again.ok and again.unchanged and (live(wd) / ".dflash-stat.json").is_file()


# ---- case 3: symlinks -------------------------------------------------------------------------

def test_symlinks_inside_the_tree_ship_as_files_others_are_named(env, tmp_path):
    inv, path, wd = env
    src = make_tree(tmp_path / "src", 10, "s")
    (src / "link.py").symlink_to("pkg1/mod_1.py")
    (src / "linkdir").symlink_to("pkg2")                       # folders by link are skipped
    r = cli("-i", path, "deploy", "ct200", "--source", src)
    assert r.returncode == 0, r.stdout + r.stderr
    cur = live(wd)
    assert (cur / "link.py").read_text() == (src / "pkg1" / "mod_1.py").read_text()
    assert not (cur / "link.py").is_symlink() and not (cur / "linkdir").exists()
    assert_complete(wd, src)
    r = cli("-i", path, "deploy", "ct200", "--source", src)
    assert r.returncode == 0 and "up to date" in r.stdout

    outside = tmp_path / "secret.txt"
    outside.write_text("not yours\n")
    for name, target, what in [("out.txt", outside, "symlink points outside the source tree"),
                               ("loop.txt", "loop.txt", "symlink loop"),
                               ("gone.txt", "nowhere.txt", "broken symlink")]:
        (src / name).symlink_to(target)
        r = cli("-i", path, "deploy", "ct200", "--source", src)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        line = r.stderr.strip()
        assert "\n" not in line and line.startswith(f"dflash-ops: {src.resolve() / name}: {what}"), line
        (src / name).unlink()


# ---- case 4: full disk ------------------------------------------------------------------------

@pytest.fixture
def small_disk(env):
    """WORKDIR on a 6 MB tmpfs (unmounted afterwards, also when the test fails)."""
    inv, path, wd = env
    wd.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(wd)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield inv, path, wd
    finally:
        subprocess.run(["umount", "-l", str(wd)], check=False)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_a_full_disk_is_named_and_left_as_it_was(small_disk, tmp_path):
    inv, path, wd = small_disk
    src = make_tree(tmp_path / "src", 20, "s")
    assert cli("-i", path, "deploy", "ct200", "--source", src).returncode == 0
    before = free_bytes(wd)
    (src / "big.bin").write_bytes(os.urandom(8 << 20))
    r = cli("-i", path, "deploy", "ct200", "--source", src)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert ("ct200: FAILED: ct200: no space left in /srv/ct/dflash/releases: "
            "the release needs 2049 blocks of 4096 bytes (8.4 MB) for 1 file(s), ") in r.stdout, r.stdout
    assert not partials(wd) and free_bytes(wd) == before
    (src / "big.bin").unlink()
    r = cli("-i", path, "deploy", "ct200", "--source", src)
    assert r.returncode == 0 and "up to date" in r.stdout

    # Space running out mid-write (the estimate said it fits): the partial release goes too.
    agent = agent_source(RELEASE)
    tar = tmp_path / "big.tar"
    (src / "big.bin").write_bytes(os.urandom(8 << 20))
    subprocess.run(["tar", "-cf", tar, "-C", src, "big.bin"], check=True)
    with open(tar, "rb") as f:
        p = subprocess.run([sys.executable, "-c", agent, "apply", str(wd), "r1", "", "0", "test"],
                           stdin=f, capture_output=True, text=True)
    doc = json.loads(p.stdout.splitlines()[-1])
    assert p.returncode == 0 and doc["reason"] == "no_space" and "no space left in" in doc["message"], p.stderr
    assert not partials(wd) and free_bytes(wd) == before
    assert_complete(wd)


def test_many_small_files_are_counted_in_blocks(small_disk, tmp_path):
    """12 bytes each, 2000 files: 24 KB of bytes, but 2000 blocks of the file system (8 MB)."""
    inv, path, wd = small_disk
    src = make_tree(tmp_path / "src", 2000, "s")
    r = cli("-i", path, "deploy", "ct200", "--source", src)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "no space left in /srv/ct/dflash/releases: the release needs 2" in r.stdout, r.stdout
    assert " blocks of 4096 bytes (8." in r.stdout and "for 2000 file(s)" in r.stdout, r.stdout
    assert not partials(wd)


def test_a_sparse_file_is_named_and_a_file_name_cannot_fake_a_line(env, tmp_path):
    inv, path, wd = env
    src = make_tree(tmp_path / "src", 3, "s")
    with open(src / "holes.bin", "wb") as f:
        f.truncate(4 << 20)                      # 4 MiB, all holes
    (src / "evil\n  + fake.py").write_text("x = 1\n")
    r = cli("-i", path, "deploy", "ct200", "--source", src, "--dry-run")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert '  + "evil\\n  + fake.py"' in lines and "  + fake.py" not in lines, r.stdout
    assert "  would send sparse file(s) in full, holes as zeros (they take their whole size there): " \
           "holes.bin (4.0 MiB, 0 B on disk here)" in lines, r.stdout
    (src / "evil\n  + fake.py").unlink()
    r = cli("-i", path, "deploy", "ct200", "--source", src)
    assert r.returncode == 0 and "  sent sparse file(s) in full" in r.stdout, r.stdout + r.stderr
    assert (live(wd) / "holes.bin").stat().st_size == 4 << 20


def test_a_leftover_partial_is_cleared_by_a_no_change_deploy(env, tmp_path):
    inv, path, wd = env
    src = make_tree(tmp_path / "src", 20, "s")
    assert cli("-i", path, "deploy", "ct200", "--source", src).returncode == 0
    left = wd / "releases" / "20000101-000000.000000-dead.partial"
    left.mkdir()
    (left / "big.bin").write_bytes(b"x" * 1000)
    r = cli("-i", path, "deploy", "ct200", "--source", src, "--dry-run")
    assert r.returncode == 0 and left.exists()          # a dry run changes nothing
    r = cli("-i", path, "deploy", "ct200", "--source", src)
    assert r.returncode == 0 and "up to date" in r.stdout and not left.exists()


# ---- case 8: a file that shrinks while it is sent ---------------------------------------------

def test_a_file_that_shrinks_during_deploy_is_named(env, tmp_path):
    inv, _, wd = env
    src = make_tree(tmp_path / "src", 5, "s")
    (src / "big.bin").write_bytes(b"x" * (1 << 20))
    source = deploy.scan_source(src, src)
    (src / "big.bin").write_bytes(b"x" * 1000)                  # after hashing, before sending
    with Session(inv) as s, pytest.raises(deploy.SourceChanged) as e:
        deploy.deploy_target(s, inv.target("ct200"), lambda: source)
    assert str(e.value) == f"{src.resolve() / 'big.bin'} shrank while it was being sent; deploy again"
    assert live(wd) is None and not partials(wd)
