"""Runs agent: the `stop` command. SIGTERM (SIGKILL with --force) to the trainer's process group,
then wait for it to checkpoint and exit; when the supervisor is gone, record the end here.

    stop WORKDIR [--force] [--timeout S] -- RUN
"""
import os
import signal
import time

from ..common import _now_iso, _out, _read_json, _write_json
from .common import _alive, _find, _runs_dir, _state
from .locks import _release_slots
from .supervisor import _exit_record, _signal_name


def cmd_stop(workdir, run, force, timeout):
    rid = _find(workdir, run)
    rundir = os.path.join(_runs_dir(workdir), rid)
    rec = _read_json(os.path.join(rundir, "run.json")) or {}
    state, _ = _state(rundir, rec)
    if state != "running":
        _out({"found": True, "run": rid, "already": True, "state": state})
        return
    stop = _read_json(os.path.join(rundir, "stop.json")) or {}
    stop.setdefault("requested", _now_iso())
    stop["force"] = bool(force) or stop.get("force", False)
    _write_json(os.path.join(rundir, "stop.json"), stop)
    sig = signal.SIGKILL if force else signal.SIGTERM
    start = time.monotonic()
    deadline = start + timeout
    while rec.get("pid") is None and time.monotonic() < deadline:   # still starting
        time.sleep(0.1)
        rec = _read_json(os.path.join(rundir, "run.json")) or {}
    pid, pid_start = rec.get("pid"), rec.get("pid_start")
    signalled = False
    if _alive(pid, pid_start):
        try:
            os.killpg(pid, sig)
            signalled = True
        except ProcessLookupError:
            pass
    exit_path = os.path.join(rundir, "exit.json")
    while time.monotonic() < deadline:
        if os.path.exists(exit_path):
            break
        if not _alive(pid, pid_start) and \
                not _alive(rec.get("supervisor_pid"), rec.get("supervisor_start")):
            # No supervisor to record the end (it was killed): record it here.
            _write_json(exit_path, _exit_record(rec, "stopped", None, None, True,
                                                "recorded by stop: the supervisor was gone"))
            _release_slots(workdir, rid)
            break
        time.sleep(0.1)
    state, ex = _state(rundir, rec)
    _out({"found": True, "run": rid, "already": False, "signal": _signal_name(sig),
          "signalled": signalled, "state": state, "exit": ex,
          "timed_out": state == "running", "waited_s": round(time.monotonic() - start, 2)})
