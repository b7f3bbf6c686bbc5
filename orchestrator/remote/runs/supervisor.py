"""Runs agent: the detached supervisor.

launch double-forks the supervisor (setsid, all three streams redirected: docs/background.md#pct); it is
a fork of the agent, so it runs with the whole joined program. It starts the trainer in its own
process group, reports the trainer's pid back on a pipe, waits for it, and records how it ended
in exit.json whatever way it ends; then it frees the run's slots.
"""
import json
import os
import select
import signal
import sys
import time

from ..common import _now_iso, _read_json, _write_json
from .common import LOG, _proc_start, _root_cause
from .locks import _release_slots


def _spawn_supervisor(rundir, rec, env):
    """Double fork: the grandchild (the supervisor) is in its own session, has /dev/null and its
    own log for its three streams and no other inherited fd, so the exec that ran this agent
    (ssh, pct exec / lxc-attach) returns at once (docs/background.md#pct). It reports the trainer's pid on
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
            _short_argv(rundir, env, wfd)      # returns only where it cannot re-exec
        except BaseException as e:  # never return into the agent's code
            _report_and_exit(wfd, e)
        _supervise_then_exit(rundir, rec, env, wfd)
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


_BOOT = "import os; exec(os.environ.pop('DFLASH_OPS_AGENT_SOURCE'))"


def _short_argv(rundir, env, wfd):
    """Run on as `python -c BOOT supervise RUNDIR FD`: as a fork of `python -c SOURCE`, `ps` on the
    node would show the whole agent (36 KB) as this process's command line. The same program is
    exec'd with its source in the environment, popped at once (the trainer never sees it); the
    pid, its start time, the session and the redirected streams stay what they were."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            parts = f.read().split(b"\0")
    except OSError:
        return
    if len(parts) < 3 or parts[1] != b"-c":
        return
    child = dict(env)
    child["DFLASH_OPS_AGENT_SOURCE"] = parts[2].decode("utf-8", "surrogateescape")
    os.set_inheritable(wfd, True)
    os.execve(sys.executable, [sys.executable, "-c", _BOOT, "supervise", rundir, str(wfd)], child)


def cmd_supervise(rundir, wfd):
    """The supervisor after _short_argv's exec: its environment is the trainer's."""
    try:
        rec = _read_json(os.path.join(rundir, "run.json"))
    except BaseException as e:  # never return into the agent's code
        _report_and_exit(wfd, e)
    _supervise_then_exit(rundir, rec, dict(os.environ), wfd)


def _supervise_then_exit(rundir, rec, env, wfd):
    """Supervise the run; whatever happens, report a failure to the launching agent and exit."""
    try:
        _supervise(rundir, rec, env, wfd)
    except BaseException as e:  # never return into the agent's code
        _report_and_exit(wfd, e)
    os._exit(0)


def _report_and_exit(wfd, e):
    try:
        os.write(wfd, (json.dumps({"error": "supervisor: %s" % e}) + "\n").encode())
    except OSError:
        pass
    os._exit(0)


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
    ex = _exit_record(rec, state, code, sig, stop is not None, error)
    if state == "failed" and rec.get("topology") == "processes":
        ex["root_cause"] = _root_cause(os.path.join(rundir, LOG))   # torchrun's, when it wrote one
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
        if rec.get("output"):
            os.write(log, _output_note(rec, state).encode())
        os.close(log)
    _write_json(os.path.join(rundir, "exit.json"), ex)
    _release_slots(rec["workdir"], rec["run"])


def _output_note(rec, state):
    """The log's last line for a run that writes a file (regen): where it is, what to do next."""
    out, target = rec["output"], rec.get("target") or "TARGET"
    if state == "succeeded":
        return ("dflash-ops: the rows are in %s; train on them with `dflash-ops launch %s -- --data %s`\n"
                % (out, target, out))
    return ("dflash-ops: the rows so far are in %s; `dflash-ops launch %s --resume %s` continues from there\n"
            % (out, target, rec["run"]))


def _exit_record(rec, state, code, sig, stop_requested, error):
    """The exit.json document: how the run ended. The supervisor writes it; `stop` does when the
    supervisor is gone."""
    now = time.time()
    return {"state": state, "exit_code": code, "signal": sig,
            "signal_name": _signal_name(sig) if sig else None,
            "returncode": 128 + sig if sig else code, "ended": _now_iso(now), "ended_ts": now,
            "stop_requested": stop_requested, "error": error,
            "duration_s": round(now - rec.get("started_ts", now), 1)}
