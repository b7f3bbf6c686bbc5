"""Runs agent: run housekeeping. A run continued in place (`launch` with "resume" in its spec),
and the removal of ended runs (`rm`, `prune`). Standard library only, Python >= 3.8, no
`from __future__` line (runs/common.py says why).

    rm WORKDIR [--dry-run] -- RUN...
                              remove those runs' folders (log, checkpoints, records); a running
                              run is refused, never touched
    prune WORKDIR --keep N [--dry-run]
                              remove every ended run but the newest N (running runs stay, and
                              regen runs: their rows are data; `rm` removes one)

Both reply {"removed": [{"run", "state", "name", "bytes"}], "refused": [{"run", "state"}],
"missing": [RUN...], "freed": BYTES, "dry_run": bool}. They hold the slot guard (runs/locks.py)
while they judge and remove, so a `launch --resume` of the same run waits for them, and a run is
renamed to runs/.rm-RUN-PID before its files go: a half-removed run is never listed.
"""
import os
import shutil

from ..common import emit, read_json, refuse
from .common import find, resolve, run_ids, run_state, runs_dir_of, sweep_dead
from .kinds import kind_of
from .locks import Guard

RESUMABLE = ("stopped", "failed")


def resume_spec(workdir, spec):
    """The launch spec of an attempt that continues run spec["resume"] with the run's own
    settings (config, trainer arguments, topology, policy); spec may choose the GPUs and a name.
    (spec, the run's record); the not-found refusal when there is no such run."""
    rid = find(workdir, spec["resume"])
    rec = read_json(os.path.join(runs_dir_of(workdir), rid, "run.json")) or {}
    new = {"run": rid, "resume": rid, "kind": rec.get("kind") or "train", "target": spec.get("target"),
           "gpus": rec.get("gpus", 0) if spec.get("gpus") is None else spec["gpus"],
           "gpu_ids": spec.get("gpu_ids"), "target_gpus": spec.get("target_gpus", 0),
           "topology": rec.get("topology") or "threads", "compile_policy": rec.get("compile_policy") or "auto",
           "workers": rec.get("workers"), "extra": list(rec.get("extra_args") or []),
           "config_file": (rec.get("config") or {}).get("file"),
           "name": spec.get("name") or rec.get("name"), "controller": spec.get("controller"),
           "nodes": spec.get("nodes"), "user_env": spec.get("user_env")}
    was = list((rec.get("nodes") or {}).get("targets") or [])     # a job over several nodes: all of them
    now = list((spec.get("nodes") or {}).get("targets") or [])
    if was != now:
        refuse("not_resumable", "run %s ran on %s; resume it on the same target(s), in the same order"
               % (rid, ",".join(was) or rec.get("target") or "one target"),
               targets=was or [rec.get("target")])
    return new, rec


def end_attempt(rundir, rec):
    """Close the run's last attempt before the next one starts: (its summary, all attempts so
    far). Its end records go, so the run reads as starting again."""
    state, ex = run_state(rundir, rec)
    done = list(rec.get("attempts") or [])
    done.append({"attempt": rec.get("attempt") or 1, "started": rec.get("started"),
                 "release": rec.get("release"), "gpu_ids": rec.get("gpu_ids"), "state": state,
                 "exit": ex})
    for name in ("exit.json", "stop.json", "supervisor.failed", "pid"):
        try:
            os.unlink(os.path.join(rundir, name))
        except FileNotFoundError:
            pass
    return state, done


def _size(path):
    """Bytes the folder's files take (apparent sizes; hard links counted once)."""
    total, seen = 0, set()
    for root, dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _remove(workdir, rids, dry_run, reply):
    for rid in rids:
        rundir = os.path.join(runs_dir_of(workdir), rid)
        rec = read_json(os.path.join(rundir, "run.json")) or {}
        state, _ = run_state(rundir, rec)
        if state == "running":
            reply["refused"].append({"run": rid, "state": state, "name": rec.get("name")})
            continue
        size = _size(rundir)
        if not dry_run:
            gone = os.path.join(runs_dir_of(workdir), ".rm-%s-%d" % (rid, os.getpid()))
            os.rename(rundir, gone)
            shutil.rmtree(gone, ignore_errors=True)
        reply["removed"].append({"run": rid, "state": state, "name": rec.get("name"), "bytes": size})
        reply["freed"] += size


def cmd_rm(workdir, runs, dry_run):
    reply = {"removed": [], "refused": [], "missing": [], "freed": 0, "dry_run": dry_run}
    with Guard(workdir):
        sweep_dead(runs_dir_of(workdir), ".rm-")     # removals cut short (an agent killed -9 mid-rmtree)
        rids = []
        for run in runs:
            rid = resolve(workdir, run)
            if rid is None:
                reply["missing"].append(run)
            elif rid not in rids:
                rids.append(rid)
        _remove(workdir, rids, dry_run, reply)
    emit(reply)


def _pruned(workdir, rid):
    """Whether `prune` may remove the run, by its kind (runs/kinds.py)."""
    return kind_of(read_json(os.path.join(runs_dir_of(workdir), rid, "run.json")) or {})["pruned"]


def cmd_prune(workdir, keep, dry_run):
    reply = {"removed": [], "refused": [], "missing": [], "freed": 0, "dry_run": dry_run,
             "kept": []}
    with Guard(workdir):
        sweep_dead(runs_dir_of(workdir), ".rm-")     # removals cut short (an agent killed -9 mid-rmtree)
        ids = run_ids(workdir)                      # oldest first
        data = [r for r in ids if not _pruned(workdir, r)]   # e.g. regen's rows, which training runs read
        ids = [r for r in ids if r not in data]
        old, reply["kept"] = (ids[:-keep], ids[-keep:]) if keep > 0 else (ids, [])
        _remove(workdir, old, dry_run, reply)
    # a running run among the old ones is kept, not an error
    reply["kept"] = [r["run"] for r in reply["refused"]] + data + reply["kept"]
    reply["refused"] = []
    emit(reply)
