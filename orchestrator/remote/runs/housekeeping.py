"""Runs agent: run housekeeping. A run continued in place (`launch` with "resume" in its spec),
and the removal of ended runs (`rm`, `prune`). Standard library only, Python >= 3.8, no
`from __future__` line (runs/records.py says why).

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

A run whose run.json or exit.json cannot be used (runs/records.py, `unreadable`) is removed by `rm`
(state `unreadable`, its "reason" added) unless a live process holds a slot in its name; `prune`,
which cannot tell whether it ended, keeps it and names it in "unreadable": [{"run", "reason"}].
"""
import os
import shutil

from ..agent_base import emit, refuse
from .records import LOST, UNREADABLE, find, resolve, run_ids, run_record, run_state, runs_dir_of, sweep_dead  # noqa: E501
from .kinds import kind_of
from .spec import normalize
from .locks import Guard, holds_slots

RESUMABLE = ("stopped", "failed", LOST)


def resume_spec(workdir, spec):
    """The launch spec of an attempt that continues run spec["resume"] with the run's own
    settings (config, trainer arguments, topology, policy); spec may choose the GPUs and a name.
    (spec, the run's record); the not-found refusal when there is no such run."""
    rid = find(workdir, spec["resume"])
    state, ex = run_state(os.path.join(runs_dir_of(workdir), rid))
    if state == UNREADABLE:     # nothing to continue from: its settings are in the file that cannot be read
        refuse("not_resumable", "run %s is unreadable (%s); it cannot be resumed" % (rid, ex["reason"]),
               state=state)
    rec = run_record(os.path.join(runs_dir_of(workdir), rid))
    # spec is normalized (every key there); what the run's record lacks is left out, and normalize below
    # fills in its one default (runs/spec.py)
    new = {"run": rid, "resume": rid, "kind": rec.get("kind"), "target": spec["target"],
           "gpus": rec.get("gpus") if spec["gpus"] is None else spec["gpus"],
           "gpu_ids": spec["gpu_ids"], "target_gpus": spec["target_gpus"],
           "topology": rec.get("topology"), "compile_policy": rec.get("compile_policy"),
           "workers": rec.get("workers"), "extra": list(rec.get("extra_args") or []),
           "config_file": (rec.get("config") or {}).get("file"),
           "name": spec["name"] or rec.get("name"), "controller": spec["controller"],
           "nodes": spec["nodes"], "user_env": spec["user_env"]}
    new = {k: v for k, v in new.items() if v is not None and v != ""}
    was = list((rec.get("nodes") or {}).get("targets") or [])     # a job over several nodes: all of them
    now = list((spec["nodes"] or {}).get("targets") or [])
    if was != now:
        refuse("not_resumable", "run %s ran on %s; resume it on the same target(s), in the same order"
               % (rid, ",".join(was) or rec.get("target") or "one target"),
               targets=was or [rec.get("target")])
    try:
        return normalize(new), rec
    except ValueError as e:     # a run.json whose settings are not a launch's (SpecError)
        refuse("not_resumable", "run %s: its recorded settings cannot be launched again (%s)" % (rid, e),
               state=state)


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
        rec = run_record(rundir)
        state, ex = run_state(rundir, rec)
        if state == UNREADABLE and holds_slots(workdir, rid):   # its records say nothing; its slots do
            state, rec = "running", {}
        if state == "running":
            reply["refused"].append({"run": rid, "state": state, "name": rec.get("name")})
            continue
        size = _size(rundir)
        if not dry_run:
            gone = os.path.join(runs_dir_of(workdir), ".rm-%s-%d" % (rid, os.getpid()))
            os.rename(rundir, gone)
            shutil.rmtree(gone, ignore_errors=True)
        removed = {"run": rid, "state": state, "name": rec.get("name") if state != UNREADABLE else None,
                   "bytes": size}
        if state == UNREADABLE:
            removed["reason"] = ex["reason"]
        reply["removed"].append(removed)
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
    return kind_of(run_record(os.path.join(runs_dir_of(workdir), rid)))["pruned"]


def cmd_prune(workdir, keep, dry_run):
    reply = {"removed": [], "refused": [], "missing": [], "freed": 0, "dry_run": dry_run,
             "kept": [], "unreadable": []}
    with Guard(workdir):
        sweep_dead(runs_dir_of(workdir), ".rm-")     # removals cut short (an agent killed -9 mid-rmtree)
        ids = run_ids(workdir)                      # oldest first
        for rid in ids:                             # not known to have ended: kept, named
            state, ex = run_state(os.path.join(runs_dir_of(workdir), rid))
            if state == UNREADABLE:
                reply["unreadable"].append({"run": rid, "reason": ex["reason"]})
        unreadable = [r["run"] for r in reply["unreadable"]]
        data = [r for r in ids if r not in unreadable and not _pruned(workdir, r)]   # e.g. regen's rows
        ids = [r for r in ids if r not in data and r not in unreadable]
        old, reply["kept"] = (ids[:-keep], ids[-keep:]) if keep > 0 else (ids, [])
        _remove(workdir, old, dry_run, reply)
    # a running run among the old ones is kept, not an error
    reply["kept"] = [r["run"] for r in reply["refused"]] + data + unreadable + reply["kept"]
    reply["refused"] = []
    emit(reply)
