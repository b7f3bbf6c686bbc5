"""Runs agent: the detached supervisor.

launch double-forks the supervisor (setsid, all three streams redirected: docs/background.md#pct); it is
a fork of the agent, so it runs with the whole joined program. The handshake, over two pipes, makes
the launch crash-safe at every point (docs/reliability.md):

    supervisor -> agent   hello: its pid            the agent records it in the slot locks, run.json
    agent -> supervisor   go                        (end of file instead: the agent died; start nothing)
    supervisor            forks the trainer's process, which waits on a gate
                          records its pid in run.json, opens the gate: the trainer execs
    supervisor -> agent   the trainer's pid         (the agent may be gone: the run goes on)

so the supervisor is the trainer's parent from the start, nothing starts unless the slot locks
name its supervisor, and no trainer runs without its pid in run.json. It waits for the trainer
and records how it ended in exit.json whatever way it ends; then it frees the run's slots.
"""
import json
import os
import select
import signal
import sys
import time

from ..agent_base import now_iso, read_json, write_json
from .records import LOG, fault, proc_alive, proc_start, root_cause
from .kinds import kind_of
from .locks import release_slots

HELLO_TIMEOUT_S = 60.0


def _read_line(fd, timeout):
    """One JSON line from fd: the document, or None at end of file or after timeout seconds."""
    data = b""
    deadline = time.time() + timeout
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.time()))
        if not ready:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    try:
        return json.loads(data.decode())
    except ValueError:
        return None


def _send(fd, doc):
    """A JSON line to the other end; False when it is gone (the agent was killed: go on)."""
    try:
        os.write(fd, (json.dumps(doc) + "\n").encode())
        return True
    except OSError:
        return False


def spawn_supervisor(rundir, rec, env, on_hello):
    """Double fork: the grandchild (the supervisor) is in its own session, has /dev/null and its
    own log for its three streams and no other inherited fd, so the exec that ran this agent
    (ssh, pct exec / lxc-attach) returns at once (docs/background.md#pct). on_hello(doc) records
    the supervisor's pid before it may start anything; returns what the supervisor reported: the
    trainer's pid, or {"error": ...}."""
    rfd, wfd = os.pipe()          # supervisor -> agent: hello, then the trainer's pid
    go_r, go_w = os.pipe()        # agent -> supervisor: go (end of file: start nothing)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rfd)
            os.close(go_w)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            _detach(rundir, keep=(wfd, go_r))
            _short_argv(rundir, env, wfd, go_r)      # returns only where it cannot re-exec
        except BaseException as e:  # never return into the agent's code
            _report_and_exit(wfd, e)
        _supervise_then_exit(rundir, rec, env, wfd, go_r)
    os.close(wfd)
    os.close(go_r)
    os.waitpid(pid, 0)
    try:
        fault("launch.spawned")
        hello = _read_line(rfd, HELLO_TIMEOUT_S)
        if hello is None or "error" in hello:
            return hello or {"error": "the supervisor did not start (see %s/supervisor.log)" % rundir}
        fault("launch.hello")
        on_hello(hello)
        fault("launch.recorded_supervisor")
        _send(go_w, {"go": True})
        fault("launch.go")
        started = _read_line(rfd, HELLO_TIMEOUT_S)
        if started is None:
            return {"error": "the supervisor did not report the trainer's pid (see %s/supervisor.log)"
                    % rundir}
        return dict(hello, **started)
    finally:
        os.close(rfd)
        os.close(go_w)


_BOOT = "import os; exec(os.environ.pop('DFLASH_OPS_AGENT_SOURCE'))"


def _short_argv(rundir, env, wfd, go_r):
    """Run on as `python -c BOOT supervise RUNDIR FD GO_FD`: as a fork of `python -c SOURCE`, `ps` on
    the node would show the whole agent (36 KB) as this process's command line. The same program is
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
    os.set_inheritable(go_r, True)
    os.execve(sys.executable, [sys.executable, "-c", _BOOT, "supervise", rundir, str(wfd), str(go_r)], child)


def cmd_supervise(rundir, wfd, go_r):
    """The supervisor after _short_argv's exec: its environment is the trainer's."""
    try:
        rec = read_json(os.path.join(rundir, "run.json"))
    except BaseException as e:  # never return into the agent's code
        _report_and_exit(wfd, e)
    _supervise_then_exit(rundir, rec, dict(os.environ), wfd, go_r)


def _supervise_then_exit(rundir, rec, env, wfd, go_r):
    """Supervise the run; whatever happens, report a failure to the launching agent and exit."""
    try:
        _supervise(rundir, rec, env, wfd, go_r)
    except BaseException as e:  # never return into the agent's code
        _report_and_exit(wfd, e)
    os._exit(0)


def _report_and_exit(wfd, e):
    _send(wfd, {"error": "supervisor: %s" % e})
    os._exit(0)


def _detach(rundir, keep):
    devnull = os.open(os.devnull, os.O_RDWR)
    log = os.open(os.path.join(rundir, "supervisor.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    for fd in (devnull, log):
        if fd > 2 and fd not in keep:
            os.close(fd)
    _close_fds_but(keep)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    os.chdir("/")
    os.umask(0o022)


def _close_fds_but(keep):
    """Close every fd from 3 up but those in keep."""
    try:
        maxfd = os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        maxfd = 1024
    low = 3
    for fd in sorted(set(keep)) + [maxfd]:
        os.closerange(low, fd)
        low = fd + 1


_TERMINATING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _fork_trainer(command, cwd, env, log):
    """(pid, gate fd, exec-error fd): the trainer's process, forked, leading its own session and
    process group (which `stop` signals as a whole: torchrun and its ranks, dataloader workers;
    this supervisor is not in it), its streams on the log. It waits until the gate is opened
    (a byte written to the gate fd) before it execs the trainer; at end of file instead (this
    supervisor died before recording its pid) it exits and nothing ran. The error fd brings back
    why an exec failed (end of file: it exec'd)."""
    gate_r, gate_w = os.pipe()
    err_r, err_w = os.pipe()        # close-on-exec: closed by a successful exec
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            for s in (signal.SIGPIPE, signal.SIGXFSZ) + _TERMINATING:
                signal.signal(s, signal.SIG_DFL)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            _close_fds_but((gate_r, err_w))
            os.chdir(cwd)
            if os.read(gate_r, 1) != b"g":
                os._exit(0)
            os.close(gate_r)
            os.execve(command[0], command, env)
        except BaseException as e:
            try:
                os.write(err_w, str(e).encode("utf-8", "replace"))
            finally:
                os._exit(127)
    os.close(gate_r)
    os.close(err_w)
    return pid, gate_w, err_r


def runs_trainer(rec):
    """Whether the recorded trainer pid runs the trainer: a process still waiting at its gate
    (runs/supervisor.py) is the supervisor's fork, with the supervisor's command line, and exits
    without starting anything once its supervisor is gone."""
    pid = rec.get("pid")
    if not proc_alive(pid, rec.get("pid_start"), rec.get("boot")):
        return False
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            argv = f.read().split(b"\0")[:-1]
    except OSError:
        return True
    return [a.decode("utf-8", "surrogateescape") for a in argv] == rec.get("command")


def _supervise(rundir, rec, env, report_fd, go_r):
    me = {"supervisor_pid": os.getpid(), "supervisor_start": proc_start(os.getpid())}
    _send(report_fd, me)
    go = _read_line(go_r, HELLO_TIMEOUT_S)
    os.close(go_r)
    if not go:      # the agent died before it recorded this supervisor: nothing was started
        os._exit(0)
    fault("supervisor.go")

    log_path = os.path.join(rundir, LOG)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def note(text):
        os.write(log, ("dflash-ops: " + text + "\n").encode())

    note("run %s: %s" % (rec["run"], rec["command_line"]))
    pid, gate, err = _fork_trainer(rec["command"], rec["cwd"], env, log)
    fault("supervisor.forked")
    rec = dict(rec, pid=pid, pgid=pid, pid_start=proc_start(pid), **me)
    with open(os.path.join(rundir, "pid"), "w") as f:
        f.write("%d\n" % pid)
    write_json(os.path.join(rundir, "run.json"), rec)
    fault("supervisor.recorded")
    os.write(gate, b"g")
    os.close(gate)
    with os.fdopen(err, "rb") as f:
        failed = f.read().decode("utf-8", "replace")
    if failed:
        note("cannot start the trainer: %s" % failed)
        open(os.path.join(rundir, "supervisor.failed"), "w").close()
        os.waitpid(pid, 0)
        # Report before _finish: the agent holds the slot guard until it hears from us.
        _send(report_fd, {"error": "cannot start the trainer: %s" % failed})
        os.close(report_fd)
        os.close(log)
        _finish(rundir, rec, None, None, "cannot start the trainer: %s" % failed)
        return
    fault("supervisor.started")

    def forward(signum, frame):
        # Someone stopped the supervisor itself (a container shutdown): pass it on as a stop,
        # keep waiting so the exit status is still recorded.
        try:
            os.killpg(pid, signal.SIGTERM)
        except OSError:
            pass
    for s in _TERMINATING:
        signal.signal(s, forward)
    _send(report_fd, {"pid": pid, "pid_start": rec["pid_start"]})
    os.close(report_fd)

    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            status = None
            break
    _finish(rundir, rec, status, log, None)


def signal_name(num):
    try:
        return signal.Signals(num).name
    except ValueError:
        return "SIG%d" % num


def _finish(rundir, rec, status, log, error):
    stop = read_json(os.path.join(rundir, "stop.json"))
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
    ex = exit_record(rec, state, code, sig, stop is not None, error)
    if state == "failed" and rec.get("topology") == "processes":
        ex["root_cause"] = root_cause(os.path.join(rundir, LOG))   # torchrun's, when it wrote one
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
        if kind_of(rec)["ended"] and rec.get("output"):
            os.write(log, _output_note(rec, state).encode())
        os.close(log)
    write_json(os.path.join(rundir, "exit.json"), ex)
    release_slots(rec["workdir"], rec["run"])


def _output_note(rec, state):
    """The log's last line for a run that writes a file (regen): where it is, what to do next, in
    its kind's words (runs/kinds.py "ended")."""
    done, not_done = kind_of(rec)["ended"]
    line = (done if state == "succeeded" else not_done).format(
        output=rec["output"], target=rec.get("target") or "TARGET", run=rec["run"])
    return "dflash-ops: %s\n" % line


def exit_record(rec, state, code, sig, stop_requested, error):
    """The exit.json document: how the run ended. The supervisor writes it; `stop` does when the
    supervisor is gone."""
    now = time.time()
    return {"state": state, "exit_code": code, "signal": sig,
            "signal_name": signal_name(sig) if sig else None,
            "returncode": 128 + sig if sig else code, "ended": now_iso(now), "ended_ts": now,
            "stop_requested": stop_requested, "error": error,
            "duration_s": round(now - rec.get("started_ts", now), 1)}
