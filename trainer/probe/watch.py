"""Watching one probe case: its process isolated and streamed, a heartbeat while it runs, and what a
failure means.

- `run_isolated` runs a case in its own process group, reads its output as it comes, and calls
  `on_beat(phase, seconds)` at least every BEAT_S while it runs; the case announces its phase
  (import, compile, teacher-forced, timed) with PHASE_MARK lines (case.py).
- `explain` turns a failed case into what a user acts on: the last line of the real exception, the
  catalog's remedy (trainer/signatures.yaml) and, for a module that is not installed, which one and
  how to install it.
- `rendezvous_problem` says, in well under a second, why a torchrun rendezvous on this machine
  cannot form (the hostname does not resolve, no local port binds), before a `processes` case waits
  minutes for it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

CASE_MARK = "@@dflash-probe-case@@ "
PHASE_MARK = "@@dflash-probe-phase@@ "
PHASES = ("import", "compile", "teacher-forced", "timed")
BEAT_S = 10.0          # a heartbeat at least this often while a case runs
TAIL_LINES = 20
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failed)\b(?::.*)?$")
_NO_MODULE = re.compile(r"No module named '([\w.]+)'")


def run_isolated(cmd: list[str], timeout: float, *, cwd: str | None = None, env: dict | None = None,
                 on_beat=None, beat_s: float = BEAT_S) -> dict:
    """Run `cmd` in its own process group with stdout+stderr merged; on timeout kill the group
    (the case and any compile workers it started). Returns the case result line (if printed),
    exit code (negative: killed by that signal; None on timeout), output without it, tail, seconds,
    and the last phase the case announced."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=cwd, env=env, start_new_session=True)
    state = {"phase": PHASES[0], "result": None}
    lines: list[str] = []

    def read() -> None:
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.startswith(CASE_MARK):
                state["result"] = _json(line[len(CASE_MARK):])
            elif line.startswith(PHASE_MARK):
                state["phase"] = line[len(PHASE_MARK):].strip()
            else:
                lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    next_beat = t0 + beat_s
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if now >= t0 + timeout:
                timed_out = True
                break
            if on_beat and now >= next_beat:
                on_beat(state["phase"], now - t0)
                next_beat = now + beat_s
            time.sleep(min(0.2, max(0.01, t0 + timeout - now)))
    except BaseException:
        _killpg(proc.pid)      # the probe itself is being stopped: take the case down with it
        raise
    _killpg(proc.pid)          # a hung case, or compile workers the case left behind
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


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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
