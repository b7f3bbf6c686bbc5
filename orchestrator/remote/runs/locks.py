"""Runs agent: slots and their locks.

Slots: each GPU index is a slot `gpuN`; a CPU run (--gpus 0) takes the one slot `cpu`, so two CPU
runs never compete for the same cores. A slot is a file WORKDIR/locks/SLOT.json naming the run and
the pids of the processes that hold it (with their start times and the boot they ran under, so a
recycled pid is not mistaken for the holder, not even after a restart of the container): the
launching agent's from before anything starts, then its supervisor's, then the trainer's. It
is free when the file is missing, or when its run has ended (exit.json) or none of its processes
(those of the lock and of the run's run.json) is alive any more (killed -9, container restarted, a
launch cut off before its trainer started): a stale lock, cleared. A trainer whose supervisor was
killed still holds its slots until it ends. Slot files are only judged and changed under an flock
on WORKDIR/locks/.guard.

A bench-decode's agent (runs/bench.py) holds one slot as the "run" `bench-PID`, itself each of its
holders, with "kind": "bench-decode", "bench": the run it measures and "since_ts". That lock is its
only record: `status` lists each one whose agent lives as a row of kind bench-decode, and `stop
bench-PID` finds the agent there (runs/stop.py). A dead agent's lock is stale like any other.
"""
import os
import time

from ..agent_base import MAX_RECORD_BYTES, flock, listdir, read_json, write_json
from .records import boot, proc_alive, run_record, runs_dir_of, unsupervised

BENCH = "bench-"        # the prefix of a bench-decode's name in its slot lock: bench-PID


class Guard:
    """An flock on WORKDIR/locks/.guard: slot files are only judged and changed under it."""

    def __init__(self, workdir):
        self.dir = os.path.join(workdir, "locks")
        os.makedirs(self.dir, exist_ok=True)
        self.path = os.path.join(self.dir, ".guard")
        self.f = None

    def __enter__(self):
        self.f = flock(self.path)
        return self

    def __exit__(self, *exc):
        self.f.close()


HOLDERS = (("launcher_pid", "launcher_start"), ("supervisor_pid", "supervisor_start"), ("pid", "pid_start"))


def _holder_live(workdir, lock):
    """The lock's holder ({run, pid, unsupervised}) while the run lives, else None."""
    rundir = os.path.join(runs_dir_of(workdir), str(lock.get("run")))
    if os.path.exists(os.path.join(rundir, "exit.json")):
        return None
    # run.json too: the supervisor records the trainer there before the trainer starts, so a
    # trainer whose agent and supervisor were both killed is still seen
    rec = run_record(rundir)
    live = {pid for pid, start in HOLDERS for doc in (lock, rec)
            if proc_alive(doc.get(pid), doc.get(start), doc.get("boot"))}
    if not live:
        return None
    return {"run": lock.get("run"), "pid": lock.get("pid") or rec.get("pid"),
            "unsupervised": unsupervised(lock, rec)}


def holds_slots(workdir, run):
    """Whether a live process holds a slot in the run's name (a run whose records cannot be read
    is judged by its locks alone)."""
    for name in listdir(os.path.join(workdir, "locks")):
        lock = read_json(os.path.join(workdir, "locks", name), MAX_RECORD_BYTES) if name.endswith(".json") else None
        if lock is not None and lock.get("run") == run and _holder_live(workdir, lock):
            return True
    return False


def _busy_slots(workdir, guard, slots):
    """{slot: holder} for the slots held by a live run; stale locks are removed on the way."""
    busy, cleared = {}, []
    for slot in slots:
        path = os.path.join(guard.dir, slot + ".json")
        lock = read_json(path, MAX_RECORD_BYTES)
        if lock is None:
            if os.path.exists(path):      # unreadable: a crash mid-write; nothing holds it
                os.unlink(path)
            continue
        holder = _holder_live(workdir, lock)
        if holder:
            busy[slot] = holder
        else:
            os.unlink(path)
            cleared.append({"slot": slot, "run": lock.get("run")})
    return busy, cleared


def release_slots(workdir, run):
    with Guard(workdir) as guard:
        drop(guard, run)


def drop(guard, run):
    """Remove the run's slot files (the caller holds the guard)."""
    for name in os.listdir(guard.dir):
        if name.endswith(".json"):
            path = os.path.join(guard.dir, name)
            lock = read_json(path, MAX_RECORD_BYTES)
            if lock is not None and lock.get("run") == run:
                os.unlink(path)


def claim(workdir, guard, gpus, total, want=None):
    """(slots, GPU ids, busy, cleared): the slots a run of `gpus` GPUs takes (the one `cpu` slot
    for gpus=0; exactly the GPUs `want` when named); slots is None when not enough of them are
    free."""
    if want:
        wanted = ["gpu%d" % i for i in want]
        busy, cleared = _busy_slots(workdir, guard, wanted)
        if busy:
            return None, None, busy, cleared
        return wanted, list(want), busy, cleared
    wanted = ["cpu"] if gpus == 0 else ["gpu%d" % i for i in range(total)]
    busy, cleared = _busy_slots(workdir, guard, wanted)
    if gpus == 0:
        slots, ids = (["cpu"], []) if not busy else (None, None)
    else:
        free = [i for i in range(total) if "gpu%d" % i not in busy]
        slots = ["gpu%d" % i for i in free[:gpus]] if len(free) >= gpus else None
        ids = free[:gpus]
    return slots, ids, busy, cleared


def hold_slots(guard, run, slots, holders, since):
    """Write the lock of each slot for the run: `holders` names the processes that hold it so far
    ({launcher_pid, launcher_start, supervisor_pid, ..., pid, pid_start}), all of this boot
    (records.boot: a lock read after a restart of the container is of processes that are gone)."""
    for slot in slots:
        doc = {"run": run, "slot": slot, "since": since, "pid": None, "pid_start": None,
               "supervisor_pid": None, "supervisor_start": None, "boot": boot()}
        doc.update(holders)
        write_json(os.path.join(guard.dir, slot + ".json"), doc)


def benches(workdir, names=None):
    """The slot locks of the bench-decodes running here (their agent alive), oldest first; only those
    named when `names` is given. Read without the guard, nothing cleared: status writes nothing, and a
    dead agent's stale lock goes at the next claim of its slot."""
    folder = os.path.join(workdir, "locks")
    try:
        files = sorted(os.listdir(folder))
    except OSError:
        return []
    found = {}
    for name in files:
        lock = read_json(os.path.join(folder, name), MAX_RECORD_BYTES) if name.endswith(".json") else None
        run = str(lock.get("run")) if isinstance(lock, dict) else ""
        if run.startswith(BENCH) and (names is None or run in names) and run not in found and \
                proc_alive(lock.get("launcher_pid"), lock.get("launcher_start"), lock.get("boot")):
            found[run] = lock
    return sorted(found.values(), key=lambda lock: lock.get("since_ts") or 0)


def bench_row(lock):
    """A running bench-decode as a status row: the keys of a run's (common.run_status), kind bench-decode,
    pid its agent's, "measures" the run it measures."""
    started, slot = lock.get("since_ts"), lock.get("slot")
    return {"run": lock.get("run"), "kind": "bench-decode", "measures": lock.get("bench"), "output": None,
            "name": None, "attempt": 1, "state": "running", "step": None, "loss": None, "tau": None,
            "started": lock.get("since"), "started_ts": started, "ended": None,
            "elapsed_s": round(time.time() - started, 1) if started else None,
            "pid": lock.get("launcher_pid"), "gpus": 0 if slot == "cpu" else 1, "slots": [slot],
            "compile_policy": None, "release": None, "log": None, "exit": None, "nodes": None, "node": None,
            "log_bytes": 0}
