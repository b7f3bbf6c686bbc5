"""Runs agent: the `bench` command. Standard library only, Python >= 3.8, no `from __future__`
line (runs/common.py says why).

    bench WORKDIR [--step N] [--max-new-tokens N] [--limit N] [--running-ok] [--prompts-stdin] -- RUN

Decoding with a run's trained drafter against the target alone, measured here: the drafter is
exported (float32, as `export` takes RUN: default the newest succeeded training run) into a private
temporary folder WORKDIR/exports/.tmp-PID, then `python -m trainer.specdec` of the live release
runs on it against the run's own --target. Its live lines (stderr) pass through to this agent's
stderr as they come; the reply (the last stdout line) is

    {"ok": true, "run", "step", "running", "prompts_source": "upload"|"held-out", "prompts", "result"}

with specdec's document as "result". The prompts: with --prompts-stdin, the file the controller sends
on stdin (checked there as trainer.regen reads it); else the run's held-out rows, the ones its
trainer held out for its eval (trainer/run/data.py split_eval: the last `eval_prompts` rows of its
`--data`, when there are at least twice as many), each cut before its first assistant turn. The
temporary folder is removed whatever happens (export's sweep takes one left by SIGKILL).
Refusals: export's (not_found, no_drafter, running, no_release, export), "no_prompts" (synthetic
data, or nothing held out, and no upload), "not_lossless" and "bench" (specdec failed; its last
line and "exit_code").
"""
import json
import os
import re
import shutil
import subprocess
import sys

from ..common import _out, _read_json, refuse
from .common import LOG, _run_ids, _runs_dir, _state
from .export import _export_into, _private_tmp, _run_to_export

PROMPTS = "prompts.jsonl"
BENCH_FLAGS = ("--running-ok", "--prompts-stdin")
BENCH_OPTIONS = ("--step", "--max-new-tokens", "--limit")


def _held_out(rid, rundir, dest):
    """Write the run's held-out prompts (chat rows cut before the first assistant turn) to dest: how many."""
    cfg = _read_json(os.path.join(rundir, "trainer-config.json")) or {}
    rec = _read_json(os.path.join(rundir, "run.json")) or {}
    data, n = cfg.get("data"), int(cfg.get("eval_prompts") or 0)
    why = None
    if not data or data == "synthetic":
        why = "it trained on synthetic data"
    elif n <= 0:
        why = "it held out no rows (eval_prompts 0)"
    if why is None:
        path = os.path.join(rec.get("cwd") or rundir, os.path.expanduser(data))
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
            m = re.search(rb"rows for training, (\d+) skipped", f.read())
    except OSError:
        return 0
    return int(m.group(1)) if m else 0


def _busy(workdir):
    """Runs running on this target now: their GPUs and CPU time are not the measurement's alone."""
    return [r for r in _run_ids(workdir) if _state(os.path.join(_runs_dir(workdir), r))[0] == "running"]


def _specdec(rid, cfg, folder, prompts, tmp, max_new_tokens, limit, current):
    """`python -m trainer.specdec` with its stderr passed through line by line: its document."""
    result = os.path.join(tmp, "result.json")
    argv = [sys.executable, "-m", "trainer.specdec", "--target", str(cfg.get("target")), "--drafter", folder,
            "--prompts", prompts, "--max-new-tokens", str(max_new_tokens), "--json", result]
    if limit is not None:
        argv += ["--limit", str(limit)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(argv, cwd=os.path.realpath(current), env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    last = "(no message)"
    try:
        for line in iter(proc.stderr.readline, b""):
            sys.stderr.buffer.write(line)
            sys.stderr.flush()
            last = line.decode("utf-8", "replace").strip() or last
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        for head in ("specdec: error: ", "trainer: error: "):
            last = last[len(head):] if last.startswith(head) else last
        refuse("not_lossless" if "NOT lossless" in last else "bench", last, found=True, run=rid,
               exit_code=proc.returncode)
    with open(result) as f:
        return json.load(f)


def cmd_bench(workdir, opts, values):
    """opts: BENCH_FLAGS and BENCH_OPTIONS as the agent's _split found them; values: [RUN]."""
    step, limit = opts.get("--step"), opts.get("--limit")
    step, limit = None if step is None else int(step), None if limit is None else int(limit)
    max_new_tokens, running_ok = int(opts.get("--max-new-tokens", 128)), "--running-ok" in opts
    upload = sys.stdin.buffer.read() if "--prompts-stdin" in opts else None
    rid, rundir = _run_to_export(workdir, values[0] if values else "latest", running_ok)
    current = os.path.join(workdir, "current")
    if not os.path.isfile(os.path.join(current, "trainer", "specdec.py")):
        refuse("no_release", "the live release in %s has no trainer/specdec.py" % workdir, found=True, run=rid)
    cfg = _read_json(os.path.join(rundir, "trainer-config.json")) or {}
    tmp = _private_tmp(workdir)
    try:
        os.mkdir(tmp)
        prompts = os.path.join(tmp, PROMPTS)
        if upload is not None:
            with open(prompts, "wb") as f:
                f.write(upload)
            n, skipped = None, 0
        else:
            n, skipped = _held_out(rid, rundir, prompts), _skipped(rundir)
        notes = []      # said on stderr now, and kept in the reply (the controller's --json shows no stderr)
        if skipped:
            notes.append("the trainer skipped %d rows of its data: the last %d rows taken here may not be "
                         "exactly those it held out" % (skipped, n))
        busy = _busy(workdir)
        if busy:
            notes.append("run %s is running here too: the timings share the machine with it" % ", ".join(busy))
        for note in notes:
            sys.stderr.write("agent: %s\n" % note)
        sys.stderr.flush()
        folder = os.path.join(tmp, "draft")
        info = _export_into(workdir, rid, rundir, folder, "float32", step, running_ok)
        doc = _specdec(rid, cfg, folder, prompts, tmp, max_new_tokens, limit, current)
        _out({"ok": True, "found": True, "run": rid, "step": info.get("step"), "running": info.get("running"),
              "prompts_source": "upload" if n is None else "held-out", "held_out": n, "notes": notes,
              "result": doc})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
