"""Helpers every remote agent uses: JSON replies and records, the refusal (`refuse`), the
exit of a failed command, flocks, hashing. Runs on the TARGET under its own python: standard
library only, Python >= 3.8.

The parts of this package import from each other as any package does
(`from .agent_base import emit`); orchestrator/ssh/agent_call.py follows those imports and joins the parts
into ONE `python -c` source (`python -c` cannot import files on the target), removing those
import lines, so the names of every part share one namespace at run time. A name that another part
imports is public (no leading underscore); a part's private helpers keep the underscore.
"""
import json
import os
import re
import sys
import time


def emit(doc):
    """The reply: one JSON document, the last line on stdout."""
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def refuse(reason, message, **extra):
    """Say no and end the command: the reply `{"ok": false, "reason": R, "message": M, ...extra}`,
    exit 0 (the controller's agent_call.call raises agent_call.Refused). Every refusal of every agent."""
    doc = {"ok": False, "reason": reason, "message": message}
    doc.update(extra)
    emit(doc)
    sys.exit(0)


def fail(msg, code=3):
    sys.stderr.write("agent: " + msg + "\n")
    sys.exit(code)


def now_iso(ts=None):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


# --- the target's own files, read in one place -------------------------------------------------
#
# Every JSON file the agents read on the target (run.json, exit.json, node.json, a slot's lock,
# probe.json, a release's manifest) is read by load_json: a regular file of at most `limit` bytes
# of UTF-8 (MAX_RECORD_BYTES for a run's records and probe.json, MAX_TREE_BYTES for a file with a
# line per file of a release), nested at most MAX_RECORD_DEPTH deep (checked before it is parsed,
# so 100,000 nested lists are refused, not a RecursionError), one JSON object; `typed` then checks
# the type of each field a reader uses. One that is not is a BadRecord saying why; read_json is the
# lenient reading (None), for a file whose absence and damage mean the same.

MAX_RECORD_BYTES = 1 << 20       # a run's records are a few KB (its config's text is the largest part)
MAX_TREE_BYTES = 256 << 20       # a release's manifest or stat record: a line per file of the source tree
MAX_RECORD_DEPTH = 32
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_PAIR = re.compile(r"\[\]|\{\}")
_DEEP = re.compile(r"[\[{]{%d}" % (MAX_RECORD_DEPTH + 1))


class BadRecord(Exception):
    """A file that is there but cannot be used; str() says why, in a few words."""


def load_json(path, limit=MAX_RECORD_BYTES):
    """The JSON object at path; None when there is no such file; BadRecord when there is one that
    is not a bounded JSON object (read without waiting: a FIFO is refused, not waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise BadRecord("cannot be read (%s)" % e.strerror)
    with os.fdopen(fd, "rb") as f:
        if os.fstat(fd).st_mode & 0o170000 != 0o100000:      # S_ISREG (a part's `stat` is a local name)
            raise BadRecord("not a regular file")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise BadRecord("cannot be read (%s)" % e.strerror)
    if len(data) > limit:
        raise BadRecord("larger than %d MB" % (limit >> 20))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRecord("not UTF-8 text")
    return parse_json(text)


def parse_json(text):
    """text as one JSON object, nested at most MAX_RECORD_DEPTH deep; BadRecord otherwise."""
    if _too_deep(text):
        raise BadRecord("nested more than %d levels deep" % MAX_RECORD_DEPTH)
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise BadRecord("not JSON (%s)" % (str(e).split("\n")[0] if str(e) else "empty"))
    if not isinstance(doc, dict):
        raise BadRecord("a JSON %s, not an object" % json_kind(doc))
    return doc


def _too_deep(text):
    """Whether the JSON text nests lists and objects more than MAX_RECORD_DEPTH deep: with strings
    left out, the innermost pairs of brackets removed MAX_RECORD_DEPTH times, a pair is still
    left. (Unbalanced text is json.loads's to refuse.)"""
    if text.count("[") + text.count("{") <= MAX_RECORD_DEPTH:
        return False
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    for _ in range(MAX_RECORD_DEPTH):
        if _DEEP.search(brackets):      # as many openers in a row: deep already (and at once for [[[[...)
            return True
        fewer = _PAIR.sub("", brackets)
        if fewer == brackets:
            return False
        brackets = fewer
    return _PAIR.search(brackets) is not None


def json_kind(value):
    if value is None:
        return "null"
    for kinds, name in ((bool, "boolean"), ((int, float), "number"), (str, "string"), (list, "list"),
                        (dict, "object")):
        if isinstance(value, kinds):
            return name
    return type(value).__name__


def read_json(path, limit=MAX_TREE_BYTES):
    """The JSON object at path, or None when it is missing or is not a bounded JSON object (a
    release's manifest and stat record are read this way: MAX_TREE_BYTES by default)."""
    try:
        return load_json(path, limit)
    except BadRecord:
        return None


NUMBER = (int, float)


def typed(doc, fields, where=""):
    """Why `doc` does not have the fields a reader uses, each of its type, or None when it does.
    fields: {name: types}, types a tuple of types, [types] for a list of them, or {name: types} for
    an object of its own; null is every field's value when it has none. True is no number here."""
    for name, want in fields.items():
        value = doc.get(name)
        if value is None:
            continue
        at = where + name
        if isinstance(want, dict):
            if not isinstance(value, dict):
                return "%s: expected an object, got a %s" % (at, json_kind(value))
            why = typed(value, want, at + ".")
            if why:
                return why
        elif isinstance(want, list):
            if not isinstance(value, list) or not all(_is(v, want[0]) for v in value):
                return "%s: expected a list of %s" % (at, _names(want[0]))
        elif not _is(value, want):
            return "%s: expected %s, got a %s" % (at, _names(want), json_kind(value))
    return None


def _is(value, kinds):
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)


def _names(kinds):
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "a boolean",
                        list: "a list", dict: "an object"}[k] for k in kinds if not (k is int and float in kinds))


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
