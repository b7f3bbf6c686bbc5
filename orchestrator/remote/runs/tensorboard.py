"""Runs agent: the `tensorboard` command. Standard library only, Python >= 3.8, no `from __future__`
line (runs/records.py says why).

    tensorboard WORKDIR -- RUN...

The runs' TensorBoard event files (RUNDIR/tensorboard/, written by the trainer: trainer/run/trackers.py),
from where the controller's copies end. stdin: one JSON document, {"have": {RUN_ID: {NAME: SIZE}}},
the sizes of the files the controller already holds (NAME relative to RUNDIR/tensorboard). stdout:
one JSON header line

    {"ok": true, "runs": [{"asked", "run", "state", "files": [{"name", "offset", "size"}]}], "missing": [RUN]}

then, file after file in the header's order, the bytes [offset, offset + size) of each. An event file
only grows, so a copy of SIZE bytes gets what came after them; a copy longer than the file (another
file of that name) is sent again from 0. Files unchanged are not listed. A pass sends at most
PASS_BYTES: what is left comes with the next one (a record cut at a pass's end is whole after the
next; TensorBoard's reader waits for the rest of a record). "missing": the runs named that are not here
("latest" when there are none); a run of a job over several nodes lists no files on the nodes whose
ranks did not write its metrics.
"""
import json
import os
import sys

from .records import resolve, run_record, run_state, runs_dir_of

TB_DIR = "tensorboard"        # trainer/run/trackers.py TB_DIR
PASS_BYTES = 32 << 20
SEND_CHUNK = 1 << 20


def _event_files(folder):
    """(name, size) of every regular file under `folder`, names relative to it with `/`; links are not
    followed."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not os.path.islink(os.path.join(root, d)))
        for name in sorted(names):
            path = os.path.join(root, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            found.append((os.path.relpath(path, folder).replace(os.sep, "/"), os.path.getsize(path)))
    return found


def _read(path, offset, size):
    """`size` bytes of the file from `offset` (fewer when it has fewer: the header is then corrected)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def cmd_tensorboard(workdir, runs):
    try:
        have = json.loads(sys.stdin.read() or "{}").get("have") or {}
    except ValueError:
        have = {}
    listed, missing, blobs, budget = [], [], [], PASS_BYTES
    seen = set()
    for asked in runs or ["latest"]:
        rid = resolve(workdir, asked)
        if rid is None:
            missing.append(asked)
            continue
        if rid in seen:
            continue
        seen.add(rid)
        rundir = os.path.join(runs_dir_of(workdir), rid)
        held = have.get(rid) if isinstance(have.get(rid), dict) else {}
        files = []
        for name, size in _event_files(os.path.join(rundir, TB_DIR)):
            mine = held.get(name)
            offset = mine if isinstance(mine, int) and 0 <= mine <= size else 0
            count = min(size - offset, budget)
            if count <= 0:
                continue
            data = _read(os.path.join(rundir, TB_DIR, name), offset, count)
            budget -= len(data)
            files.append({"name": name, "offset": offset, "size": len(data)})
            blobs.append(data)
        listed.append({"asked": asked, "run": rid, "state": run_state(rundir, run_record(rundir))[0],
                       "files": files})
    out = sys.stdout.buffer
    out.write((json.dumps({"ok": True, "runs": listed, "missing": missing}) + "\n").encode())
    for data in blobs:
        for i in range(0, len(data), SEND_CHUNK):
            out.write(data[i:i + SEND_CHUNK])
    out.flush()
