"""The runs agent (entry `runs.runs_agent`): the run commands and main().

Runs on the TARGET, under the target's own python, as `python -c SOURCE CMD ...`, SOURCE being
this module and what it imports, joined by orchestrator/ssh/agent_call.py. Standard library only,
Python >= 3.8. Every command prints one JSON document as its last stdout line (a refusal is
`{"ok": false, "reason": R, ...}`, exit 0), except `follow`, `export` and `tensorboard`, whose stdout
is a JSON header line followed by raw bytes.

    launch WORKDIR            stdin: the launch spec (one JSON line), then the bytes of the files
                              it names ("files", runs/upload.py). Checks the release, the probe result
                              and the slot locks, then starts a detached supervisor (double fork,
                              setsid, all three streams redirected: docs/background.md#pct) that starts the
                              trainer and records its exit status whatever way it ends.
    status WORKDIR [-- RUN...]
                              the runs (all, or those named) with state, step, loss, tau, and the
                              bench-decodes running (`bench-PID`, kind bench-decode: runs/locks.py)
    follow WORKDIR --offset OFFSET [--no-follow] [--tail N] -- RUN
                              header line, then the log from byte OFFSET as it grows; ends once
                              the run has ended and every byte is out. Control messages go to
                              stderr as JSON lines: {"hb": T} every few seconds (so a dead
                              connection is noticed on both ends) and {"end": STATUS} last.
    stop WORKDIR [--force] [--timeout S] -- RUN
                              SIGTERM (SIGKILL with --force) to the trainer's process group, then
                              wait for it to checkpoint and exit; RUN bench-PID: that bench-decode
                              (runs/stop.py)
    metrics WORKDIR -- RUN    the log's JSON metric lines
    tensorboard WORKDIR -- RUN...
                              the runs' TensorBoard event files from the sizes the controller holds
                              (stdin), as a header line and bytes (runs/tensorboard.py)
    export WORKDIR [--step N] [--dtype D] [--running-ok] [--target-changed-ok] -- RUN
                              the run's drafter as a DFlash folder, streamed (runs/export.py)
    bench WORKDIR [--step N] [--max-new-tokens N] [--limit N] [--running-ok] [--prompts-bytes N] -- RUN
                              decoding with the run's drafter vs the target alone; specdec's live
                              lines on stderr, its document in the reply; ends when its stdin does
                              (runs/bench.py)
    probe WORKDIR [--reuse] -- PROBE_ARGS...
                              the live release's probe program, its document as the reply
                              (runs/probe.py)
    rm WORKDIR [--dry-run] -- RUN...    prune WORKDIR --keep N [--dry-run]
                              remove ended runs, never a running one (runs/housekeeping.py)

The launch spec may name GPUs ("gpu_ids": exactly those slots), a "name" (shown by status), and
"resume": RUN, which continues a stopped or failed run in its own folder, with its own settings
and the trainer's --resume, as attempt N+1 (run.json "attempts" keeps the earlier ones).

Options come before `--`, values (run ids) after it: a run id is never read as an option.

A run lives in WORKDIR/runs/RUN/: run.json (what was launched), train.log (the trainer's stdout
and stderr), pid (the trainer's), exit.json (written by the supervisor when the trainer ends),
stop.json (a stop was requested). RUN "latest" (or "") names the newest run. A run's "kind" is
"train" (`python -m trainer`) or "regen" (`python -m trainer.regen`, no probe, no policy; its
prompts.jsonl uploaded into the folder, its rows written to regen.jsonl there, run.json "output"):
one entry each in runs/kinds.py.

A run holds slots (a GPU each, or the one `cpu` slot) until it ends: runs/locks.py.
The supervisor that starts the trainer and records its end: runs/supervisor.py. A node of a job over
several: its training interface named to gloo and NCCL, or a refusal (runs/net.py).
"""
import errno
import json
import os
import platform
import shlex
import socket
import sys
import time

from ..agent_base import checked_workdir, dist_version, emit, fail, home_dir, now_iso, read_json, refuse, write_json
from .records import LOG, boot, fault, proc_start, resolve, run_ids, run_record, run_state, run_status, runs_dir_of  # noqa: E501
from ..release.store import live_release
from .bench import BENCH_FLAGS, BENCH_OPTIONS, cmd_bench
from .export import cmd_export
from .follow import cmd_follow, cmd_metrics
from .kinds import kind_of, run_command
from .spec import AUTO_POLICY, PROBE_FILE, normalize
from .upload import discard, place, receive
from .housekeeping import RESUMABLE, cmd_prune, cmd_rm, end_attempt, resume_spec
from .locks import BENCH, Guard, bench_row, benches, claim, drop, hold_slots
from .net import IFNAME_VARS, network_env
from .probe import cmd_probe
from .stop import cmd_stop
from .tensorboard import cmd_tensorboard
from .supervisor import cmd_supervise, exit_record, runs_trainer, spawn_supervisor

STOP_TIMEOUT_S = 120.0
RUN_MIN_FREE = 64 * 10**6    # bytes a new run folder needs free: its log, config and first checkpoints


def cmd_status(workdir, runs):
    """The runs (all, or those named), then the bench-decodes running here (runs/locks.py), one row each."""
    if runs:
        out, missing = [], []
        for r in runs:
            rid = resolve(workdir, r)
            bench = benches(workdir, [r]) if rid is None and r.startswith(BENCH) else []
            if rid or bench:
                out.append(run_status(workdir, rid) if rid else bench_row(bench[0]))
            else:
                missing.append(r)
        emit({"runs": out, "missing": missing})
    else:
        emit({"runs": [run_status(workdir, r) for r in run_ids(workdir)] + [bench_row(b) for b in benches(workdir)],
              "missing": []})


# --- launch -------------------------------------------------------------------------------------

def _release_info(workdir):
    release, path = live_release(workdir)
    if release is None or not os.path.isdir(path):
        return None, None, None
    commit = None
    for name in (".git-commit", "GIT_COMMIT"):
        try:
            with open(os.path.join(path, name)) as f:
                commit = f.read().strip() or None
            break
        except OSError:
            pass
    if commit is None:
        man = read_json(os.path.join(path, ".dflash-manifest.json")) or {}
        meta = man.get(".dflash-release") if isinstance(man, dict) else None
        if isinstance(meta, dict):
            commit = meta.get("commit")
    return os.path.basename(path), path, commit


# `auto`'s rule, asked of the live release's trainer (torch-free module, no torch loaded).
def _check_probe(workdir):
    """`auto` is the probe's choice, which the trainer reads from WORKDIR/probe.json when it starts
    (trainer.policies.resolve: the one place the rule is written) and records in its run folder
    (CHOSEN_POLICY). Without a probe result there is nothing to read: refused here, before a run starts."""
    if not os.path.exists(os.path.join(workdir, PROBE_FILE)):
        refuse("no_probe", "--compile-policy auto needs a probe result and %s/%s does not exist"
               % (workdir, PROBE_FILE))


def _visible_gpus():
    """The GPUs this container can use, as `nvidia-smi -L` lists them (0 without nvidia-smi)."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.decode("utf-8", "replace").splitlines() if line.startswith("GPU "))


def cmd_launch(workdir):
    """The spec is stdin's first line; the files it names (`files`) follow it (runs/upload.py)."""
    stdin = sys.stdin.buffer
    try:        # the one place the spec's keys are checked and their defaults filled in (runs/spec.py)
        spec = normalize(json.loads(stdin.readline().decode("utf-8")))
    except ValueError as e:     # not JSON, or not a launch spec (SpecError)
        refuse("bad_spec", "the launch spec: %s" % e)
    uploads = receive(stdin, runs_dir_of(workdir), spec) if not spec["resume"] else None
    try:
        _launch(workdir, dict(spec, upload_dir=uploads))
    finally:
        discard(uploads)       # empty once _start_run placed them in the run's folder


def _launch(workdir, spec):
    prev = None
    if spec["resume"]:              # continue a stopped or failed run in place, with its settings
        spec, prev = resume_spec(workdir, spec)
    run = spec["run"]
    release, release_path, commit = _release_info(workdir)
    if release is None:
        refuse("no_release", "no release deployed in %s" % workdir)
    if dist_version("torch") is None:      # the trainer would die at its first import
        refuse("no_torch", "%s has no torch" % sys.executable, python=sys.executable)
    if spec["cpu_by_default"]:
        visible = _visible_gpus()
        if visible:
            refuse("has_gpus", "%d GPU(s) here, none in the launch" % visible, gpus=visible)
    kind = kind_of(spec)
    if kind["module"] is None:
        refuse("bad_kind", "this dflash-ops does not know runs of kind %r" % spec["kind"])
    if spec["nodes"] and not kind["nodes"]:     # its program takes no rendezvous flags
        refuse("one_node", "a %s run runs on one node; name one target" % spec["kind"])
    # none: a kind without a policy (regen), and no probe either
    compile_policy = spec["compile_policy"] if kind["policy"] else None
    if compile_policy == AUTO_POLICY:
        _check_probe(workdir)
    # `auto` goes to the trainer as is: it resolves it from DFLASH_OPS_WORKDIR/probe.json, refuses a
    # choice probed under another torch build, and records what it runs (status reads it back).
    gpus, total = spec["gpus"] or 0, spec["target_gpus"]
    want = spec["gpu_ids"]
    if want is not None:
        bad = [i for i in want if not 0 <= i < total]
        if bad or not want or len(set(want)) != len(want):
            refuse("bad_gpu_ids", "--gpu-ids %s: the target's GPUs are 0..%d, each named once"
                    % (",".join(map(str, want)), total - 1))
        gpus = len(want)
    if gpus > total:
        refuse("too_many_gpus", "--gpus %d is more than the target's %d GPU(s)" % (gpus, total))
    if spec["nodes"]:               # one node of several: the interface its ranks advertise (runs/net.py)
        spec["node_env"], why = network_env(spec["nodes"], os.environ)
        if why:
            refuse("network", why)
    rundir = os.path.join(runs_dir_of(workdir), run)
    try:
        os.makedirs(runs_dir_of(workdir), exist_ok=True)
        st = os.statvfs(runs_dir_of(workdir))
        free = st.f_bavail * st.f_frsize
    except OSError as e:
        refuse("io", "cannot use %s: %s" % (runs_dir_of(workdir), e.strerror or e))
    if free < RUN_MIN_FREE:
        refuse("no_space", "%s has %.1f MB free; a run needs at least %d MB there for its log "
                "and checkpoints" % (runs_dir_of(workdir), free / 1e6, RUN_MIN_FREE // 10**6))
    with Guard(workdir) as guard:
        if prev is not None:
            state, _ = run_state(rundir, prev)
            if state not in RESUMABLE:
                refuse("not_resumable", "run %s is %s; only a stopped, failed or lost run can be resumed"
                        % (run, state), state=state)
        chosen_slots, ids, busy, cleared = claim(workdir, guard, gpus, total, want)
        if chosen_slots is None:
            holders = sorted({(h.get("run"), h.get("pid"), h.get("unsupervised", False))
                              for h in busy.values()}, key=str)
            refuse("busy", "busy", busy={s: {"run": h.get("run"), "pid": h.get("pid")}
                                          for s, h in busy.items()},
                    holders=[{"run": r, "pid": p, "unsupervised": u} for r, p, u in holders], cleared=cleared)
        # The slots are held before anything starts: by this agent, then by the supervisor it
        # records, then by the trainer (runs/locks.py); a launch cut off at any point leaves either
        # a stale lock (nothing started) or one whose holder runs (docs/reliability.md).
        since, held = now_iso(), _launcher()
        hold_slots(guard, run, chosen_slots, held, since)
        fault("launch.claimed")

        def hold(pids):
            held.update(pids)
            hold_slots(guard, run, chosen_slots, held, since)

        attempts, done = [], False
        try:
            if prev is None:
                try:
                    os.mkdir(rundir)
                except FileExistsError:
                    fail("run %s already exists" % run)
            else:
                prev["previous_state"], attempts = end_attempt(rundir, prev)
            started, rec = _start_run(workdir, spec, run, rundir, release, release_path, commit,
                                      compile_policy, gpus, ids, chosen_slots,
                                      prev, attempts, hold)
            done = True
        except OSError as e:
            # Out of space or any other write failure: no half-made run folder stays behind
            # (a resumed run's folder is its own: it stays, its state read from its log).
            import shutil
            if prev is None:
                shutil.rmtree(rundir, ignore_errors=True)
            reason = "no_space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "io"
            refuse(reason, "cannot write the run folder %s: %s" % (rundir, e.strerror or e))
        finally:
            if not done:
                drop(guard, run)
        fault("launch.started")
        hold(started)
        fault("launch.held")
    emit({"ok": True, "run": run, "pid": started["pid"], "supervisor_pid": started["supervisor_pid"],
          "release": release, "commit": commit, "compile_policy": compile_policy,
          "gpus": gpus, "kind": rec["kind"], "output": rec["output"],
          "gpu_ids": ids, "slots": chosen_slots, "rundir": rundir, "log": os.path.join(rundir, LOG),
          "cleared": cleared, "command_line": rec["command_line"], "name": rec.get("name"),
          "attempt": rec["attempt"], "resumed_from": prev.get("previous_state") if prev else None,
          "unsupervised": started.get("unsupervised", False)})


def _launcher():
    """This agent as the first holder of a run's slots (runs/locks.py) and in its run.json, with the boot
    every process of the run is recorded under (runs/records.py boot)."""
    return {"launcher_pid": os.getpid(), "launcher_start": proc_start(os.getpid()), "boot": boot()}


def _start_run(workdir, spec, run, rundir, release, release_path, commit, compile_policy,
               gpus, ids, chosen_slots, prev=None, attempts=(), hold=None):
    """Write the run folder (log, config, run.json) and start its supervisor: (started, record).
    prev: the record of the run this attempt continues (the trainer then gets --resume and the
    run's own config file). hold(pids) records the supervisor in the slot locks before it may
    start anything. A spawn failure is recorded in exit.json and refused here."""
    # the log exists as soon as the run does, so `logs` right after launch reads an empty log
    open(os.path.join(rundir, LOG), "ab").close()
    place(spec.get("upload_dir"), rundir)      # the files sent with the launch (runs/upload.py)

    config = None
    if spec["config_text"] is not None:
        name = os.path.basename(spec["config_name"] or "config.yaml")
        config = os.path.join(rundir, name)
        with open(config, "w") as f:
            f.write(spec["config_text"])
    elif spec["config_file"]:
        config = spec["config_file"]
    python = sys.executable
    command, output = run_command(spec, rundir, gpus, compile_policy, config, prev is not None)
    argv = [python] + command
    nodes = spec["nodes"]
    env = dict(os.environ)
    env.update({"HOME": home_dir(), "PYTHONUNBUFFERED": "1",
                "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in ids),
                "DFLASH_OPS_WORKDIR": workdir, "DFLASH_OPS_RUN": run})
    env.update(spec.get("node_env") or {})
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    rec = {
        "run": run, "kind": spec["kind"], "output": output,
        "target": spec["target"], "workdir": workdir, "rundir": rundir,
        "release": release, "release_path": release_path, "commit": commit,
        "command": argv, "cwd": release_path,
        # the release `current` pointed at, so a deploy during the run changes nothing here
        "command_line": "cd %s && exec %s" % (shlex.quote(release_path),
                                             " ".join(shlex.quote(a) for a in argv)),
        "env": {k: env[k] for k in ("CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED", "HOME") + IFNAME_VARS if k in env},
        "config": prev.get("config") if prev is not None else
        {"file": config, "source": spec["config_source"],
         "text": spec["config_text"]} if config else None,
        "name": spec["name"], "attempt": len(attempts) + 1, "attempts": list(attempts),
        "first_started": (prev.get("first_started") or prev.get("started")) if prev else None,
        "compile_policy": compile_policy,
        "gpus": gpus, "gpu_ids": ids,
        "slots": chosen_slots, "topology": spec["topology"],
        "workers": spec["workers"], "extra_args": list(spec["extra"]),
        "started": now_iso(), "started_ts": time.time(), "python": python,
        "python_version": platform.python_version(), "hostname": socket.gethostname(),
        "controller": spec["controller"], "pid": None,
        "user_env": spec["user_env"],   # hosts.yaml env: + launch --env, secrets masked
        "nodes": nodes or None,     # {"targets": [...], "index": i, "endpoint", "address"}: a job over several nodes
    }
    rec.update(_launcher())         # the run is starting while this agent lives (runs/records.py run_state)
    write_json(os.path.join(rundir, "run.json"), rec)
    fault("launch.recorded")

    def hello(pids):                # before the supervisor starts anything, it is on record
        rec.update(pids)
        write_json(os.path.join(rundir, "run.json"), rec)
        hold(pids)

    started = spawn_supervisor(rundir, rec, env, hello)
    if "error" in started:
        now = run_record(rundir)
        if runs_trainer(now):
            # The supervisor died after the trainer started: the run runs, unsupervised; its slots
            # stay held by the trainer (its pid is in run.json) until it ends.
            return {"pid": now["pid"], "pid_start": now.get("pid_start"), "unsupervised": True,
                    "supervisor_pid": now.get("supervisor_pid"),
                    "supervisor_start": now.get("supervisor_start")}, rec
        # Recorded at once, so the run is not taken for one still starting.
        if not os.path.exists(os.path.join(rundir, "exit.json")):
            write_json(os.path.join(rundir, "exit.json"),
                       exit_record(rec, "failed", None, None, False, started["error"]))
        refuse("spawn", started["error"], run=run)
    return started, rec


# --- entry --------------------------------------------------------------------------------------

def _split(args, flags=(), options=()):
    """CMD WORKDIR [OPTIONS] -- [VALUES]: options only before `--`, every word after it a value
    (a run id), so a value is never read as an option whatever it looks like."""
    if "--" in args:
        i = args.index("--")
        head, values = args[:i], args[i + 1:]
    else:
        head, values = args, []
    found = {}
    while head:
        word = head.pop(0)
        if word in flags:
            found[word] = True
        elif word in options and head:
            found[word] = head.pop(0)
        else:
            fail("unexpected argument %r (values go after `--`)" % word, 2)
    return found, values


def main(argv):
    if len(argv) < 2:
        fail("usage: runs_agent launch|status|follow|stop|metrics|export|probe|rm|prune|bench|tensorboard "
             "WORKDIR [OPTIONS] -- [VALUE ...]", 2)
    cmd, workdir, args = argv[0], checked_workdir(argv[1]), list(argv[2:])
    try:
        if cmd == "launch":
            cmd_launch(workdir)
        elif cmd == "status":
            _, runs = _split(args)
            cmd_status(workdir, runs)
        elif cmd == "follow":
            opts, values = _split(args, ("--no-follow",), ("--tail", "--offset"))
            tail = opts.get("--tail")
            cmd_follow(workdir, values[0] if values else "latest", int(opts.get("--offset", 0)),
                       "--no-follow" not in opts, None if tail is None else int(tail))
        elif cmd == "stop":
            opts, values = _split(args, ("--force",), ("--timeout",))
            cmd_stop(workdir, values[0] if values else "latest", "--force" in opts,
                     float(opts.get("--timeout", STOP_TIMEOUT_S)))
        elif cmd == "supervise":      # supervisor._short_argv's exec: WORKDIR is the run's folder
            cmd_supervise(workdir, int(args[0]), int(args[1]))
        elif cmd == "metrics":
            _, values = _split(args)
            cmd_metrics(workdir, values[0] if values else "latest")
        elif cmd == "export":
            opts, values = _split(args, ("--running-ok", "--target-changed-ok"), ("--step", "--dtype"))
            step = opts.get("--step")
            cmd_export(workdir, values[0] if values else "latest",
                       None if step is None else int(step), opts.get("--dtype", "bfloat16"),
                       running_ok="--running-ok" in opts, target_changed_ok="--target-changed-ok" in opts)
        elif cmd == "bench":
            cmd_bench(workdir, *_split(args, BENCH_FLAGS, BENCH_OPTIONS))
        elif cmd == "rm":
            opts, values = _split(args, ("--dry-run",))
            cmd_rm(workdir, values, "--dry-run" in opts)
        elif cmd == "prune":
            opts, _ = _split(args, ("--dry-run",), ("--keep",))
            cmd_prune(workdir, int(opts.get("--keep", 0)), "--dry-run" in opts)
        elif cmd == "tensorboard":
            _, values = _split(args)
            cmd_tensorboard(workdir, values)
        elif cmd == "probe":
            opts, values = _split(args, ("--reuse",))
            cmd_probe(workdir, values, "--reuse" in opts)
        else:
            fail("unknown command %r" % cmd, 2)
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
