"""The release agent (entry `release.release_agent`): the deploy commands and main().

Runs on the TARGET, under the target's own python, as `python -c SOURCE CMD ...`, SOURCE being
this module and what it imports, joined by orchestrator/ssh/agent_call.py (`python -c` cannot import
files on the target). Standard library only, Python >= 3.8, no `from __future__`, no rsync/tar
binaries needed in the container.

    manifest WORKDIR [--verify] [--tidy] [--no-files] [--facts]
                                -> JSON: python/torch versions, live release id and its manifest
                                less the files found missing or damaged there (`damaged`);
                                --verify hashes every file, --tidy clears leftovers of
                                interrupted deploys when no deploy holds the lock,
                                --no-files leaves the manifest out (versions and release only),
                                --facts adds `facts`: what GPU training needs of the machine or
                                container (its /dev/nvidia* nodes, /dev/shm, the memlock limit,
                                the free space where WORKDIR is), for `targets --check`
    apply WORKDIR RELEASE BASE BYTES:FILES BY
                                stdin: a tar of the changed files plus .dflash-manifest.json;
                                under the deploy lock, builds releases/RELEASE from release BASE
                                (the one the controller read; "" for none) + the changes,
                                verifies it, flips WORKDIR/current atomically, keeps the last KEEP.
                                BYTES:FILES: the new files' size and number (checked in blocks
                                and inodes of the file system); BY: who deploys (for the lock).
                                Refusals (common.refuse): `locked` (another deploy holds the
                                lock), `moved` (the live release is no longer BASE), `no_space`
                                (more blocks or inodes than are free, or ENOSPC while writing)
    install-deps WORKDIR        pip-installs the live release's trainer/requirements.txt,
                                with the installed torch pinned so pip never touches it
"""
import json
import os
import sys

from ..agent_base import dist_version, dists, emit, fail, read_json, refuse, write_json
from ..agent_base import checked_workdir
from .store import MANIFEST, STATS, check, clear_leftovers, live_release, lock_holder, read_manifest, stat_key, try_lock

# hashlib, shutil, subprocess, tarfile and tempfile are imported where they are used: the
# `manifest` command of every deploy needs none of them, and importing them is a good part of its time
# (platform too: sys.version's first word is its python_version()). The agent runs under `python -S`
# (orchestrator/ssh/agent_call.py): common._site puts the installed packages on sys.path when asked.

KEEP = 5


def cmd_manifest(workdir, full=False, tidy=False, no_files=False, facts=False):
    """The live release's manifest, less the files that are missing or damaged there (so the
    controller sends them again). With tidy, and no deploy running, clears leftovers first;
    with no_files, only the versions and the release id (`targets --check`)."""
    try:
        lock = try_lock(workdir) if tidy else None
    except OSError:      # WORKDIR not writable yet: nothing to tidy, apply will say why
        lock = None
    try:
        cleared = clear_leftovers(workdir) if lock is not None else []
        release, path = live_release(workdir)
        manifest = None if no_files else read_manifest(path)
        damaged = []
        if no_files:
            manifest = {}
        elif manifest is None:
            release, manifest = None, {}   # none, or a damaged live release: the next deploy sends everything
        else:
            known = read_json(os.path.join(path, STATS))
            good, damaged = check(path, manifest, known or {}, full)
            manifest = {rel: m for rel, m in manifest.items() if rel in good}
            if known is None and lock is not None and not damaged:
                # A release built before stat records existed: record them once, so the next
                # deploy checks sizes and mtimes instead of hashing every file again.
                try:
                    write_json(os.path.join(path, STATS), good)
                except OSError:   # a full disk: hashed again next time, nothing lost
                    pass
    finally:
        if lock is not None:
            lock.close()
    doc = {"python": sys.version.split()[0], "executable": sys.executable,
           "torch": dist_version("torch"), "release": release, "manifest": manifest,
           "damaged": damaged, "cleared": cleared, "workdir": workdir}
    if facts:
        doc["facts"] = machine_facts(workdir)
    emit(doc)


def machine_facts(workdir):
    """What breaks GPU training in a container, read where the trainer runs: the /dev/nvidia* nodes
    (none: the GPUs are not passed through), /dev/shm's size and free bytes (NCCL's shared-memory
    transport, torch's worker processes), RLIMIT_MEMLOCK (soft, hard; None: unlimited: pinned host
    memory), and the free space of the filesystem WORKDIR is on (its nearest existing folder)."""
    import resource

    try:
        nodes = sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))
    except OSError:
        nodes = []

    def space(path):
        try:
            st = os.statvfs(path)
        except OSError:
            return None
        return {"path": path, "total": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize}

    where = os.path.abspath(workdir)
    while not os.path.isdir(where) and where != os.path.dirname(where):
        where = os.path.dirname(where)
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = resource.RLIM_INFINITY
    return {"nvidia_nodes": nodes,
            "shm": space("/dev/shm") if os.path.isdir("/dev/shm") else None,
            "memlock": [None if soft == unlimited else soft, None if hard == unlimited else hard],
            "disk": space(where)}


def _safe_rel(name):
    norm = os.path.normpath(name)
    if norm.startswith(("/", "..")) or "/../" in "/" + norm + "/" or norm in (".", ""):
        fail("refusing unsafe path in stream: %r" % name)
    return norm


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _free_bytes(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _mb(n):
    return "%.1f MB" % (n / 1e6)


def _space_short(path, need, files):
    """Why NEED bytes in FILES new files do not fit in path's file system, or None. Counted in
    blocks, as the file system allocates: every file takes whole blocks (at most one more than its
    bytes fill), and an inode."""
    st = os.statvfs(path)
    block = st.f_frsize or 4096
    blocks = -(-need // block) + files
    if blocks > st.f_bavail:
        return "the release needs %d blocks of %d bytes (%s) for %d file(s), %d free (%s)" % (
            blocks, block, _mb(blocks * block), files, st.f_bavail, _mb(st.f_bavail * block))
    if st.f_files and files > st.f_favail:
        return "the release needs %d inodes for %d file(s), %d free" % (files, files, st.f_favail)
    return None


def cmd_apply(workdir, release, base, need, files, by):
    """Build releases/RELEASE from the stream plus the unchanged files of release BASE (the one
    the controller planned against; "" when it sends every file), verify it, flip `current`."""
    import errno
    import shutil
    import time

    lock = try_lock(workdir)
    if lock is None:
        refuse("locked", "%s is deploying to %s; try again when it ends" % (lock_holder(workdir), workdir))
    lock.write(json.dumps({"pid": os.getpid(), "by": by, "release": release,
                           "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
    lock.flush()

    live, live_path = live_release(workdir)
    if base and live != base:
        refuse("moved", "the live release changed to %s while this deploy was planned against %s"
               % (live, base))
    releases = os.path.join(workdir, "releases")
    os.makedirs(releases, exist_ok=True)
    final = os.path.join(releases, release)
    if os.path.exists(final):
        fail("release %s already exists" % release)
    # Under the lock no other deploy is writing: every .partial is a leftover.
    clear_leftovers(workdir)
    partial = final + ".partial"
    short = _space_short(releases, need, files)
    if short:
        refuse("no_space", "no space left in %s: %s" % (releases, short))
    try:
        received, linked = _build(partial, live_path if base else None)
    except BaseException as e:
        # Whatever stopped the build (a refusal, a cut stream, a full disk), the partial release
        # goes at once rather than at the next deploy: it may be what filled the disk.
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            refuse("no_space", "no space left in %s: %s after removing the partial release" % (
                releases, _space_short(releases, need, files) or "the release ran out of space while written; "
                "%s free" % _mb(_free_bytes(releases))))
        raise
    os.rename(partial, final)
    _fsync_dir(releases)

    # The flip: a new symlink renamed over `current` is atomic; readers see old or new, never none.
    cur = os.path.join(workdir, "current")
    tmp = os.path.join(workdir, ".current.%d" % os.getpid())
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(os.path.join("releases", release), tmp)
    os.replace(tmp, cur)
    _fsync_dir(workdir)

    pruned = []
    keep = sorted(n for n in os.listdir(releases) if not n.endswith(".partial"))
    for name in keep[:-KEEP]:
        if name != release:
            shutil.rmtree(os.path.join(releases, name), ignore_errors=True)
            pruned.append(name)
    emit({"release": release, "received": received, "linked": linked, "pruned": pruned})


def _build(partial, base_path):
    """Fill `partial` from the tar on stdin and the base release, then check every file of the
    manifest is there and intact. Returns (files received, files linked); fails on any gap."""
    import hashlib
    import shutil
    import tarfile

    os.makedirs(partial)
    received = {}
    new_manifest = None
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
        for member in tar:
            if member.name == MANIFEST:
                new_manifest = json.load(tar.extractfile(member))
                continue
            if not member.isfile():
                fail("unexpected member type in stream: %r" % member.name)
            rel = _safe_rel(member.name)
            dest = os.path.join(partial, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            digest = hashlib.sha256()
            src = tar.extractfile(member)
            with open(dest, "wb") as f:
                for chunk in iter(lambda: src.read(1 << 16), b""):
                    digest.update(chunk)
                    f.write(chunk)
            os.chmod(dest, 0o755 if member.mode & 0o111 else 0o644)
            received[rel] = digest.hexdigest()
    if new_manifest is None:
        fail("stream ended without a manifest (interrupted transfer?)")

    old = read_manifest(base_path) or {}
    old_known = read_json(os.path.join(base_path, STATS)) if base_path else None
    known, linked = {}, 0
    for rel, (sha, size, exe) in new_manifest.items():
        rel = _safe_rel(rel)
        dest = os.path.join(partial, rel)
        if rel in received:
            if received[rel] != sha:
                fail("%s changed while it was sent (its content does not match its hash); "
                     "deploy again" % rel)
            known[rel] = stat_key(os.stat(dest))
            continue
        if not base_path or old.get(rel, [None])[0] != sha:
            fail("%s is neither sent nor in the live release" % rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        src = os.path.join(base_path, rel)
        # Files are never written in place (a deploy always makes new files), so releases can
        # share unchanged files as hard links; copy where links are not allowed.
        try:
            os.link(src, dest)
        except FileNotFoundError:
            fail("%s went missing from the live release during this deploy; deploy again" % rel)
        except OSError:
            shutil.copy2(src, dest)
        if old_known and rel in old_known:
            known[rel] = old_known[rel]
        linked += 1
    # Verified before the flip: every file of the manifest, by size and mtime against what was
    # recorded just now (received files) or when the base was built, hashed where they differ.
    good, damaged = check(partial, new_manifest, known, False)
    if damaged:
        fail("the new release is incomplete (%d file(s) missing or damaged, e.g. %s); "
             "deploy again" % (len(damaged), damaged[0]))
    for name, doc in ((STATS, good), (MANIFEST, new_manifest)):
        write_json(os.path.join(partial, name), doc)
    _fsync_dir(partial)
    return len(received), linked


def cmd_install_deps(workdir):
    import subprocess
    import tempfile

    _, live = live_release(workdir)
    if not live:
        fail("no release deployed in %s" % workdir)
    req = os.path.join(live, "trainer", "requirements.txt")
    if not os.path.exists(req):
        emit({"installed": False, "reason": "no trainer/requirements.txt"})
        return
    lines = []
    with open(req) as f:
        for line in f:
            name = line.split("#")[0].strip()
            if name and not name.lower().startswith("torch"):   # torch is the host's own build
                lines.append(name)
    torch = dist_version("torch")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as c:
        if torch:
            c.write("torch==%s\n" % torch)  # a constraint: pip may not up/downgrade it
        constraints = c.name
    try:
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
               "--upgrade-strategy", "only-if-needed", "-c", constraints] + lines
        before = dists()
        proc = subprocess.run(cmd, stdout=sys.stderr)
    finally:
        os.unlink(constraints)
    if proc.returncode != 0:
        fail("pip install exited %d" % proc.returncode, proc.returncode)
    # What pip added or replaced (NAME-VERSION), so a second run can say it changed nothing.
    changed = sorted(dists() - before)
    emit({"installed": True, "requirements": lines, "torch": dist_version("torch"), "changed": changed})


def main(argv):
    if len(argv) < 2:
        fail("usage: agent manifest|apply|install-deps WORKDIR ...", 2)
    cmd, workdir = argv[0], checked_workdir(argv[1])
    if cmd == "manifest" and set(argv[2:]) <= {"--verify", "--tidy", "--no-files", "--facts"}:
        cmd_manifest(workdir, "--verify" in argv[2:], "--tidy" in argv[2:], "--no-files" in argv[2:],
                     "--facts" in argv[2:])
    elif cmd == "apply" and len(argv) == 6:
        need, _, files = argv[4].partition(":")       # NEED: BYTES[:FILES]
        cmd_apply(workdir, argv[2], argv[3], int(need), int(files or 0), argv[5])
    elif cmd == "install-deps":
        cmd_install_deps(workdir)
    else:
        fail("unknown command %r" % cmd, 2)


if __name__ == "__main__":
    main(sys.argv[1:])
