"""Helpers every remote agent uses: JSON replies and records, the refusal (`refuse`), the
exit of a failed command, flocks, hashing. Runs on the TARGET under its own python: standard
library only, Python >= 3.8.

The parts of this package import from each other as any package does
(`from .common import emit`); orchestrator/ssh/agent.py follows those imports and joins the parts
into ONE `python -c` source (`python -c` cannot import files on the target), removing those
import lines, so the names of every part share one namespace at run time. A name that another part
imports is public (no leading underscore); a part's private helpers keep the underscore.
"""
import json
import os
import sys
import time


def emit(doc):
    """The reply: one JSON document, the last line on stdout."""
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def refuse(reason, message, **extra):
    """Say no and end the command: the reply `{"ok": false, "reason": R, "message": M, ...extra}`,
    exit 0 (the controller's agent.call raises agent.Refused). Every refusal of every agent."""
    doc = {"ok": False, "reason": reason, "message": message}
    doc.update(extra)
    emit(doc)
    sys.exit(0)


def fail(msg, code=3):
    sys.stderr.write("agent: " + msg + "\n")
    sys.exit(code)


def now_iso(ts=None):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def read_json(path):
    """The JSON document at path, or None when it is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path, doc):
    """Atomic and durable: readers see the old document or the new one, never half of one."""
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def flock(path, wait=True):
    """An exclusive flock on path (created if missing): the open file, whose close releases it;
    None when wait is False and another process holds it. The kernel drops the lock when its
    holder dies (killed -9, connection dropped), so no lock outlives its holder."""
    import fcntl

    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        f.close()
        if wait:
            raise
        return None
    return f


# The controller checks `workdir:` when it loads hosts.yaml (orchestrator/inventory/names.py, which
# imports these two lists); here the folder is checked again as this machine sees it, once `~` is
# this user's home. Folders a workdir may not be or be inside of; it may be inside /var/lib but not it.
SYSTEM_TREES = ("/etc", "/proc", "/sys", "/dev", "/usr", "/bin", "/sbin", "/boot", "/lib", "/lib32", "/lib64",
                "/libx32")
SYSTEM_ROOTS = ("/", "/var", "/var/lib")
# A secret's value as run.json's user_env records it: the controller masks it (envvars.masked), an
# agent running a program on a run's behalf keeps its own value for it (runs/export.py run_env).
MASKED = "***"


def checked_workdir(arg):
    """WORKDIR as given (`~` expanded to this user's home); refused when it is not an absolute,
    normalised folder of its own: `/`, a system folder, `..`, a home of `/`."""
    path = os.path.expanduser(arg)
    # normalised before the system-folder check: os.path.normpath keeps a leading `//` (POSIX leaves
    # it to the system; Linux reads it as `/`), so `//etc` or a home of `//` would pass as not /etc
    norm = "/" + os.path.normpath(path).lstrip("/")
    if path.startswith("/") and (norm in SYSTEM_ROOTS or "/" + norm.split("/")[1] in SYSTEM_TREES):
        refuse("bad_workdir", "workdir %r is %s here, a system folder; set `workdir:` to a folder of its own"
               % (arg, norm))
    if not path.startswith("/") or norm != path or any(ord(c) < 32 or ord(c) == 127 for c in path):
        refuse("bad_workdir", "workdir %r (%r here) is not an absolute, normalised path" % (arg, path))
    return path


def home_dir():
    home = os.environ.get("HOME")
    if home:
        return home
    try:
        import pwd
        return pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError):
        return "/root"


def sha256(path):
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def listdir(path):
    try:
        return os.listdir(path)
    except OSError:
        return []


# Under `python -S` (the release agent: a target's .pth files can import a good deal at every
# start, and a deploy that changes nothing is mostly that start): what _site has done so far.
_SITE_DONE = set()  # type: set[str]


def _site(full=False):
    """sys.path with the installed packages on it. Without -S: as it is. Under -S, `site.main()`
    once, as a plain start runs it (venv, user site, site-packages, in their order) but without
    running .pth files or sitecustomize, so paths only a .pth file adds are missing; full: the
    real `site.main()`, .pth files included."""
    want = "full" if full else "dirs"
    if not sys.flags.no_site or want in _SITE_DONE or "full" in _SITE_DONE:
        return sys.path
    import site

    saved = site.addpackage, site.execsitecustomize, site.execusercustomize
    if not full:
        site.addpackage = lambda *args, **kw: None
        site.execsitecustomize = site.execusercustomize = lambda: None
    try:
        site.main()
    finally:
        site.addpackage, site.execsitecustomize, site.execusercustomize = saved
    _SITE_DONE.add(want)
    return sys.path


def _dist_info_version(path, want):
    for entry in path:
        for folder in listdir(entry or "."):
            if folder.endswith(".dist-info") and "-" in folder:
                dist, version = folder[:-len(".dist-info")].split("-", 1)
                if dist.lower().replace("-", "_").replace(".", "_") == want and "-" not in version:
                    return version
    return None


def dist_version(name):
    """The installed version of distribution NAME, without importing it (torch takes seconds).

    The `NAME-VERSION.dist-info` folder on sys.path, in sys.path order as importlib.metadata
    searches: a listdir per path entry, cheaper than importing importlib.metadata in every
    deploy. Under -S first without the .pth files' paths, then with them. Anything else (egg-info,
    odd layouts) goes to importlib.metadata."""
    want = name.lower().replace("-", "_")
    for full in ((False, True) if sys.flags.no_site else (False,)):
        version = _dist_info_version(_site(full), want)
        if version is not None:
            return version
    try:
        from importlib import metadata
        return metadata.version(name)
    except Exception:
        return None


def dists():
    """Every installed distribution as NAME-VERSION (its .dist-info folder on sys.path)."""
    found = set()
    for entry in _site(full=True):
        for folder in listdir(entry or "."):
            if folder.endswith(".dist-info"):
                found.add(folder[:-len(".dist-info")])
    return found
