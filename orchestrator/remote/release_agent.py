"""Release agent: runs on the TARGET, under the target's own python, as `python -c SOURCE CMD ...`.

Standard library only, Python >= 3.8, no rsync/tar binaries needed in the container.

    manifest WORKDIR            -> JSON: python/torch versions, live release id and its manifest
    apply WORKDIR RELEASE       stdin: a tar of the changed files plus .dflash-manifest.json;
                                builds releases/RELEASE from the live release + the changes,
                                then flips WORKDIR/current atomically and keeps the last KEEP
    install-deps WORKDIR        pip-installs the live release's trainer/requirements.txt,
                                with the installed torch pinned so pip never touches it
"""
import json
import os
import platform
import sys

# hashlib, shutil, subprocess, tarfile and tempfile are imported where they are used: the
# `manifest` command of every deploy needs none of them, and their imports were ~20 ms of it.

MANIFEST = ".dflash-manifest.json"
KEEP = 5


def _out(doc):
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def _fail(msg, code=3):
    sys.stderr.write("agent: " + msg + "\n")
    sys.exit(code)


def _dist_version(name):
    """The installed version of distribution NAME, without importing it (torch takes seconds).

    First the `NAME-VERSION.dist-info` folder on sys.path, in sys.path order as importlib.metadata
    searches; that is a listdir per path entry, where importlib.metadata's own import costs ~40 ms
    of every deploy. Anything else (egg-info, odd layouts) goes to importlib.metadata."""
    want = name.lower().replace("-", "_")
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for folder in names:
            if folder.endswith(".dist-info") and "-" in folder:
                dist, version = folder[:-len(".dist-info")].split("-", 1)
                if dist.lower().replace("-", "_").replace(".", "_") == want and "-" not in version:
                    return version
    try:
        from importlib import metadata
        return metadata.version(name)
    except Exception:
        return None


def _live(workdir):
    cur = os.path.join(workdir, "current")
    if not os.path.islink(cur):
        return None, None
    path = os.path.realpath(cur)
    return os.path.basename(path), path


def _read_manifest(release_path):
    """The manifest of a release folder, or None when it is missing or damaged."""
    if not release_path:
        return None
    try:
        with open(os.path.join(release_path, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def cmd_manifest(workdir):
    release, path = _live(workdir)
    manifest = _read_manifest(path)
    if manifest is None:
        release, manifest = None, {}   # none, or a damaged live release: the next deploy sends everything
    _out({"python": platform.python_version(), "executable": sys.executable,
          "torch": _dist_version("torch"), "release": release, "manifest": manifest,
          "workdir": workdir})


def _safe_rel(name):
    norm = os.path.normpath(name)
    if norm.startswith(("/", "..")) or "/../" in "/" + norm + "/" or norm in (".", ""):
        _fail("refusing unsafe path in stream: %r" % name)
    return norm


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def cmd_apply(workdir, release):
    import hashlib
    import shutil
    import tarfile

    releases = os.path.join(workdir, "releases")
    os.makedirs(releases, exist_ok=True)
    final = os.path.join(releases, release)
    if os.path.exists(final):
        _fail("release %s already exists" % release)
    partial = final + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    # Leftovers of interrupted deploys never become live; clear them.
    for name in os.listdir(releases):
        if name.endswith(".partial"):
            shutil.rmtree(os.path.join(releases, name), ignore_errors=True)
    os.makedirs(partial)

    received = {}
    new_manifest = None
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
        for member in tar:
            if member.name == MANIFEST:
                new_manifest = json.load(tar.extractfile(member))
                continue
            if not member.isfile():
                _fail("unexpected member type in stream: %r" % member.name)
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
        _fail("stream ended without a manifest (interrupted transfer?)")

    _, live_path = _live(workdir)
    old = _read_manifest(live_path) or {}
    linked = 0
    for rel, (sha, size, exe) in new_manifest.items():
        rel = _safe_rel(rel)
        dest = os.path.join(partial, rel)
        if rel in received:
            if received[rel] != sha:
                _fail("content of %s does not match its manifest hash" % rel)
            continue
        if old.get(rel, [None])[0] != sha or not live_path:
            _fail("%s is neither sent nor in the live release" % rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        src = os.path.join(live_path, rel)
        # Files are never written in place (a deploy always makes new files), so releases can
        # share unchanged files as hard links; copy where links are not allowed.
        try:
            os.link(src, dest)
        except OSError:
            shutil.copy2(src, dest)
        linked += 1
    with open(os.path.join(partial, MANIFEST), "w") as f:
        json.dump(new_manifest, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(partial)
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
    _out({"release": release, "received": len(received), "linked": linked, "pruned": pruned})


def cmd_install_deps(workdir):
    import subprocess
    import tempfile

    _, live = _live(workdir)
    if not live:
        _fail("no release deployed in %s" % workdir)
    req = os.path.join(live, "trainer", "requirements.txt")
    if not os.path.exists(req):
        _out({"installed": False, "reason": "no trainer/requirements.txt"})
        return
    lines = []
    with open(req) as f:
        for line in f:
            name = line.split("#")[0].strip()
            if name and not name.lower().startswith("torch"):   # torch is the host's own build
                lines.append(name)
    torch = _dist_version("torch")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as c:
        if torch:
            c.write("torch==%s\n" % torch)  # a constraint: pip may not up/downgrade it
        constraints = c.name
    try:
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
               "--upgrade-strategy", "only-if-needed", "-c", constraints] + lines
        proc = subprocess.run(cmd, stdout=sys.stderr)
    finally:
        os.unlink(constraints)
    if proc.returncode != 0:
        _fail("pip install exited %d" % proc.returncode, proc.returncode)
    _out({"installed": True, "requirements": lines, "torch": _dist_version("torch")})


def main(argv):
    if len(argv) < 2:
        _fail("usage: agent manifest|apply|install-deps WORKDIR [RELEASE]", 2)
    cmd, workdir = argv[0], os.path.expanduser(argv[1])
    if cmd == "manifest":
        cmd_manifest(workdir)
    elif cmd == "apply" and len(argv) == 3:
        cmd_apply(workdir, argv[2])
    elif cmd == "install-deps":
        cmd_install_deps(workdir)
    else:
        _fail("unknown command %r" % cmd, 2)


if __name__ == "__main__":
    main(sys.argv[1:])
