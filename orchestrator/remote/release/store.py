"""A target's releases on disk: the deploy lock, leftovers, the size/mtime/hash check of a release.
Used by release/release_agent.py (the deploy commands) and runs/probe.py (the live release). Standard
library only, Python >= 3.8, no `from __future__` line (orchestrator/ssh/agent_call.py joins the parts).

    WORKDIR/current                     symlink to releases/ID, the live release
    WORKDIR/releases/ID/                a release: the files, plus
        .dflash-manifest.json           {path: [sha256, size, executable]}, what the release must hold
        .dflash-stat.json               {path: [size, mtime_ns]}, the files as they were when written
                                        or last verified (so a check need not hash unchanged files)
    WORKDIR/releases/ID.partial/        a release being built, by the deploy lock's holder only
    WORKDIR/.deploy.lock                the deploy lock (flock; the kernel drops it when its holder
                                        dies) and, inside, who holds it
"""
import json
import os

from ..agent_base import flock, listdir, sha256

MANIFEST = ".dflash-manifest.json"
STATS = ".dflash-stat.json"
LOCK = ".deploy.lock"


def live_release(workdir):
    cur = os.path.join(workdir, "current")
    if not os.path.islink(cur):
        return None, None
    path = os.path.realpath(cur)
    return os.path.basename(path), path


def read_manifest(release_path):
    """The manifest of a release folder, or None when it is missing or damaged."""
    if not release_path:
        return None
    try:
        with open(os.path.join(release_path, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _lock_path(workdir):
    return os.path.join(workdir, LOCK)


def try_lock(workdir):
    """The per-target deploy lock: an flock on WORKDIR/.deploy.lock (common.flock), so the kernel
    releases it when its holder dies (killed -9, connection dropped). The open file when taken,
    else None."""
    os.makedirs(workdir, exist_ok=True)
    f = flock(_lock_path(workdir), wait=False)
    if f is not None:
        f.truncate(0)    # a dead holder's note must not be read as ours
    return f


def lock_holder(workdir):
    try:
        with open(_lock_path(workdir)) as f:
            doc = json.loads(f.read() or "{}")
    except (OSError, ValueError):
        doc = {}
    if not doc:
        return "another deploy"
    return "another deploy (pid %s, by %s, release %s, since %s)" % (
        doc.get("pid"), doc.get("by") or "?", doc.get("release"), doc.get("since"))


def clear_leftovers(workdir):
    """Remove what interrupted deploys left (partial releases, temporary links). Only under the
    deploy lock: a `.partial` folder is only ever written by the lock's holder."""
    releases = os.path.join(workdir, "releases")
    cleared = []
    for folder, names in ((releases, listdir(releases)), (workdir, listdir(workdir))):
        for name in names:
            path = os.path.join(folder, name)
            if folder == releases and name.endswith(".partial"):
                import shutil     # only when there is something to clear: every deploy comes here

                shutil.rmtree(path, ignore_errors=True)
                cleared.append(name)
            elif folder == workdir and name.startswith(".current.") and os.path.islink(path):
                os.unlink(path)
    return cleared


def stat_key(st):
    return [st.st_size, st.st_mtime_ns]


def check(release_path, manifest, known, full):
    """(stat cache of the good files, paths that are missing or differ from the manifest).

    Cheap by default: a file whose size and mtime are what was recorded when the release was
    built (`known`, the release's .dflash-stat.json) is taken as intact; any other is hashed.
    `full` hashes every file. One stat per file, all on the target: no round trip per file."""
    import stat as stat_mod

    good, damaged = {}, []
    for rel, (sha, size, exe) in manifest.items():
        path = os.path.join(release_path, rel)
        try:
            st = os.lstat(path)
        except OSError:
            damaged.append(rel)
            continue
        if not stat_mod.S_ISREG(st.st_mode) or st.st_size != size or bool(st.st_mode & 0o111) != bool(exe):
            damaged.append(rel)
            continue
        key = stat_key(st)
        if full or known.get(rel) != key:
            try:
                if sha256(path) != sha:
                    damaged.append(rel)
                    continue
            except OSError:
                damaged.append(rel)
                continue
        good[rel] = key
    return good, sorted(damaged)
