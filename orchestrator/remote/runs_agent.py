"""Runs agent: runs on the TARGET, under the target's own python, as `python -c SOURCE CMD ...`.

Standard library only, Python >= 3.8. Every command prints one JSON document as its last stdout
line, except `follow`, whose stdout is a JSON header line followed by the raw log bytes.
One file, longer than our modules usually are, on purpose: it travels as one `python -c` source
and cannot import its parts on the target.

    launch WORKDIR            stdin: the launch spec (JSON). Checks the release, the probe result
                              and the slot locks, then starts a detached supervisor (double fork,
                              setsid, all three streams redirected: field notes 2) that starts the
                              trainer and records its exit status whatever way it ends.
    status WORKDIR [RUN...]   the runs (all, or those named) with state, step, loss, tau
    follow WORKDIR RUN OFFSET [--no-follow] [--tail N]
                              header line, then the log from byte OFFSET as it grows; ends once
                              the run has ended and every byte is out. Control messages go to
                              stderr as JSON lines: {"hb": T} every few seconds (so a dead
                              connection is noticed on both ends) and {"end": STATUS} last.
    stop WORKDIR RUN [--force] [--timeout S]
                              SIGTERM (SIGKILL with --force) to the trainer's process group, then
                              wait for it to checkpoint and exit
    metrics WORKDIR RUN       the log's JSON metric lines

A run lives in WORKDIR/runs/RUN/: run.json (what was launched), train.log (the trainer's stdout
and stderr), pid (the trainer's), exit.json (written by the supervisor when the trainer ends),
stop.json (a stop was requested). RUN "latest" (or "") names the newest run.

Slots: each GPU index is a slot `gpuN`; a CPU run (--gpus 0) takes the one slot `cpu`, so two CPU
runs never compete for the same cores. A slot is a file WORKDIR/locks/SLOT.json naming the run and
its supervisor's and trainer's pids (with their start times, so a recycled pid is not mistaken
for the holder). It is free when the file is missing, or when its run has ended (exit.json) or
none of its processes is alive any more (killed -9, container restarted): a stale lock, cleared.
"""
import fcntl
import json
import os
import platform
import select
import shlex
import signal
import socket
import sys
import time

LOG = "train.log"
POLL_S = 0.05            # follow: how often an idle log is looked at (latency budget: 0.3 s)
HEARTBEAT_S = 2.0        # follow: a stderr heartbeat this often, so dead connections are noticed
LIVENESS_S = 1.0         # follow: how often the run's processes are checked while the log is idle
STOP_TIMEOUT_S = 120.0
TAIL_SCAN = 1 << 16


def _out(doc):
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def _fail(msg, code=3):
    sys.stderr.write("agent: " + msg + "\n")
    sys.exit(code)


def _now_iso(ts=None):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_json(path, doc):
    """Atomic: readers see the old document or the new one, never half of one."""
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --- processes ----------------------------------------------------------------------------------

def _proc_start(pid):
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


def _alive(pid, start=None):
    if not pid:
        return False
    if os.path.isdir("/proc/self"):
        now = _proc_start(pid)
        return now is not None and (start is None or now == start)
    try:   # no /proc: the best we can do
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# --- runs ---------------------------------------------------------------------------------------

def _runs_dir(workdir):
    return os.path.join(workdir, "runs")


def _run_ids(workdir):
    try:
        names = os.listdir(_runs_dir(workdir))
    except OSError:
        return []
    ids = []
    for name in names:
        rec = _read_json(os.path.join(_runs_dir(workdir), name, "run.json"))
        if rec is not None:
            ids.append((rec.get("started_ts") or 0, name))
    return [name for _, name in sorted(ids)]


def _resolve(workdir, run):
    """RUN, or the newest run for "latest"/""; None when there is no such run."""
    if run in ("", "latest", None):
        ids = _run_ids(workdir)
        return ids[-1] if ids else None
    if "/" in run or run.startswith("."):
        return None
    return run if os.path.isfile(os.path.join(_runs_dir(workdir), run, "run.json")) else None


def _state(rundir, rec=None):
    """(state, exit document). The supervisor's exit.json is the truth once it exists; before,
    the run is running while its trainer (or its supervisor) lives; with neither alive and no
    exit.json the run was lost (killed -9 as a whole, container stopped): failed."""
    ex = _read_json(os.path.join(rundir, "exit.json"))
    if ex is not None:
        return ex.get("state", "failed"), ex
    rec = rec or _read_json(os.path.join(rundir, "run.json")) or {}
    if _alive(rec.get("pid"), rec.get("pid_start")) or \
            _alive(rec.get("supervisor_pid"), rec.get("supervisor_start")):
        return "running", None
    if rec.get("pid") is None and time.time() - rec.get("started_ts", 0) < 30 and \
            not os.path.exists(os.path.join(rundir, "supervisor.failed")):
        return "running", None   # the supervisor is still starting the trainer
    stopped = os.path.exists(os.path.join(rundir, "stop.json"))
    return ("stopped" if stopped else "failed"), {
        "lost": True, "exit_code": None, "signal": None,
        "reason": "the run's processes are gone and left no exit status "
                  "(killed with SIGKILL, or the container stopped)"}


def _last_metrics(log_path):
    """Last step and loss, last acceptance length, from the log's JSON lines (read from the end)."""
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
                doc = _metric(raw)
                if doc is None:
                    continue
                if doc.get("step") is not None and "step" not in found:
                    found["step"] = doc["step"]
                if doc.get("loss") is not None and "loss" not in found:
                    found["loss"] = doc["loss"]
                if doc.get("acceptance_length") is not None and "tau" not in found:
                    found["tau"] = doc["acceptance_length"]
                if len(found) == 3:
                    return found
            if ("step" in found and "loss" in found) or start == 0 or span >= 1 << 24:
                return found
            span *= 8


def _metric(raw):
    raw = raw.strip()
    if not raw.startswith(b"{") or not raw.endswith(b"}"):
        return None
    try:
        doc = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        return None
    if isinstance(doc, dict) and ("step" in doc or "acceptance_length" in doc):
        return doc
    return None


def _status(workdir, run):
    rundir = os.path.join(_runs_dir(workdir), run)
    rec = _read_json(os.path.join(rundir, "run.json")) or {}
    state, ex = _state(rundir, rec)
    m = _last_metrics(os.path.join(rundir, LOG))
    ended = (ex or {}).get("ended_ts")
    started = rec.get("started_ts")
    doc = {"run": run, "state": state, "step": m.get("step"), "loss": m.get("loss"),
           "tau": m.get("tau"), "started": rec.get("started"), "started_ts": started,
           "ended": (ex or {}).get("ended"),
           "elapsed_s": round((ended or time.time()) - started, 1) if started else None,
           "pid": rec.get("pid"), "gpus": rec.get("gpus"), "slots": rec.get("slots"),
           "policy": rec.get("probe_policy") or rec.get("compile_policy"),
           "release": rec.get("release"),
           "log": os.path.join(rundir, LOG), "exit": ex}
    try:
        doc["log_bytes"] = os.path.getsize(os.path.join(rundir, LOG))
    except OSError:
        doc["log_bytes"] = 0
    return doc


def cmd_status(workdir, runs):
    if runs:
        out, missing = [], []
        for r in runs:
            rid = _resolve(workdir, r)
            (out if rid else missing).append(_status(workdir, rid) if rid else r)
        _out({"runs": out, "missing": missing})
    else:
        _out({"runs": [_status(workdir, r) for r in _run_ids(workdir)], "missing": []})


# --- slots (locks) ------------------------------------------------------------------------------

class _Guard:
    """An flock on WORKDIR/locks/.guard: slot files are only judged and changed under it."""

    def __init__(self, workdir):
        self.dir = os.path.join(workdir, "locks")
        os.makedirs(self.dir, exist_ok=True)
        self.fd = os.open(os.path.join(self.dir, ".guard"), os.O_RDWR | os.O_CREAT, 0o644)

    def __enter__(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _holder_live(workdir, lock):
    rundir = os.path.join(_runs_dir(workdir), str(lock.get("run")))
    if os.path.exists(os.path.join(rundir, "exit.json")):
        return False
    return _alive(lock.get("supervisor_pid"), lock.get("supervisor_start")) or \
        _alive(lock.get("pid"), lock.get("pid_start"))


def _busy_slots(workdir, guard, slots):
    """{slot: holder} for the slots held by a live run; stale locks are removed on the way."""
    busy, cleared = {}, []
    for slot in slots:
        path = os.path.join(guard.dir, slot + ".json")
        lock = _read_json(path)
        if lock is None:
            if os.path.exists(path):      # unreadable: a crash mid-write; nothing holds it
                os.unlink(path)
            continue
        if _holder_live(workdir, lock):
            busy[slot] = lock
        else:
            os.unlink(path)
            cleared.append({"slot": slot, "run": lock.get("run")})
    return busy, cleared


def _release_slots(workdir, run):
    with _Guard(workdir) as guard:
        for name in os.listdir(guard.dir):
            if name.endswith(".json"):
                path = os.path.join(guard.dir, name)
                lock = _read_json(path)
                if lock is not None and lock.get("run") == run:
                    os.unlink(path)


# --- launch -------------------------------------------------------------------------------------

def _refuse(reason, message, **extra):
    doc = {"ok": False, "reason": reason, "message": message}
    doc.update(extra)
    _out(doc)
    sys.exit(0)


def _release_info(workdir):
    cur = os.path.join(workdir, "current")
    if not os.path.islink(cur) or not os.path.isdir(cur):
        return None, None, None
    path = os.path.realpath(cur)
    commit = None
    for name in (".git-commit", "GIT_COMMIT"):
        try:
            with open(os.path.join(path, name)) as f:
                commit = f.read().strip() or None
            break
        except OSError:
            pass
    if commit is None:
        man = _read_json(os.path.join(path, ".dflash-manifest.json")) or {}
        meta = man.get(".dflash-release") if isinstance(man, dict) else None
        if isinstance(meta, dict):
            commit = meta.get("commit")
    return os.path.basename(path), path, commit


def _probe_policy(workdir):
    """(probe.json found, the policy it chose or None)."""
    doc = _read_json(os.path.join(workdir, "probe.json"))
    if doc is None:
        return os.path.exists(os.path.join(workdir, "probe.json")), None
    policy = doc.get("policy") if isinstance(doc, dict) else None
    if isinstance(policy, dict):
        policy = policy.get("name")
    return True, policy if isinstance(policy, str) and policy else None


def _home():
    home = os.environ.get("HOME")
    if home:
        return home
    try:
        import pwd
        return pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError):
        return "/root"


def cmd_launch(workdir):
    spec = json.load(sys.stdin)
    run = spec["run"]
    release, release_path, commit = _release_info(workdir)
    if release is None:
        _refuse("no_release", "no release deployed in %s" % workdir)
    policy = spec.get("policy") or "auto"
    probe_choice = None
    if policy == "auto":
        found, probe_choice = _probe_policy(workdir)
        if not found:
            _refuse("no_probe", "--policy auto needs a probe result and %s/probe.json does not exist"
                    % workdir)
    # `auto` goes to the trainer as is: it resolves it from DFLASH_OPS_WORKDIR/probe.json and
    # refuses a choice probed under another torch build. The record keeps the probe's choice.
    compile_policy = policy
    gpus, total = int(spec.get("gpus", 0)), int(spec.get("target_gpus", 0))
    if gpus > total:
        _refuse("too_many_gpus", "--gpus %d is more than the target's %d GPU(s)" % (gpus, total))
    rundir = os.path.join(_runs_dir(workdir), run)
    os.makedirs(_runs_dir(workdir), exist_ok=True)
    with _Guard(workdir) as guard:
        if gpus == 0:
            wanted = ["cpu"]
        else:
            wanted = ["gpu%d" % i for i in range(total)]
        busy, cleared = _busy_slots(workdir, guard, wanted)
        if gpus == 0:
            chosen_slots, ids = (["cpu"], []) if not busy else (None, None)
        else:
            free = [i for i in range(total) if "gpu%d" % i not in busy]
            chosen_slots = ["gpu%d" % i for i in free[:gpus]] if len(free) >= gpus else None
            ids = free[:gpus]
        if chosen_slots is None:
            holders = sorted({(h.get("run"), h.get("pid")) for h in busy.values()}, key=str)
            _refuse("busy", "busy", busy={s: {"run": h.get("run"), "pid": h.get("pid")}
                                          for s, h in busy.items()},
                    holders=[{"run": r, "pid": p} for r, p in holders], cleared=cleared)
        try:
            os.mkdir(rundir)
        except FileExistsError:
            _fail("run %s already exists" % run)

        config = None
        if spec.get("config_text") is not None:
            name = os.path.basename(spec.get("config_name") or "config.yaml")
            config = os.path.join(rundir, name)
            with open(config, "w") as f:
                f.write(spec["config_text"])
        python = sys.executable
        argv = [python, "-m", "trainer", "--out", rundir, "--gpus", str(gpus),
                "--topology", spec.get("topology") or "threads", "--compile-policy", compile_policy]
        if spec.get("workers") is not None:
            argv += ["--workers", str(spec["workers"])]
        if config:
            argv += ["--config", config]
        argv += list(spec.get("extra") or [])
        env = dict(os.environ)
        env.update({"HOME": _home(), "PYTHONUNBUFFERED": "1",
                    "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in ids),
                    "DFLASH_OPS_WORKDIR": workdir, "DFLASH_OPS_RUN": run})
        env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        env.setdefault("LANG", "C.UTF-8")
        rec = {
            "run": run, "target": spec.get("target"), "workdir": workdir, "rundir": rundir,
            "release": release, "release_path": release_path, "commit": commit,
            "command": argv, "cwd": release_path,
            # the release `current` pointed at, so a deploy during the run changes nothing here
            "command_line": "cd %s && exec %s" % (shlex.quote(release_path),
                                                 " ".join(shlex.quote(a) for a in argv)),
            "env": {k: env[k] for k in ("CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED", "HOME")},
            "config": {"file": config, "source": spec.get("config_source"),
                       "text": spec.get("config_text")} if config else None,
            "policy": policy, "compile_policy": compile_policy, "probe_policy": probe_choice,
            "gpus": gpus, "gpu_ids": ids,
            "slots": chosen_slots, "topology": spec.get("topology") or "threads",
            "workers": spec.get("workers"), "extra_args": list(spec.get("extra") or []),
            "started": _now_iso(), "started_ts": time.time(), "python": python,
            "python_version": platform.python_version(), "hostname": socket.gethostname(),
            "controller": spec.get("controller"), "pid": None,
        }
        _write_json(os.path.join(rundir, "run.json"), rec)
        started = _spawn_supervisor(rundir, rec, env)
        if "error" in started:
            _out({"ok": False, "reason": "spawn", "message": started["error"], "run": run})
            sys.exit(0)
        for slot in chosen_slots:
            _write_json(os.path.join(guard.dir, slot + ".json"), {
                "run": run, "slot": slot, "pid": started["pid"], "pid_start": started["pid_start"],
                "supervisor_pid": started["supervisor_pid"],
                "supervisor_start": started["supervisor_start"], "since": rec["started"]})
    _out({"ok": True, "run": run, "pid": started["pid"], "supervisor_pid": started["supervisor_pid"],
          "release": release, "commit": commit, "compile_policy": compile_policy,
          "probe_policy": probe_choice, "gpus": gpus,
          "gpu_ids": ids, "slots": chosen_slots, "rundir": rundir, "log": os.path.join(rundir, LOG),
          "cleared": cleared, "command_line": rec["command_line"]})


def _spawn_supervisor(rundir, rec, env):
    """Double fork: the grandchild (the supervisor) is in its own session, has /dev/null and its
    own log for its three streams and no other inherited fd, so the exec that ran this agent
    (ssh, pct exec / lxc-attach) returns at once (field notes 2). It reports the trainer's pid on
    a pipe, then waits for the trainer."""
    rfd, wfd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rfd)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            _detach(rundir, keep=wfd)
            _supervise(rundir, rec, env, wfd)
        except BaseException as e:  # never return into the agent's code
            try:
                os.write(wfd, (json.dumps({"error": "supervisor: %s" % e}) + "\n").encode())
            except OSError:
                pass
        finally:
            os._exit(0)
    os.close(wfd)
    os.waitpid(pid, 0)
    data = b""
    deadline = time.time() + 60
    while time.time() < deadline:
        ready, _, _ = select.select([rfd], [], [], max(0.0, deadline - time.time()))
        if not ready:
            break
        chunk = os.read(rfd, 4096)
        if not chunk:
            break
        data += chunk
        if data.endswith(b"\n"):
            break
    os.close(rfd)
    try:
        return json.loads(data.decode())
    except ValueError:
        return {"error": "the supervisor did not report the trainer's pid (see %s/supervisor.log)"
                % rundir}


def _detach(rundir, keep):
    devnull = os.open(os.devnull, os.O_RDWR)
    log = os.open(os.path.join(rundir, "supervisor.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for fd in (devnull, log):
        if fd > 2 and fd != keep:
            os.close(fd)
    try:
        maxfd = os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        maxfd = 1024
    os.closerange(3, keep)
    os.closerange(keep + 1, maxfd)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    os.chdir("/")
    os.umask(0o022)


_TERMINATING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _supervise(rundir, rec, env, report_fd):
    import subprocess

    log_path = os.path.join(rundir, LOG)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def note(text):
        os.write(log, ("dflash-ops: " + text + "\n").encode())

    note("run %s: %s" % (rec["run"], rec["command_line"]))
    try:
        # start_new_session: the trainer leads its own process group, which `stop` signals
        # as a whole (torchrun and its ranks, dataloader workers), and this supervisor is not in it.
        proc = subprocess.Popen(rec["command"], cwd=rec["cwd"], env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, close_fds=True, start_new_session=True)
    except OSError as e:
        note("cannot start the trainer: %s" % e)
        open(os.path.join(rundir, "supervisor.failed"), "w").close()
        # Report before _finish: the agent holds the slot guard until it hears from us.
        os.write(report_fd, (json.dumps({"error": "cannot start the trainer: %s" % e}) + "\n").encode())
        os.close(report_fd)
        _finish(rundir, rec, None, None, "cannot start the trainer: %s" % e)
        return
    rec = dict(rec, pid=proc.pid, pgid=proc.pid, pid_start=_proc_start(proc.pid),
               supervisor_pid=os.getpid(), supervisor_start=_proc_start(os.getpid()))
    with open(os.path.join(rundir, "pid"), "w") as f:
        f.write("%d\n" % proc.pid)
    _write_json(os.path.join(rundir, "run.json"), rec)
    os.write(report_fd, (json.dumps({"pid": proc.pid, "pid_start": rec["pid_start"],
                                     "supervisor_pid": rec["supervisor_pid"],
                                     "supervisor_start": rec["supervisor_start"]}) + "\n").encode())
    os.close(report_fd)

    def forward(signum, frame):
        # Someone stopped the supervisor itself (a container shutdown): pass it on as a stop,
        # keep waiting so the exit status is still recorded.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except OSError:
            pass
    for s in _TERMINATING:
        signal.signal(s, forward)

    while True:
        try:
            _, status = os.waitpid(proc.pid, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            status = None
            break
    _finish(rundir, rec, status, log, None)


def _signal_name(num):
    try:
        return signal.Signals(num).name
    except ValueError:
        return "SIG%d" % num


def _finish(rundir, rec, status, log, error):
    stop = _read_json(os.path.join(rundir, "stop.json"))
    code = sig = None
    if status is not None:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
        else:
            code = os.WEXITSTATUS(status)
    if code == 0:
        state = "succeeded"
    elif stop is not None or code == 143 or sig in (signal.SIGTERM, signal.SIGINT):
        state = "stopped"     # on request, or a SIGTERM from outside (a shutdown): checkpointed
    else:
        state = "failed"
    now = time.time()
    ex = {"state": state, "exit_code": code, "signal": sig,
          "signal_name": _signal_name(sig) if sig else None,
          "returncode": 128 + sig if sig else code, "ended": _now_iso(now), "ended_ts": now,
          "stop_requested": stop is not None, "error": error,
          "duration_s": round(now - rec.get("started_ts", now), 1)}
    if log is not None:
        pid = rec.get("pid")
        if sig and stop is None and sig not in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            # torchrun's wording, which the failure catalog names (segfault, abort, killed)
            what = "Signal %d (%s) received by PID %s" % (sig, ex["signal_name"], pid)
        elif sig:
            what = "terminated by %s" % ex["signal_name"]
        else:
            what = "exit code %d" % code
        os.write(log, ("dflash-ops: trainer (pid %s) ended: %s; run %s\n" % (pid, what, state)).encode())
        os.close(log)
    _write_json(os.path.join(rundir, "exit.json"), ex)
    _release_slots(rec["workdir"], rec["run"])


# --- follow -------------------------------------------------------------------------------------

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
    rid = _resolve(workdir, run)
    if rid is None:
        _write_all(1, (json.dumps({"error": "not_found", "run": run,
                                   "runs": len(_run_ids(workdir))}) + "\n").encode())
        return
    rundir = os.path.join(_runs_dir(workdir), rid)
    path = os.path.join(rundir, LOG)
    rec = _read_json(os.path.join(rundir, "run.json")) or {}
    if offset < 0:
        offset = _tail_offset(path, tail) if tail is not None else 0
    _write_all(1, (json.dumps({"run": rid, "offset": offset, "started": rec.get("started")})
                   + "\n").encode())
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
            state, _ = _state(rundir)
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
    doc = _status(workdir, rid)
    doc["offset"] = offset
    _control({"end": doc})


# --- stop ---------------------------------------------------------------------------------------

def cmd_stop(workdir, run, force, timeout):
    rid = _resolve(workdir, run)
    if rid is None:
        _out({"found": False, "run": run})
        return
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
            now = time.time()
            _write_json(exit_path, {
                "state": "stopped", "exit_code": None, "signal": None, "signal_name": None,
                "returncode": None, "ended": _now_iso(now), "ended_ts": now, "stop_requested": True,
                "error": "recorded by stop: the supervisor was gone",
                "duration_s": round(now - rec.get("started_ts", now), 1)})
            _release_slots(workdir, rid)
            break
        time.sleep(0.1)
    state, ex = _state(rundir, rec)
    _out({"found": True, "run": rid, "already": False, "signal": _signal_name(sig),
          "signalled": signalled, "state": state, "exit": ex,
          "timed_out": state == "running", "waited_s": round(time.monotonic() - start, 2)})


# --- metrics ------------------------------------------------------------------------------------

def cmd_metrics(workdir, run):
    """The trainer's OUT/metrics.jsonl when it wrote one, else the log's JSON lines."""
    rid = _resolve(workdir, run)
    if rid is None:
        _out({"found": False, "run": run})
        return
    rundir = os.path.join(_runs_dir(workdir), rid)
    metrics = []
    for name in ("metrics.jsonl", LOG):
        try:
            with open(os.path.join(rundir, name), "rb") as f:
                for raw in f:
                    doc = _metric(raw)
                    if doc is not None:
                        metrics.append(doc)
        except OSError:
            continue
        if metrics:
            break
    _out({"found": True, "run": rid, "status": _status(workdir, rid), "metrics": metrics})


# --- entry --------------------------------------------------------------------------------------

def _opt(args, name, default=None, cast=str):
    if name in args:
        i = args.index(name)
        value = cast(args[i + 1])
        del args[i:i + 2]
        return value
    return default


def _flag(args, name):
    if name in args:
        args.remove(name)
        return True
    return False


def main(argv):
    if len(argv) < 2:
        _fail("usage: runs_agent launch|status|follow|stop|metrics WORKDIR ...", 2)
    cmd, workdir, args = argv[0], os.path.expanduser(argv[1]), list(argv[2:])
    try:
        if cmd == "launch":
            cmd_launch(workdir)
        elif cmd == "status":
            cmd_status(workdir, args)
        elif cmd == "follow":
            follow = not _flag(args, "--no-follow")
            tail = _opt(args, "--tail", None, int)
            cmd_follow(workdir, args[0], int(args[1]), follow, tail)
        elif cmd == "stop":
            force = _flag(args, "--force")
            timeout = _opt(args, "--timeout", STOP_TIMEOUT_S, float)
            cmd_stop(workdir, args[0] if args else "latest", force, timeout)
        elif cmd == "metrics":
            cmd_metrics(workdir, args[0] if args else "latest")
        else:
            _fail("unknown command %r" % cmd, 2)
    except BrokenPipeError:
        # The reader went away (the connection dropped, `| head`): nothing left to do.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        except OSError:
            pass
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
