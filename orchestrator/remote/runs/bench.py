"""Runs agent: the `bench` command. Standard library only, Python >= 3.8, no `from __future__`
line (runs/records.py says why).

    bench WORKDIR [--step N] [--max-new-tokens N] [--limit N] [--gpus N] [--gpu ID] [--running-ok]
          [--target-changed-ok] [--prompts-bytes N] -- RUN

Decoding with a run's trained drafter against the target alone, measured here: the drafter is
exported (float32, as `export` takes RUN: default the newest succeeded training run) into a private
temporary folder WORKDIR/exports/.tmp-PID, then `python -m trainer.specdec` of the live release
runs on it against the run's own --target, both from the run's own cwd (its relative --target and
--data are relative to it) with its launch-time variables (run.json "user_env") and the run's
--chat-template-kwargs. For the whole measurement this agent holds one free slot as a launch does
(runs/locks.py): a GPU of the target's `--gpus N` (exactly `--gpu ID` when named; never the benched
run's own, which holds its slots while it runs), or the one `cpu` slot of a CPU-only target, and
export and specdec see only that GPU; none free is the refusal "busy" (exit_code 1) naming the
holders. Its lock (runs/locks.py, as the "run" bench-PID) is the measurement's record: `status` shows
it while this agent lives, `stop bench-PID` signals this agent. Its live lines (stderr) pass through
to this agent's stderr as they come; the reply (the last stdout line) is

    {"ok": true, "run", "step", "running", "prompts_source": "upload"|"held-out", "prompts", "result"}

with specdec's document as "result". The prompts: with --prompts-bytes N, the file of N bytes the
controller sends first on stdin (checked there as trainer.regen reads it); else the run's held-out rows,
the ones its trainer held out for its eval (trainer/run/data.py split_eval: the last `eval_prompts` rows
of its `--data`, when there are at least twice as many), each cut before its first assistant turn.

It lives only as long as its controller. The controller holds stdin open until the reply is in, so
EOF there means it is gone (killed, timed out, its connection dropped: sshd closes the command's
pipes): a thread waiting for that EOF hangs this agent up (SIGHUP to its main thread). SIGHUP,
SIGTERM (`stop`) and SIGINT end it the same way: the worker (export, specdec: a session of its own,
export.run_child) is killed with its process group, the slot released, the temporary folder removed,
later signals ignored until that is done; then SIGHUP exits 129 unheard, SIGTERM and SIGINT refuse
"stopped" (exit_code 128 + N). Killed with SIGKILL, it leaves a lock whose holder is dead (free to the
next claim) and a folder the next bench's or export's sweep removes; its worker dies with it
(PR_SET_PDEATHSIG). Refusals: export's (not_found, no_drafter, running, no_release, export),
"no_prompts" (synthetic data, or nothing held out, and no upload), "bad_gpu" (--gpu not one of the
target's), "busy", "stopped", "not_lossless" and "bench" (specdec failed: its last line, or "specdec
killed by signal N (NAME)", and "exit_code", 128 + N for a signal).
"""
import json
import os
import re
import shutil
import signal
import sys
import time

from ..agent_base import emit, now_iso, read_json, refuse
from .records import LOG, proc_start, run_ids, run_state, runs_dir_of
from .export import export_into, hang_up_on_eof, private_tmp, program, run_child, run_cwd, run_env, run_to_export
from .locks import BENCH, Guard, HOLDERS, claim, hold_slots, release_slots

PROMPTS = "prompts.jsonl"
BENCH_FLAGS = ("--running-ok", "--target-changed-ok")
BENCH_OPTIONS = ("--step", "--max-new-tokens", "--limit", "--gpus", "--gpu", "--engine", "--dtype", "--prompts-bytes")
ENDING = (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
ENGINES, DTYPES = ("graphs", "eager"), ("auto", "float32", "bfloat16")   # specdec's --engine, --dtype
LOG_HEAD = 4 << 20      # the trainer says how many rows it skipped near its log's start


def _held_out(rid, cfg, dest, cwd):
    """Write the held-out prompts of run `rid` (chat rows cut before the first assistant turn) to dest:
    how many. cfg: its trainer-config.json; cwd: the trainer's, against which a relative --data was
    read. The same rows as the trainer's split_eval (a test holds the two equal): the last
    eval_prompts rows, when there are twice as many."""
    data, n = cfg.get("data"), int(cfg.get("eval_prompts") or 0)
    why = None
    if not data or data == "synthetic":
        why = "it trained on synthetic data"
    elif n <= 0:
        why = "it held out no rows (eval_prompts 0)"
    if why is None:
        path = os.path.join(cwd, os.path.expanduser(data))
        try:
            with open(path, "rb") as f:
                rows = [line for line in f.read().splitlines() if line.strip()]
        except OSError as e:
            refuse("no_prompts", "cannot read its data %s: %s; pass --prompts" % (path, e.strerror or e),
                   found=True, run=rid, exit_code=2)
        if len(rows) < 2 * n:
            why = "its %d rows were too few to hold %d out" % (len(rows), n)
    if why is not None:
        refuse("no_prompts", "%s; pass --prompts FILE" % why, found=True, run=rid, exit_code=2)
    out = []
    for line in rows[-n:]:
        try:
            row = json.loads(line.decode("utf-8"))
        except ValueError:
            row = None
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(msgs, list):
            refuse("no_prompts", "its data %s has rows that are not chat rows (token ids?); pass --prompts FILE"
                   % data, found=True, run=rid, exit_code=2)
        cut = next((i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "assistant"),
                   len(msgs))
        out.append(json.dumps({"messages": msgs[:cut]}) + "\n")
    with open(dest, "w") as f:
        f.writelines(out)
    return n


def _skipped(rundir):
    """Rows the trainer skipped (no room for a block): the held-out rows may then be other ones."""
    try:
        with open(os.path.join(rundir, LOG), "rb") as f:
            m = re.search(rb"rows for training, (\d+) skipped", f.read(LOG_HEAD))
    except OSError:
        return 0
    return int(m.group(1)) if m else 0


def _busy(workdir, rid):
    """Other runs running on this target now: their GPUs and CPU time are not the measurement's alone."""
    return [r for r in run_ids(workdir)
            if r != rid and run_state(os.path.join(runs_dir_of(workdir), r))[0] == "running"]


def _claim_slot(workdir, rid, total, gpu=None):
    """Hold one free slot for this agent (runs/locks.py): a GPU of the target's `total` (exactly
    `gpu` when named), or `cpu` where it has none. (the lock's name, CUDA_VISIBLE_DEVICES)."""
    if gpu is not None and not 0 <= gpu < total:
        refuse("bad_gpu", "--gpu %d: the target's GPUs are %s" % (gpu, "0..%d" % (total - 1) if total else "none"),
               found=True, run=rid, exit_code=2)
    name, started = BENCH + str(os.getpid()), proc_start(os.getpid())
    me = {"kind": "bench-decode", "since_ts": time.time()}
    for pid, start in HOLDERS:     # this agent is each of a run's holders: held while it lives
        me.update({pid: os.getpid(), start: started})
    with Guard(workdir) as guard:
        slots, ids, busy, _ = claim(workdir, guard, 1 if total else 0, total, None if gpu is None else [gpu])
        if slots is None:
            held = ", ".join("%s by run %s (pid %s)" % ("the CPU slot" if s == "cpu" else "GPU " + s[3:],
                                                         h.get("run"), h.get("pid")) for s, h in sorted(busy.items()))
            refuse("busy", "no free %s to measure on: %s" % ("GPU" if total else "CPU slot", held), found=True, run=rid,
                   busy={s: {"run": h.get("run"), "pid": h.get("pid")} for s, h in busy.items()}, exit_code=1)
        hold_slots(guard, name, slots, dict(me, bench=rid), now_iso())
    return name, ",".join(map(str, ids))


def _specdec(workdir, rid, cfg, rec, folder, prompts, tmp, max_new_tokens, limit, cuda_visible, engine="graphs",
             dtype="auto"):
    """`python -m trainer.specdec` with its stderr passed through line by line: its document."""
    result = os.path.join(tmp, "result.json")
    argv = program(workdir, "trainer.specdec") + [
        "--target", str(cfg.get("target")), "--drafter", folder, "--prompts", prompts,
        "--max-new-tokens", str(max_new_tokens), "--json", result, "--engine", engine, "--dtype", dtype]
    if limit is not None:
        argv += ["--limit", str(limit)]
    kwargs = cfg.get("chat_template_kwargs")
    if kwargs is not None:          # how its trainer rendered the chat rows (a YAML mapping kept as JSON)
        argv += ["--chat-template-kwargs", kwargs if isinstance(kwargs, str) else json.dumps(kwargs)]
    run_child(rid, "specdec", argv, run_cwd(workdir, rec), run_env(rec, os.environ, cuda_visible), echo=True,
              reason=lambda last: "not_lossless" if "NOT lossless" in last else "bench")
    with open(result) as f:
        return json.load(f)


class _Ended(BaseException):
    """A signal of ENDING turned into an exception in the main thread, so the finally blocks run."""

    def __init__(self, signum):
        BaseException.__init__(self, signum)
        self.signum = signum


def _end(signum, frame):
    for sig in ENDING:      # the first one ends the measurement; its cleanup is not cut short by another
        signal.signal(sig, signal.SIG_IGN)
    raise _Ended(signum)


def _read_prompts(n):
    """The n bytes of the prompts file on stdin; a controller gone before the last of them: exit 129."""
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            os._exit(128 + signal.SIGHUP)
        data += chunk
    return data


def cmd_bench(workdir, opts, values):
    """opts: BENCH_FLAGS and BENCH_OPTIONS as the agent's _split found them; values: [RUN]."""
    step, limit, gpu = (None if opts.get(k) is None else int(opts[k]) for k in ("--step", "--limit", "--gpu"))
    max_new_tokens, running_ok = int(opts.get("--max-new-tokens", 128)), "--running-ok" in opts
    engine, dtype = opts.get("--engine", "graphs"), opts.get("--dtype", "auto")
    if engine not in ENGINES or dtype not in DTYPES:
        refuse("bench", "--engine must be one of %s and --dtype one of %s" % ("|".join(ENGINES), "|".join(DTYPES)),
               exit_code=2)
    for sig in ENDING:
        signal.signal(sig, _end)
    try:
        upload = _read_prompts(int(opts["--prompts-bytes"])) if "--prompts-bytes" in opts else None
        hang_up_on_eof()    # after the prompts: nothing more comes before EOF
        _measure(workdir, values[0] if values else "latest", upload, step, limit, gpu, max_new_tokens, running_ok,
                 "--target-changed-ok" in opts, int(opts.get("--gpus", 0)), engine, dtype)
    except _Ended as e:
        if e.signum == signal.SIGHUP:       # the controller is gone: nobody to read a reply
            os._exit(128 + e.signum)
        name = signal.Signals(e.signum).name
        refuse("stopped", "ended by %s on the target (`dflash-ops stop`, or the container shutting down); nothing "
               "measured" % name, found=True, run=values[0] if values else "latest", exit_code=128 + e.signum)


def _measure(workdir, run, upload, step, limit, gpu, max_new_tokens, running_ok, target_changed_ok, gpus, engine,
             dtype):
    """The measurement, its reply written; whatever ends it, the slot and the temporary folder go."""
    rid, rundir, rec = run_to_export(workdir, run, running_ok)
    current = os.path.join(workdir, "current")
    if not os.path.isfile(os.path.join(current, "trainer", "specdec.py")):
        refuse("no_release", "the live release in %s has no trainer/specdec.py" % workdir, found=True, run=rid)
    cfg = read_json(os.path.join(rundir, "trainer-config.json")) or {}
    tmp, claimed = private_tmp(workdir), False
    for sig in ENDING:          # private_tmp set export's handlers: this agent's are these
        signal.signal(sig, _end)
    try:
        os.mkdir(tmp)
        prompts = os.path.join(tmp, PROMPTS)
        if upload is not None:
            with open(prompts, "wb") as f:
                f.write(upload)
            n, skipped = None, 0
        else:
            n, skipped = _held_out(rid, cfg, prompts, run_cwd(workdir, rec)), _skipped(rundir)
        claimed = True      # from here the slot may be written: the finally releases it whatever ends this
        _, cuda_visible = _claim_slot(workdir, rid, gpus, gpu)
        notes = []      # said on stderr now, and kept in the reply (the controller's --json shows no stderr)
        if skipped:
            notes.append("the trainer skipped %d rows of its data: the last %d rows taken here may not be "
                         "exactly those it held out" % (skipped, n))
        busy = _busy(workdir, rid)
        if busy:
            notes.append("run %s is running here too: the timings share the machine with it" % ", ".join(busy))
        for note in notes:
            sys.stderr.write("bench-decode: %s\n" % note)
        sys.stderr.flush()
        folder = os.path.join(tmp, "draft")
        info = export_into(workdir, rid, rundir, rec, folder, "float32", step, running_ok, target_changed_ok,
                           cuda_visible)
        doc = _specdec(workdir, rid, cfg, rec, folder, prompts, tmp, max_new_tokens, limit, cuda_visible, engine, dtype)
        emit({"ok": True, "found": True, "run": rid, "step": info.get("step"), "running": info.get("running"),
              "prompts_source": "upload" if n is None else "held-out", "held_out": n, "notes": notes,
              "gpu": cuda_visible or None, "result": doc})
    finally:
        for sig in ENDING:      # ending now whatever comes: a signal would cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        if claimed:
            release_slots(workdir, BENCH + str(os.getpid()))
        shutil.rmtree(tmp, ignore_errors=True)
