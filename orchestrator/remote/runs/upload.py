"""Runs agent: files sent with a launch (a kind's inputs, runs/kinds.py: `regen`'s prompts).

The launch spec names its files, `"files": [{"name", "size", "sha256"}]`, and their bytes follow
the spec's line on stdin, one file after the other. They are read before the slot guard is taken
(an upload may take a while; the guard is held briefly), into runs/.upload-RUN-PID (a dot folder,
which the run listing skips), checked against size and sha256, and renamed into the run's folder
once it exists. Whatever ends the launch before that, the folder goes (the caller's `finally`); one
whose agent was SIGKILLed (or whose container stopped) mid-upload is swept by the next launch.
Standard library only, Python >= 3.8, no `from __future__` line (runs/records.py says why).
"""
import errno
import hashlib
import os
import shutil

from ..agent_base import fail, refuse
from .records import fault, sweep_dead
from .kinds import kind_of

UPLOAD = ".upload-"

UPLOAD_CHUNK = 1 << 20


def receive(stream, runs_dir, spec):
    """Read spec["files"] from `stream` into a new runs/.upload-RUN-PID folder: its path, or None
    without files. Files other than the kind's inputs are refused ("bad_upload") before a byte is
    read; a short stream or a hash that differs fails the launch; a full disk refuses it."""
    files = spec["files"]     # spec is normalized (runs/spec.py): every key is there
    names, inputs = sorted(str(f.get("name")) for f in files), sorted(kind_of(spec)["inputs"])
    if names != inputs:
        refuse("bad_upload", "a %s run takes %s; this launch sent %s" % (
            spec["kind"], ", ".join(inputs) or "no files", ", ".join(names) or "none"))
    sweep_dead(runs_dir, UPLOAD)    # uploads of launches whose agent is gone
    if not files:
        return None
    folder = os.path.join(runs_dir, "%s%s-%d" % (UPLOAD, spec["run"], os.getpid()))
    try:
        os.makedirs(folder)
        for f in files:
            _receive_one(stream, folder, f)
    except BaseException as e:
        shutil.rmtree(folder, ignore_errors=True)
        if isinstance(e, OSError):
            reason = "no_space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "io"
            refuse(reason, "cannot write the upload into %s: %s" % (runs_dir, e.strerror or e))
        raise
    return folder


def _receive_one(stream, folder, f):
    name = f.get("name") or ""
    if not name or name != os.path.basename(name) or name.startswith("."):
        fail("upload name %r: a plain file name is expected" % name, 2)
    h, left = hashlib.sha256(), int(f["size"])
    with open(os.path.join(folder, name), "wb") as out:
        while left:
            chunk = stream.read(min(left, UPLOAD_CHUNK))
            if not chunk:
                fail("upload %s: the stream ended %d bytes short" % (name, left))
            h.update(chunk)
            out.write(chunk)
            left -= len(chunk)
            fault("upload.receiving")
        out.flush()
        os.fsync(out.fileno())
    if h.hexdigest() != f["sha256"]:
        fail("upload %s: sha256 mismatch (the file changed while it was sent?)" % name)


def place(folder, rundir):
    """Move the received files into the run's folder."""
    if folder:
        for name in os.listdir(folder):
            os.rename(os.path.join(folder, name), os.path.join(rundir, name))


def discard(folder):
    if folder:
        shutil.rmtree(folder, ignore_errors=True)

