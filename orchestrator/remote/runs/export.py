"""Runs agent: the `export` command. Standard library only, Python >= 3.8, no `from __future__`
line (runs/records.py says why).

    export WORKDIR [--step N] [--dtype D] [--running-ok] [--target-changed-ok] -- RUN

Runs `python -m trainer.export` of the live release (WORKDIR/current) on the run's folder, from the
run's own cwd (run.json "cwd": its relative --target is relative to it) with its launch-time
variables (run.json "user_env"), into a private temporary folder WORKDIR/exports/.tmp-PID, and
sends the result over this one connection: stdout is one JSON header line

    {"ok": true, "run", "step", "running", "dtype", "checkpoint", "mask_token_id", "target_layer_ids",
     "target_changed", "files": [{"name", "size", "sha256"}, ...]}

followed by the files' bytes back to back, in the header's order. The temporary folder is removed
whatever happens (the reader going away, SIGHUP/SIGTERM); ones left by an agent killed with SIGKILL
are removed by the next export. It lives only as long as its controller, which holds stdin open
until the stream is in: EOF there (the controller interrupted, killed, its connection dropped) hangs
this agent up (hang_up_on_eof), its worker and folder with it, wherever it stands (exporting, or
blocked mid-stream). A refusal is a header with "ok": false (and exit status 0):
"reason": "not_found" when there is no such run (RUN "latest" or "": the newest SUCCEEDED run), else
"reason": "no_drafter" (a run of a kind that leaves none: regen) | "running" (the run is still
running and --running-ok was not given) | "no_release" | "export" with "message" and, for "export",
the trainer's "exit_code" (its last line, or "export killed by signal N (NAME)" and 128 + N).
--running-ok and --target-changed-ok are passed on to the trainer's export (docs/export.md).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from ..agent_base import MASKED, refuse, sha256
from .records import not_found, resolve, run_ids, run_record, run_state, runs_dir_of, sweep_dead
from .kinds import kind_of

CHUNK = 1 << 20
# trainer.export's words for a run still running (a test holds them equal): the agent judges by the
# run's state, so a run of a trainer older than the trainer's lock is refused too.
STILL_RUNNING = "the run is still running (pass --running-ok to export its newest complete checkpoint)"


def _latest_succeeded(workdir):
    """The newest succeeded run that leaves a drafter (a regen run has rows, no drafter)."""
    for rid in reversed(run_ids(workdir)):
        rundir = os.path.join(runs_dir_of(workdir), rid)
        rec = run_record(rundir)
        if kind_of(rec)["drafter"] and run_state(rundir, rec)[0] == "succeeded":
            return rid
    return None


def _interrupted(signum, frame):
    raise SystemExit(128 + signum)   # runs the finally blocks: the temporary folder goes


def hang_up_on_eof():
    """A thread that reads stdin to its EOF (the controller sends nothing more) and then sends SIGHUP to
    the main thread: pthread_kill interrupts a blocking call there (a read, a write to a full pipe, an
    open), where a signal to the process might land in this thread; this thread blocks SIGHUP, SIGTERM
    and SIGINT for the same reason. export's and bench's agents end on it."""
    main_ident = threading.main_thread().ident

    def watch():
        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGHUP, signal.SIGTERM, signal.SIGINT))
        try:
            while os.read(0, 1 << 16):
                pass
        except OSError:
            pass
        try:
            signal.pthread_kill(main_ident, signal.SIGHUP)
        except (OSError, ValueError):
            pass        # the agent is ending anyway
    threading.Thread(target=watch, name="hang-up", daemon=True).start()


def run_to_export(workdir, run, running_ok=False):
    """(run id, its folder, its run.json) of RUN as export takes it ("latest"/"": the newest succeeded training
    run), or the refusal: no such run, a regen run, a running run without --running-ok, no release."""
    if run in ("", "latest", None):
        rid = _latest_succeeded(workdir)
    else:
        rid = resolve(workdir, run)
    if rid is None:
        not_found(workdir, run or "latest", any_runs=bool(run_ids(workdir)))
    rundir = os.path.join(runs_dir_of(workdir), rid)
    rec = run_record(rundir)
    if not kind_of(rec)["drafter"]:
        refuse("no_drafter", "a %s run has no drafter (its output is in %s)" % (rec.get("kind"), rec.get("output")),
               found=True, run=rid, exit_code=2)
    if run_state(rundir, rec)[0] == "running" and not running_ok:
        refuse("running", STILL_RUNNING, found=True, run=rid)
    if not os.path.isfile(os.path.join(workdir, "current", "trainer", "export.py")):
        refuse("no_release", "the live release in %s has no trainer/export.py" % workdir, found=True, run=rid)
    return rid, rundir, rec


def private_tmp(workdir):
    """A new WORKDIR/exports/.tmp-PID (leftovers of killed agents swept first); SIGHUP/SIGTERM then
    end this agent through its finally blocks, so the caller's `finally` removes the folder."""
    exports = os.path.join(workdir, "exports")
    os.makedirs(exports, exist_ok=True)
    sweep_dead(exports, ".tmp-")
    for sig in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, _interrupted)
    return os.path.join(exports, ".tmp-%d" % os.getpid())


# `python -m MODULE` of the live release (argv[1]) run from another folder (the run's own cwd, against
# which its relative --target and --data were written): the release's code first on sys.path, not the cwd.
# Started by run_child, it first asks the kernel for SIGKILL when that agent dies (PR_SET_PDEATHSIG, prctl
# option 1; ctypes is the standard library's way to it), so that no worker outlives an agent killed
# with SIGKILL; an agent gone before the call (the parent is another process by then) ends it at once.
# The variable is removed first: the worker's own children do not inherit it.
_RUN_MODULE = ("import os, sys\n"
               "parent = os.environ.pop('DFLASH_OPS_PARENT', '')\n"
               "if parent:\n"
               "    try:\n"
               "        import ctypes; ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)\n"
               "    except (ImportError, OSError, AttributeError):\n"
               "        pass\n"
               "    if os.getppid() != int(parent):\n"
               "        os._exit(137)\n"
               "import runpy; p = sys.argv.pop(1); sys.path[:] = [p] + [x for x in sys.path if x]\n"
               "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def run_cwd(workdir, rec):
    """Where the run's trainer ran (its relative --target and --data are relative to it): run.json's
    "cwd" while that release is kept, else the live release."""
    cwd = rec.get("cwd")
    return cwd if cwd and os.path.isdir(cwd) else os.path.realpath(os.path.join(workdir, "current"))


def run_env(rec, environ, cuda_visible):
    """The environment of a program run on the run's behalf: this agent's (the target's env: now),
    the run's launch-time variables over it (run.json "user_env", hosts.yaml env: and launch --env;
    a masked secret keeps this agent's value), unbuffered, with only `cuda_visible` GPUs."""
    env = dict(environ)
    env.update({k: v for k, v in (rec.get("user_env") or {}).items() if isinstance(v, str) and v != MASKED})
    env.update({"PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": cuda_visible})
    return env


def _signal_text(n):
    try:
        name = signal.Signals(n).name
    except ValueError:
        return "signal %d" % n
    return "signal %d (%s)" % (n, "SIGKILL: out of memory?" if n == signal.SIGKILL else name)


def run_child(rid, what, argv, cwd, env, echo=False, reason=None):
    """Run argv (stdin closed) to its end: its stdout. Its stderr lines pass through to this agent's
    stderr as they come when `echo`, else only the last one is kept. A failure is refused with
    `reason(last line)` (default "export"): the last line less its program's `WHAT: error: `, or,
    killed by a signal, "WHAT killed by signal N (NAME)", and "exit_code" (128 + N then).
    The worker runs in a session of its own: this agent ending any other way (an exception, a signal
    its handler turns into one) kills its whole process group; killed with SIGKILL, the worker dies
    with it (_RUN_MODULE's PR_SET_PDEATHSIG)."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=dict(env, DFLASH_OPS_PARENT=str(os.getpid())),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.PIPE, start_new_session=True)
        last = "(no message)"
        try:
            for line in iter(proc.stderr.readline, b""):
                if echo:
                    sys.stderr.buffer.write(line)
                    sys.stderr.flush()
                last = line.decode("utf-8", "replace").strip() or last
            proc.wait()
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    proc.kill()
                proc.wait()
            proc.stderr.close()
        code, reason = proc.returncode, reason or (lambda _: "export")
        if code < 0:
            refuse(reason(""), "%s killed by %s" % (what, _signal_text(-code)),
                   found=True, run=rid, exit_code=128 - code)
        if code != 0:
            for head in (what + ": error: ", "trainer: error: "):
                last = last[len(head):] if last.startswith(head) else last
            refuse(reason(last), last, found=True, run=rid, exit_code=code)
        out.seek(0)
        return out.read()


def program(workdir, module):
    """argv of `python -m MODULE` of the live release, whatever the cwd (_RUN_MODULE)."""
    return [sys.executable, "-c", _RUN_MODULE, os.path.realpath(os.path.join(workdir, "current")), module]


def export_into(workdir, rid, rundir, rec, folder, dtype, step, running_ok=False, target_changed_ok=False,
                cuda_visible=""):
    """`python -m trainer.export` of the live release into `folder`, from the run's cwd with its
    launch-time env (rec: its run.json): its document (step, checkpoint, ...), or the refusal "export"
    with the trainer's last line and exit status."""
    argv = program(workdir, "trainer.export") + ["--run", rundir, "-o", folder, "--dtype", dtype]
    if step is not None:
        argv += ["--step", str(step)]
    argv += ["--running-ok"] * running_ok + ["--target-changed-ok"] * target_changed_ok
    out = run_child(rid, "export", argv, run_cwd(workdir, rec), run_env(rec, os.environ, cuda_visible))
    return json.loads(out.decode("utf-8", "replace").strip().splitlines()[-1])


def cmd_export(workdir, run, step, dtype, running_ok=False, target_changed_ok=False):
    rid, rundir, rec = run_to_export(workdir, run, running_ok)
    tmp = private_tmp(workdir)
    hang_up_on_eof()    # after private_tmp's handlers: SIGHUP ends this agent through the finally below
    try:
        os.mkdir(tmp)
        folder = os.path.join(tmp, "draft")
        info = export_into(workdir, rid, rundir, rec, folder, dtype, step, running_ok, target_changed_ok)
        files = []
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            files.append({"name": name, "size": os.path.getsize(path), "sha256": sha256(path)})
        header = {"ok": True, "found": True, "run": rid, "step": info.get("step"), "running": info.get("running"),
                  "dtype": dtype, "checkpoint": info.get("checkpoint"), "mask_token_id": info.get("mask_token_id"),
                  "target_layer_ids": info.get("target_layer_ids"), "target_changed": info.get("target_changed"),
                  "files": files}
        stream = sys.stdout.buffer
        stream.write((json.dumps(header) + "\n").encode())
        for f in files:
            with open(os.path.join(folder, f["name"]), "rb") as src:
                for block in iter(lambda: src.read(CHUNK), b""):
                    stream.write(block)
        stream.flush()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
