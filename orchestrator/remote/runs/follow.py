"""Runs agent: the `follow` and `metrics` commands.

stdout: a JSON header line, then the raw log bytes from OFFSET as the log grows; it ends once the
run has ended and every byte is out. stderr: JSON control lines, {"hb": T} every HEARTBEAT_S (so
a dead connection is noticed on both ends) and {"end": STATUS} last.
"""
import json
import os
import time

from ..agent_base import emit
from .records import LOG, TAIL_SCAN, find, metric, run_record, run_state, run_status, runs_dir_of

POLL_S = 0.05            # how often an idle log is looked at (latency budget: 0.3 s)
HEARTBEAT_S = 2.0        # a stderr heartbeat this often, so dead connections are noticed
LIVENESS_S = 1.0         # how often the run's processes are checked while the log is idle


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _tail_offset(path, lines):
    """Byte offset where the last `lines` lines of the file start."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return 0
    if lines <= 0:
        return size
    with open(path, "rb") as f:
        pos, need, end = size, lines, size
        # a final newline ends the last line; it does not start an empty one
        f.seek(max(0, size - 1))
        if size and f.read(1) == b"\n":
            end = size - 1
        pos = end
        while pos > 0:
            step = min(TAIL_SCAN, pos)
            f.seek(pos - step)
            block = f.read(step)
            idx = len(block)
            while True:
                idx = block.rfind(b"\n", 0, idx)
                if idx < 0:
                    break
                need -= 1
                if need == 0:
                    return pos - step + idx + 1
            pos -= step
    return 0


def _control(doc):
    _write_all(2, (json.dumps(doc) + "\n").encode())


def cmd_follow(workdir, run, offset, follow, tail):
    rid = find(workdir, run)
    rundir = os.path.join(runs_dir_of(workdir), rid)
    path = os.path.join(rundir, LOG)
    rec = run_record(rundir)
    if offset < 0:
        offset = _tail_offset(path, tail) if tail is not None else 0
    _write_all(1, (json.dumps({"run": rid, "offset": offset, "started": rec.get("started"),
                               "kind": rec.get("kind") or "train"}) + "\n").encode())
    fd = None
    last_hb = last_live = time.monotonic()
    idle = POLL_S
    while True:
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                fd = None
        sent = 0
        if fd is not None:
            while True:
                data = os.pread(fd, 1 << 16, offset)
                if not data:
                    break
                _write_all(1, data)
                offset += len(data)
                sent += len(data)
        now = time.monotonic()
        if not follow:
            break
        if os.path.exists(os.path.join(rundir, "exit.json")):
            follow = False       # one more pass reads what was written before exit.json
            continue
        if sent == 0 and now - last_live >= LIVENESS_S:
            last_live = now
            state, _ = run_state(rundir)
            if state != "running":
                follow = False
                continue
        if now - last_hb >= HEARTBEAT_S:
            _control({"hb": round(time.time(), 3), "offset": offset})
            last_hb = now
        if sent == 0:
            time.sleep(idle)
    if fd is not None:
        os.close(fd)
    doc = run_status(workdir, rid)
    doc["offset"] = offset
    _control({"end": doc})


def cmd_metrics(workdir, run):
    """The trainer's OUT/metrics.jsonl when it wrote one, else the log's JSON lines."""
    rid = find(workdir, run)
    rundir = os.path.join(runs_dir_of(workdir), rid)
    metrics = []
    for name in ("metrics.jsonl", LOG):
        try:
            with open(os.path.join(rundir, name), "rb") as f:
                for raw in f:
                    doc = metric(raw)
                    if doc is not None:
                        metrics.append(doc)
        except OSError:
            continue
        if metrics:
            break
    emit({"found": True, "run": rid, "status": run_status(workdir, rid), "metrics": metrics})
