"""Watching one probe case: its process isolated and streamed, a heartbeat while it runs, and what a
failure means.

- `run_isolated` runs a case in its own process group, reads its output as it comes, and calls
  `on_beat(phase, seconds)` at least every BEAT_S while it runs; the case announces its phase
  (import, compile, teacher-forced, timed) with PHASE_MARK lines (case.py).
- `explain` turns a failed case into what a user acts on: the last line of the real exception, the
  catalog's remedy (trainer/signatures.yaml) and, for a module that is not installed, which one and
  how to install it.
- `kill_tree` ends a case and every process under it, torchrun's ranks included (they run in sessions
  of their own); `trainer.procs.descendants` finds them.
- `rendezvous_problem` says, in well under a second, why a torchrun rendezvous on this machine
  cannot form (the hostname does not resolve, no local port binds), before a `processes` case waits
  minutes for it.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from typing import Sequence

from trainer import faults
from trainer.procs import descendants

CASE_MARK = "@@dflash-probe-case@@ "
PHASE_MARK = "@@dflash-probe-phase@@ "
PHASES = ("import", "compile", "teacher-forced", "timed", "verdict")
# Set by the parent when cases run side by side (schedule.py): a file whose existence means "your
# timed phase may start now, the other cases are stopped". Unset: no wait.
GATE_ENV = "DFLASH_PROBE_GATE"
BEAT_S = 10.0          # a heartbeat at least this often while a case runs
TAIL_LINES = 20
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failed)\b(?::.*)?$")
_NO_MODULE = re.compile(r"No module named '([\w.]+)'")


def run_isolated(cmd: list[str], timeout: float, *, cwd: str | None = None, env: dict | None = None,
                 on_beat=None, beat_s: float | None = None, control=None) -> dict:
    """Run `cmd` in its own process group with stdout+stderr merged; on timeout kill it and every
    process under it (the case, its compile workers, torchrun's ranks). Returns the case result
    line (if printed), exit code (negative: killed by that signal; None on timeout), output without
    it, tail, seconds, and the last phase the case announced.

    `control` (schedule.Control, when cases run side by side): told when the process starts, each
    phase and the end; the seconds it held the case (waiting to start while another was timed,
    stopped while another was timed, or waiting for its own turn) do not count against `timeout`.
    The heartbeat comes every `beat_s` (BEAT_S; a test's fault point probe_beat_s sets it for the whole
    program, so that it sees one however fast its cases are)."""
    if beat_s is None:
        beat_s = float(faults.value("probe_beat_s") or BEAT_S)
    with control.launch() if control else _nothing() as register:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, env=env, start_new_session=True)
        register(proc.pid)
    t0 = time.monotonic()     # from the start: the wait for it is not the case's time
    try:
        return _watch(proc, t0, timeout, on_beat, beat_s, control)
    finally:
        if control:
            control.ended()


@contextlib.contextmanager
def _nothing():
    yield lambda pid: None


def _watch(proc, t0: float, timeout: float, on_beat, beat_s: float, control) -> dict:
    state = {"phase": PHASES[0], "result": None}
    lines: list[str] = []

    def read() -> None:
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.startswith(CASE_MARK):
                state["result"] = _json(line[len(CASE_MARK):])
            elif line.startswith(PHASE_MARK):
                state["phase"] = line[len(PHASE_MARK):].strip()
                if control:
                    control.on_phase(state["phase"])
            else:
                lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    next_beat = t0 + beat_s
    try:
        while proc.poll() is None:
            now = time.monotonic()
            deadline = t0 + timeout + (control.held_s() if control else 0.0)
            if now >= deadline:
                timed_out = True
                break
            if on_beat and now >= next_beat:
                on_beat(control.phase_text(state["phase"]) if control else state["phase"], now - t0)
                next_beat = now + beat_s
            time.sleep(min(0.2, max(0.01, deadline - now)))
    except BaseException:
        kill_tree(proc.pid)    # the probe itself is being stopped: take the case down with it
        raise
    kill_tree(proc.pid)        # a hung case, or compile workers the case left behind
    proc.wait()
    reader.join(timeout=5)     # the pipe closes once every process of the group is gone
    return {"result": state["result"], "exit_code": None if timed_out else proc.returncode,
            "timed_out": timed_out, "output": "\n".join(lines), "tail": lines[-TAIL_LINES:],
            "seconds": round(time.monotonic() - t0, 2), "phase": state["phase"]}


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def signal_tree(pid: int, sig: int, known: Sequence[int] = ()) -> list[int]:
    """Send `sig` to the process group led by `pid`, then to every process under it (and to `known`,
    processes found before); returns the processes reached. The group first: a stopped or killed
    parent starts no new child while the tree is walked."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    reached = list(dict.fromkeys([*known, *descendants(pid)]))
    for p in reached:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return reached


def kill_tree(pid: int) -> None:
    """SIGKILL a case's process group and every process under it."""
    signal_tree(pid, signal.SIGKILL, descendants(pid))


def wait_for_turn(poll_s: float = 0.005) -> None:
    """In a case, before its timed phase: when the parent runs cases side by side (GATE_ENV set),
    wait until it has stopped the others and says go."""
    gate = os.environ.get(GATE_ENV)
    while gate and not os.path.exists(gate):
        time.sleep(poll_s)


def last_exception(output: str) -> str | None:
    """The last `SomeError: message` line of the output (the real exception at the end of its
    traceback), or None."""
    found = None
    for line in output.splitlines():
        s = line.strip()
        if _EXCEPTION.match(s):
            found = s
    return found


def explain(output: str, signature: str | None, catalog) -> dict:
    """What a failed case tells a user: the exception's last line, the catalog's remedy for its
    signature, and, for a module that is not installed, which one and how to install it."""
    exc = last_exception(output)
    remedy = None
    if signature and catalog is not None:
        try:
            remedy = catalog.get(signature).remedy
        except (KeyError, AttributeError):
            remedy = None
    missing = _NO_MODULE.findall(output)
    if missing:
        module = missing[-1].split(".")[0]
        remedy = (f"the module {module!r} is not installed in the target's python: "
                  f"`python -m pip install {module}` there (or add it to trainer/requirements.txt and "
                  f"deploy, which installs the requirements)") + (f"; {remedy}" if remedy else "")
    return {"exception": exc, "remedy": remedy, "missing_module": missing[-1] if missing else None}


def rendezvous_problem() -> str | None:
    """Why a torchrun rendezvous (`--standalone`: this host's name, a free local port) cannot form
    here, or None. Checks what the rendezvous itself does first: resolve the hostname, bind a port."""
    host = socket.gethostname()
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(0.5)
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        return (f"the hostname {host!r} does not resolve ({e.strerror or e}): torchrun's rendezvous "
                f"cannot form; add it to /etc/hosts (e.g. `127.0.1.1 {host}`)")
    finally:
        socket.setdefaulttimeout(old)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
    except OSError as e:
        return f"no local TCP port binds ({e.strerror or e}): torchrun's rendezvous cannot form"
    return None
