"""Runs agent: the `stop` command. SIGTERM (SIGKILL with --force) to the trainer's process group,
then wait for it to checkpoint and exit; when the supervisor is gone, record the end here.

    stop WORKDIR [--force] [--timeout S] -- RUN

RUN may name a running bench-decode, `bench-PID` (its slot lock, runs/locks.py): SIGTERM to its agent,
which kills its worker, frees the slot and removes its temporary folder before it exits (runs/bench.py);
SIGKILL with --force, its worker's process group too, and what the agent could not remove is removed here.
"""
import os
import shutil
import signal
import time

from ..agent_base import emit, now_iso, read_json, write_json
from .records import find, proc_alive, resolve, run_record, run_state, runs_dir_of
from .locks import BENCH, benches, release_slots
from .supervisor import exit_record, signal_name


def cmd_stop(workdir, run, force, timeout):
    bench = benches(workdir, [run]) if run.startswith(BENCH) and resolve(workdir, run) is None else []
    if bench:
        return _stop_bench(workdir, bench[0], force, timeout)
    rid = find(workdir, run)
    rundir = os.path.join(runs_dir_of(workdir), rid)
    rec = run_record(rundir)
    state, _ = run_state(rundir, rec)
    if state != "running":      # the bench-decodes running here: a `stop` of a measured run may mean one
        emit({"found": True, "run": rid, "already": True, "state": state,
              "benches": [b.get("run") for b in benches(workdir)]})
        return
    stop = read_json(os.path.join(rundir, "stop.json")) or {}
    stop.setdefault("requested", now_iso())
    stop["force"] = bool(force) or stop.get("force", False)
    write_json(os.path.join(rundir, "stop.json"), stop)
    sig = signal.SIGKILL if force else signal.SIGTERM
    start = time.monotonic()
    deadline = start + timeout
    while rec.get("pid") is None and time.monotonic() < deadline:   # still starting
        time.sleep(0.1)
        rec = run_record(rundir)
    pid, pid_start, booted = rec.get("pid"), rec.get("pid_start"), rec.get("boot")
    signalled = False
    if proc_alive(pid, pid_start, booted):
        try:
            os.killpg(pid, sig)
            signalled = True
        except ProcessLookupError:
            pass
    exit_path = os.path.join(rundir, "exit.json")
    while time.monotonic() < deadline:
        if os.path.exists(exit_path):
            break
        if not proc_alive(pid, pid_start, booted) and \
                not proc_alive(rec.get("supervisor_pid"), rec.get("supervisor_start"), booted):
            # No supervisor to record the end (it was killed): record it here.
            write_json(exit_path, exit_record(rec, "stopped", None, None, True,
                                              "recorded by stop: the supervisor was gone"))
            release_slots(workdir, rid)
            break
        time.sleep(0.1)
    state, ex = run_state(rundir, rec)
    emit({"found": True, "run": rid, "already": False, "signal": signal_name(sig),
          "signalled": signalled, "state": state, "exit": ex,
          "timed_out": state == "running", "waited_s": round(time.monotonic() - start, 2)})


def _workers(pid):
    """The children of process `pid` (from /proc): a bench agent's export or specdec, each the leader of
    its own session and process group (export.run_child)."""
    found = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid:
            found.append(int(name))
    return found


def _stop_bench(workdir, lock, force, timeout):
    """End the bench-decode of this slot lock: SIGTERM to its agent, whose handler kills its worker, frees
    the slot and removes its temporary folder, then exits (SIGKILL with force, to its worker's process
    group too); wait up to `timeout` for the agent to be gone. An agent that could not clean up (killed)
    leaves its lock and WORKDIR/exports/.tmp-PID: removed here."""
    bench, pid, start, booted = lock.get("run"), lock.get("launcher_pid"), lock.get("launcher_start"), lock.get("boot")
    sig = signal.SIGKILL if force else signal.SIGTERM
    begin, signalled, workers = time.monotonic(), False, _workers(pid) if force else []
    try:
        os.kill(pid, sig)       # the agent first: it must not live to report its worker's death as the failure
        signalled = True
    except ProcessLookupError:
        pass
    for worker in workers:
        try:
            os.killpg(worker, signal.SIGKILL)
        except OSError:
            pass
    while proc_alive(pid, start, booted) and time.monotonic() < begin + timeout:
        time.sleep(0.05)
    ended = not proc_alive(pid, start, booted)
    if ended:
        release_slots(workdir, bench)
        shutil.rmtree(os.path.join(workdir, "exports", ".tmp-%d" % pid), ignore_errors=True)
    emit({"found": True, "run": bench, "kind": "bench-decode", "measures": lock.get("bench"), "already": False,
          "signal": signal_name(sig), "signalled": signalled, "state": "stopped" if ended else "running",
          "exit": None, "timed_out": not ended, "waited_s": round(time.monotonic() - begin, 2),
          "slots": [lock.get("slot")]})
