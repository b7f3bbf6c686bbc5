"""Runs agent: run records, processes (pid + start-time liveness), a run's state and metrics.

The runs agent runs on the TARGET under its own python as ONE program, `python -c SOURCE CMD ...`:
orchestrator/ssh/agent_call.py joins runs/runs_agent.py and the modules it imports into SOURCE, because
`python -c` cannot import its parts on the target. So every part is standard library only,
Python >= 3.8, has no `from __future__` line, and names what it takes from another part with
`from .PART import NAME` (removed when joined; such a NAME is public in PART, while a part's
private helpers keep the underscore). The commands: runs/runs_agent.py.
"""
import os
import re
import shutil
import signal
import time

from ..agent_base import NUMBER, BadRecord, listdir, load_json, now_iso, parse_json, read_json, refuse, typed

LOG = "train.log"
CHOSEN_POLICY = "compile-policy.json"   # trainer/run/config.py CHOSEN_POLICY: the policy the trainer runs
# What a run id may look like (launch makes `YYYYmmdd-HHMMSS-hex`): no path, never an option.
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
TAIL_SCAN = 1 << 16      # bytes read from a log's end at a time


# --- test hooks ---------------------------------------------------------------------------------

FAULTS = "DFLASH_OPS_AGENT_FAULTS"
_PAUSED = set()  # type: set[str]  # the points this process was held at (pause_at)


def fault(point):
    """A named point of the launch sequence (launch.claimed, supervisor.go, ...). Inert unless a test
    sets DFLASH_OPS_AGENT_FAULTS=kill_at=POINT (as trainer/faults.py's DFLASH_TRAINER_FAULTS): then
    this process SIGKILLs itself there, as a crash at exactly that point would end it. pause_at=POINT:PATH
    (an absolute path) holds it there, the first time: it creates PATH and goes on once PATH is gone (60 s
    at most), so a test can act on the launch's controller while the agent stands at that point."""
    for item in os.environ.get(FAULTS, "").split(","):
        name, _, value = item.partition("=")
        if name == "kill_at" and value == point:
            os.kill(os.getpid(), signal.SIGKILL)
        if name == "pause_at" and value.partition(":")[0] == point and point not in _PAUSED:
            _PAUSED.add(point)      # once: a point passed again (upload.receiving, per chunk) goes on
            path = value.partition(":")[2]
            open(path, "w").close()
            deadline = time.time() + 60
            while os.path.exists(path) and time.time() < deadline:
                time.sleep(0.02)


# --- processes ----------------------------------------------------------------------------------

def proc_start(pid):
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None when
    it is gone or a zombie. Together with the pid it names one process, even after pid reuse."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
    except (OSError, TypeError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


_THIS_BOOT = []  # type: list[str]  # this agent's boot(), read once


def boot():
    """Which start of this machine or container the processes seen now belong to, "BOOT_ID/TICKS": the
    boot id (/proc/sys/kernel/random/boot_id: new at each boot of the node; LXC mounts a random one of
    its own over it at each start of a container, lxc src/lxc/conf.c lxc_setup_boot_id) and the start
    time of PID 1 (a container's own init, which a stop and start of the container replaces, whether or
    not LXC gave it a boot id; a host's init lives as long as its boot). PIDs count again from 1 after a
    container's restart and start times again from 0 after a reboot, so a pid and its start time name
    a process only within one boot: a record made under another is of processes that are gone."""
    if not _THIS_BOOT:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot_id = f.read().strip()
        except OSError:
            boot_id = ""
        init = proc_start(1)
        _THIS_BOOT.append("%s/%s" % (boot_id, "" if init is None else init))
    return _THIS_BOOT[0]


def proc_alive(pid, start=None, booted=None):
    """Whether the process of this pid (and start time, when given) runs now; `booted`, the boot()
    the pid was recorded under (a run's or a lock's "boot"), when given, must be this one: after a
    restart of the container the pid names another process, and after a reboot of the node even
    its start time, counted from the boot, may be the recorded one."""
    if not pid or (booted is not None and booted != boot()):
        return False
    if os.path.isdir("/proc/self"):
        now = proc_start(pid)
        return now is not None and (start is None or now == start)
    try:   # no /proc: the best we can do
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def sweep_dead(folder, prefix):
    """Remove what agents that are gone left in `folder`: its entries PREFIX...-PID (the PID after
    the name's last `-`) whose PID no longer runs. SIGKILL or a stopped container ends an agent
    before its `finally` removes them: runs/.upload-RUN-PID (runs/upload.py), runs/.rm-RUN-PID
    (runs/housekeeping.py), exports/.tmp-PID (runs/export.py)."""
    for name in listdir(folder):
        pid = name.rsplit("-", 1)[-1]
        if name.startswith(prefix) and pid.isdigit() and not proc_alive(int(pid)):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def unsupervised(*docs):
    """A run's trainer alive and its supervisor not (killed after it started the trainer), each
    judged by its pid and start time in any of `docs` (run.json, a slot's lock): the trainer runs
    on and holds its slots until it ends, and no exit.json will be written unless `stop` ends it."""
    def alive(pid, start):
        return any(proc_alive(d.get(pid), d.get(start), d.get("boot")) for d in docs)
    return alive("pid", "pid_start") and not alive("supervisor_pid", "supervisor_start")


# --- runs ---------------------------------------------------------------------------------------

def runs_dir_of(workdir):
    return os.path.join(workdir, "runs")


# --- a run's records: each field read, with its type ---------------------------------------------
#
# The fields of a run's files that the agents and the controller read, and the type each must have
# (null is allowed for each; remote/agent_base.typed). A file that is not a bounded JSON object
# (remote/agent_base.load_json), or has a field of another type, makes its run `unreadable`: listed with
# the reason, never judged from, removable by `rm`; every other run is read as before.

RUN_FIELDS = {
    "run": (str,), "kind": (str,), "output": (str,), "name": (str,), "attempt": (int,), "started": (str,),
    "started_ts": NUMBER, "first_started": (str,), "target": (str,), "release": (str,), "release_path": (str,),
    "commit": (str,), "compile_policy": (str,), "topology": (str,), "workers": (int,), "gpus": (int,),
    "gpu_ids": [(int,)], "slots": [(str,)], "extra_args": [(str,)], "command": [(str,)], "command_line": (str,),
    "cwd": (str,), "python": (str,), "user_env": (dict,), "env": (dict,), "attempts": [(dict,)],
    "config": {"file": (str,), "source": (str,), "text": (str,)},
    "nodes": {"targets": [(str,)], "index": (int,), "endpoint": (str,), "address": (str,)},
    "pid": (int,), "pid_start": (int,), "supervisor_pid": (int,), "supervisor_start": (int,),
    "launcher_pid": (int,), "launcher_start": (int,), "boot": (str,),
}
ENDED = ("succeeded", "failed", "stopped")     # what a supervisor records in exit.json
LOST = "lost"       # judged, never recorded: every process gone, no exit status (run_state)
EXIT_FIELDS = {
    "state": (str,), "exit_code": (int,), "signal": (int,), "signal_name": (str,), "returncode": (int,),
    "ended": (str,), "ended_ts": NUMBER, "duration_s": NUMBER, "stop_requested": (bool,), "error": (str,),
    "lost": (bool,), "reason": (str,), "disk_full": (bool,),
    "root_cause": {"rank": (int,), "exitcode": (int,), "error_file": (str,), "error": (str,)},
}
NODE_FIELDS = {"node_rank": (int,), "ranks": [(int,)], "rank0": (bool,)}
POLICY_FIELDS = {"compile_policy": (str,)}
UNREADABLE = "unreadable"


def record(rundir, name, fields):
    """(the run's file `name` as a JSON object, None) with each of `fields` of its type; (None, None)
    when there is no such file; (None, why) when it cannot be used (why names the file)."""
    try:
        doc = load_json(os.path.join(rundir, name))
    except BadRecord as e:
        return None, "%s: %s" % (name, e)
    why = typed(doc, fields) if doc is not None else None
    if why is None and name == "exit.json" and doc is not None and doc.get("state") not in ENDED + (None,):
        why = "state: expected one of %s, got %r" % (", ".join(ENDED), doc.get("state"))
    return (None, "%s: %s" % (name, why)) if why else (doc, None)


def run_record(rundir):
    """The run's run.json, each field of its type; {} when it is missing or cannot be used (run_state
    says `unreadable` then, with why)."""
    return record(rundir, "run.json", RUN_FIELDS)[0] or {}


def run_ids(workdir):
    """Every run folder with a run.json, oldest first (by its start; an unreadable one by its file's
    time): the runs `status` lists, `rm` and `logs` find (resolve) and `prune` weighs."""
    try:
        names = os.listdir(runs_dir_of(workdir))
    except OSError:
        return []
    ids = []
    for name in names:
        if name.startswith(".") or not _RUN_NAME.match(name):   # .rm-RUN-PID: a run being removed
            continue
        path = os.path.join(runs_dir_of(workdir), name, "run.json")
        if not os.path.isfile(path):
            continue
        rec, _ = record(os.path.dirname(path), "run.json", RUN_FIELDS)
        started = (rec or {}).get("started_ts")
        if started is None:
            try:
                started = os.path.getmtime(path)
            except OSError:
                started = 0
        ids.append((started, name))
    return [name for _, name in sorted(ids)]


def resolve(workdir, run):
    """RUN, or the newest run for "latest"/""; None when there is no such run."""
    if run in ("", "latest", None):
        ids = run_ids(workdir)
        return ids[-1] if ids else None
    if not _RUN_NAME.match(run):
        return None
    return run if os.path.isfile(os.path.join(runs_dir_of(workdir), run, "run.json")) else None


def not_found(workdir, run, **extra):
    """The refusal of a command about a run that is not there (`latest`: there are no runs)."""
    refuse("not_found", "no run %r in %s" % (run, runs_dir_of(workdir)), run=run, **extra)


def find(workdir, run):
    """resolve's run id; the not-found refusal when there is no such run."""
    rid = resolve(workdir, run)
    if rid is None:
        not_found(workdir, run)
    return rid


def run_state(rundir, rec=None):
    """(state, exit document). `unreadable` when run.json or exit.json cannot be used (record: the
    exit document's "reason" says why). The supervisor's exit.json is the truth once it exists; before,
    the run is running while its trainer (or its supervisor) lives, or while the agent that
    launches it still does; with none of them alive and no exit.json, a run whose trainer never
    started failed, else the trainer's last log event decides (`done`: succeeded, `stopped`:
    stopped), else the run is `lost`: it ended with its container (stopped or restarted under it:
    its "boot" is not this one) or was killed -9 as a whole, and nothing recorded how; `stopped`
    when a stop had been asked for, `failed` when the disk is full (nothing could be written)."""
    on_disk, why = record(rundir, "run.json", RUN_FIELDS)
    ex, why_ex = record(rundir, "exit.json", EXIT_FIELDS)
    if why or why_ex:       # nothing to judge from: said as it is, never taken for an end
        return UNREADABLE, {"state": UNREADABLE, "reason": why or why_ex, "exit_code": None, "ended": None,
                            "ended_ts": None, "signal": None, "lost": False, "recorded_by": "status"}
    if ex is not None:
        return ex.get("state") or "failed", ex
    rec = rec or on_disk or {}
    booted = rec.get("boot")
    if proc_alive(rec.get("pid"), rec.get("pid_start"), booted) or \
            proc_alive(rec.get("supervisor_pid"), rec.get("supervisor_start"), booted):
        return "running", None
    restarted = booted is not None and booted != boot()
    if rec.get("pid") is None and not restarted:
        if proc_alive(rec.get("launcher_pid"), rec.get("launcher_start"), booted):
            return "running", None   # the agent is still starting it (its supervisor starts nothing without it)
        if "launcher_pid" not in rec and time.time() - rec.get("started_ts", 0) < 30 and \
                not os.path.exists(os.path.join(rundir, "supervisor.failed")):
            return "running", None   # a record from before launcher_pid: the supervisor may be starting it
        if "launcher_pid" in rec:
            now = time.time()
            return "failed", {"state": "failed", "ended": now_iso(now), "ended_ts": now, "signal": None,
                              "exit_code": None, "lost": False, "started": False, "recorded_by": "status",
                              "reason": "the launch was cut off before the trainer started (its agent or "
                                        "supervisor was killed); nothing ran"}
    # Every process of the run is gone and none recorded how it ended (the container stopped or
    # restarted, the supervisor was killed -9). The trainer's own last event in its log still says
    # whether it finished or checkpointed on SIGTERM; the log's last write is when the run ended.
    log = os.path.join(rundir, LOG)
    try:
        ended = os.path.getmtime(log)
    except OSError:
        ended = rec.get("started_ts") or time.time()
    post = {"ended": now_iso(ended), "ended_ts": ended, "signal": None, "recorded_by": "status"}
    event = _last_event(log)
    if event == "done":
        post.update(state="succeeded", exit_code=0, lost=False,
                    reason="the supervisor is gone; the trainer's log ends with its `done` event")
        return "succeeded", post
    if event == "stopped":
        post.update(state="stopped", exit_code=143, lost=False,
                    reason="the supervisor is gone; the trainer's log ends with its `stopped` event "
                           "(it checkpointed and exited)")
        return "stopped", post
    stopped = os.path.exists(os.path.join(rundir, "stop.json"))
    full = None if restarted else _disk_full(rundir, log)
    post.update(lost=True, exit_code=None, disk_full=bool(full), container_restarted=restarted,
                reason=full or (RESTARTED if restarted else KILLED))
    return ("stopped" if stopped else "failed" if full else LOST), post


RESTARTED = ("ended with its container: the container (or its node) was stopped or restarted while the run "
             "ran, and every process of it ended there with no exit status")
KILLED = "the run's processes are gone and left no exit status (all killed with SIGKILL)"


DISK_FULL_BYTES = 1 << 20   # less free than this where the run writes: nothing it writes (exit.json) fits


def _disk_full(rundir, log):
    """Why a run that left no exit status ended, when a full disk is the likely cause (the supervisor
    could not write exit.json either): its log's tail says ENOSPC, or its folder's filesystem is full
    now. None otherwise."""
    tail = _tail(log) or b""
    said = b"No space left on device" in tail or b"ENOSPC" in tail
    try:
        st = os.statvfs(rundir)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    if not said and (free is None or free >= DISK_FULL_BYTES):
        return None
    now = "" if free is None else "; %d bytes free there now" % free
    return ("disk full: %s (the run's processes are gone and left no exit status%s); free space, then "
            "`launch --resume` continues it" % ("its log says No space left on device" if said
                                                else "the filesystem of its folder is full", now))


# A rank's line under torchrun: `[rankN]: text` (with several nodes also rank 0's metrics).
_RANK_PREFIX = re.compile(rb"^\[rank\d+\]: ")


def _json_line(raw):
    """The line without surrounding space and without a `[rankN]: ` prefix."""
    return _RANK_PREFIX.sub(b"", raw.strip(), count=1)


def _tail(log_path):
    """The log's last TAIL_SCAN bytes; None if it cannot be read."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - TAIL_SCAN))
            return f.read()
    except OSError:
        return None


def _last_event(log_path):
    """The `event` of the last JSON line in the log's tail that has one ("done", "stopped", ...)."""
    tail = _tail(log_path)
    if tail is None:
        return None
    lines = tail.split(b"\n")
    for raw in reversed(lines):
        raw = _json_line(raw)
        if raw.startswith(b"{") and raw.endswith(b"}") and b'"event"' in raw:
            try:
                doc = parse_json(raw.decode("utf-8", "replace"))
            except BadRecord:
                continue
            if isinstance(doc, dict) and isinstance(doc.get("event"), str):
                return doc["event"]
    return None


def _last_metrics(log_path):
    """Last step and loss (and the pace and ETA its line gives), last acceptance length, from the log's JSON
    lines (read from the end)."""
    found = {}
    try:
        size = os.path.getsize(log_path)
    except OSError:
        return found
    span = TAIL_SCAN
    with open(log_path, "rb") as f:
        while True:
            start = max(0, size - span)
            f.seek(start)
            data = f.read(size - start)
            lines = data.split(b"\n")
            if start > 0:
                lines = lines[1:]          # the first one is cut
            for raw in reversed(lines):
                doc = metric(raw)
                if doc is None:
                    continue
                if "step" not in found and _is_number(doc.get("step")) and _is_number(doc.get("loss")):
                    for key in ("steps_per_s", "eta_s"):        # the last step line's pace, when it had one
                        if _is_number(doc.get(key)):
                            found[key] = doc[key]
                for key, name in (("step", "step"), ("loss", "loss"), ("acceptance_length", "tau"),
                                  ("written", "written")):
                    if _is_number(doc.get(key)) and name not in found:      # a log line's, not a record's
                        found[name] = doc[key]
                if "written" in found or all(k in found for k in ("step", "loss", "tau")):   # a regen's rows,
                    return found                                                            # or a trainer's three
            if ("step" in found and "loss" in found) or start == 0 or span >= 1 << 24:
                return found
            span *= 8


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def metric(raw):
    """A log line's JSON metrics (a bounded JSON object with a step or an acceptance length), else None."""
    raw = _json_line(raw)
    if not raw.startswith(b"{") or not raw.endswith(b"}"):
        return None
    try:
        doc = parse_json(raw.decode("utf-8", "replace"))
    except BadRecord:
        return None
    if "step" in doc or "acceptance_length" in doc or "written" in doc:     # a trainer's, or a regen's rows
        return doc
    return None


def run_status(workdir, run):
    rundir = os.path.join(runs_dir_of(workdir), run)
    state, ex = run_state(rundir)
    if state == UNREADABLE:
        return unreadable_row(rundir, run, ex)
    rec = run_record(rundir)
    m = _last_metrics(os.path.join(rundir, LOG))
    ended = (ex or {}).get("ended_ts")
    started = rec.get("started_ts")
    doc = {"run": run, "kind": rec.get("kind") or "train", "output": rec.get("output"),
           "name": rec.get("name"), "attempt": rec.get("attempt") or 1, "state": state,
           "step": m.get("step"), "loss": m.get("loss"), "tau": m.get("tau"), "rows": m.get("written"),
           # the trainer's own pace and ETA at its last step line (a running run's; null before its second)
           "steps_per_s": m.get("steps_per_s") if state == "running" else None,
           "eta_s": m.get("eta_s") if state == "running" else None,
           "started": rec.get("started"), "started_ts": started, "ended": (ex or {}).get("ended"),
           "elapsed_s": round((ended or time.time()) - started, 1) if started else None,
           "pid": rec.get("pid"), "gpus": rec.get("gpus"), "slots": rec.get("slots"),
           # what the trainer resolved and runs (its CHOSEN_POLICY), else what was asked
           "compile_policy": (record(rundir, CHOSEN_POLICY, POLICY_FIELDS)[0] or {}).get("compile_policy")
           or rec.get("compile_policy"),
           "release": rec.get("release"),
           "log": os.path.join(rundir, LOG), "exit": ex,
           # a job over several nodes: the nodes, and which ranks this one ran (the trainer's node.json)
           "nodes": (rec.get("nodes") or {}).get("targets"),
           "node": record(rundir, "node.json", NODE_FIELDS)[0]}
    if state == "running" and unsupervised(rec):   # its end is then judged from its log
        doc["unsupervised"] = True
    try:
        doc["log_bytes"] = os.path.getsize(os.path.join(rundir, LOG))
    except OSError:
        doc["log_bytes"] = 0
    return doc


def unreadable_row(rundir, run, ex):
    """The status row of a run whose run.json or exit.json cannot be used: the keys of every row,
    its state `unreadable`, the reason in "reason" (and in its exit document); nothing judged."""
    try:
        log_bytes = os.path.getsize(os.path.join(rundir, LOG))
    except OSError:
        log_bytes = 0
    return {"run": run, "kind": None, "output": None, "name": None, "attempt": None, "state": UNREADABLE,
            "reason": ex["reason"], "step": None, "loss": None, "tau": None, "steps_per_s": None, "eta_s": None,
            "started": None, "started_ts": None,
            "ended": None, "elapsed_s": None, "pid": None, "gpus": None, "slots": None, "compile_policy": None,
            "release": None, "log": os.path.join(rundir, LOG), "exit": ex, "nodes": None, "node": None,
            "log_bytes": log_bytes}


_CAUSE_KEYS = {"rank": "rank", "exitcode": "exitcode", "error_file": "error_file", "traceback": "error"}


def root_cause(log_path):
    """torchrun's root cause of a failed run, from the last `Root Cause (first observed failure)`
    block in the log's tail: {"rank", "exitcode", "error_file", "error"}. The error is the exception
    line of the rank's error file (written by the trainer's @record) when there is one, else
    torchrun's own words (`Signal 9 (SIGKILL) received by PID N`). None without the block."""
    tail = _tail(log_path)
    if tail is None:
        return None
    text = tail.decode("utf-8", "replace")
    at = text.rfind("Root Cause (first observed failure)")
    if at < 0:
        return None
    cause = {}
    for line in text[at:].splitlines()[1:12]:
        key, sep, value = line.strip().partition(":")
        key = key.strip()
        if sep and key in _CAUSE_KEYS and _CAUSE_KEYS[key] not in cause:
            cause[_CAUSE_KEYS[key]] = value.strip()
    rank = cause.get("rank", "").split(" ")[0]
    cause["rank"] = int(rank) if rank.isdigit() else None
    code = cause.get("exitcode", "").split(" ")[0]
    cause["exitcode"] = int(code) if code.lstrip("-").isdigit() else None
    path = cause.get("error_file")
    doc = read_json(path) if path and path.startswith("/") else None
    if isinstance(doc, dict):
        msg = doc.get("message")
        msg = msg.get("message") if isinstance(msg, dict) else msg
        if isinstance(msg, str) and msg.strip():
            lines = msg.strip().splitlines()
            cause["error"] = lines[-1] if msg.startswith("Traceback") else lines[0]
    else:
        cause["error_file"] = None
    return cause
