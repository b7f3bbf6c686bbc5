"""Runs agent: the kinds of run, one entry each, and the command a launch starts.

A run's kind (the launch spec's and run.json's "kind", "train" when absent) says which program it
runs and how the other verbs treat it; a new kind is one entry of KINDS:

    module      the program, `python -m MODULE` in the live release
    argv        (spec, rundir, gpus, policy, config, resume) -> the program's flags before the
                user's arguments (spec["extra"], last, so that theirs win)
    policy      takes a compile policy (and so, for `auto`, needs the probe's result)
    nodes       may run as one job over several nodes (the torchrun rendezvous flags)
    checked     its flags and YAML config are the trainer's, checked on the controller by the
                trainer's own rules (trainer/run/flags.check_before_launch) with trainer_flags
    drafter     leaves a drafter (what `export` takes; its newest succeeded run is `latest` there)
    pruned      `prune` may remove it (a regen run's rows are data training runs read: `rm` only)
    inputs      files the launch uploads into the run's folder, by name: exactly these (runs/upload.py)
    output      the file it writes in its folder (run.json "output"), or None
    ended       the log's last line once it ends, succeeded / not, for a kind with an output:
                a format with {output}, {target} and {run}

This part imports no other part, so the controller imports it as is (orchestrator/runs/launch.py
checks the trainer's flags with the argv the agent starts it with; orchestrator/runs/regen.py
uploads the prompts under the name read here). Standard library only, Python >= 3.8, no
`from __future__` line (runs/records.py says why).
"""
import os

REGEN_PROMPTS = "prompts.jsonl"     # regen's input in the run's folder (the controller's upload)
REGEN_OUT = "regen.jsonl"           # what it writes there: the trainer's --data
GATE_OUT = "gate.json"              # a gate run's verdict in its folder (trainer.gate --json)


def trainer_flags(spec, gpus, policy, config=None, resume=False):
    """The flags `python -m trainer` gets from a launch spec (normalized: runs/spec.py), the user's
    arguments (spec["extra"]) last: the run's GPUs, topology, policy, workers, config file, --resume,
    and the rendezvous of a job over several nodes (spec["nodes"]: targets, index, endpoint, address)."""
    argv = ["--gpus", str(gpus), "--topology", spec["topology"], "--compile-policy", policy]
    if spec["workers"] is not None:
        argv += ["--workers", str(spec["workers"])]
    if config:
        argv += ["--config", config]
    if resume:
        argv += ["--resume"]        # the trainer continues from the last checkpoint in --out
    nodes = spec["nodes"]
    if nodes:                       # one node of a job over several: torchrun's c10d rendezvous
        argv += ["--nnodes", str(len(nodes["targets"])), "--rdzv-endpoint", nodes["endpoint"],
                 "--rdzv-id", spec["run"], "--node-address", nodes["address"]]
        if nodes["index"] == 0:
            argv += ["--rdzv-host"]
    return argv + list(spec["extra"])


def _train_argv(spec, rundir, gpus, policy, config, resume):
    return ["--out", rundir] + trainer_flags(spec, gpus, policy, config, resume)


def _regen_argv(spec, rundir, gpus, policy, config, resume):
    # it resumes by itself from an output that exists: no --resume
    return (["--prompts", os.path.join(rundir, REGEN_PROMPTS), "--out", os.path.join(rundir, REGEN_OUT),
             "--gpus", str(gpus)] + list(spec["extra"]))


def _gate_argv(spec, rundir, gpus, policy, config, resume):
    # the run's config, policy and trainer arguments, on one device of the run's (the gate trains one
    # row on one device); its row, run and export in RUNDIR/gate, its verdict in RUNDIR/gate.json
    argv = ["--out", os.path.join(rundir, "gate"), "--json", os.path.join(rundir, GATE_OUT),
            "--gpus", str(min(gpus, 1))]
    if config:
        argv += ["--config", config]
    return argv + ["--", "--compile-policy", policy] + list(spec["extra"])


KINDS = {
    "train": {"module": "trainer", "argv": _train_argv, "policy": True, "nodes": True, "checked": True,
              "drafter": True, "pruned": True, "inputs": (), "output": None, "ended": None},
    "regen": {"module": "trainer.regen", "argv": _regen_argv, "policy": False, "nodes": False, "checked": False,
              "drafter": False, "pruned": False, "inputs": (REGEN_PROMPTS,), "output": REGEN_OUT,
              "ended": ("the rows are in {output}; train on them with `dflash-ops launch {target} -- --data {output}`",
                        "the rows so far are in {output}; `dflash-ops launch {target} --resume {run}` continues "
                        "from there")},
    "gate": {"module": "trainer.gate", "argv": _gate_argv, "policy": True, "nodes": False, "checked": False,
             "drafter": False, "pruned": True, "inputs": (), "output": GATE_OUT, "ended": None},
}
# A kind this agent does not know (a run.json written by a newer controller): nothing is assumed of
# it; it is kept by prune and never exported.
_UNKNOWN = {"module": None, "argv": None, "policy": False, "nodes": False, "checked": False, "drafter": False,
            "pruned": False, "inputs": (), "output": None, "ended": None}


def kind_of(doc):
    """The KINDS entry of a launch spec or run record (its "kind", "train" when absent)."""
    return KINDS.get(doc.get("kind") or "train", _UNKNOWN)


def run_command(spec, rundir, gpus, policy, config, resume):
    """(argv after the python, the output file or None) of the run's kind."""
    kind = kind_of(spec)
    argv = ["-m", kind["module"]] + kind["argv"](spec, rundir, gpus, policy, config, resume)
    return argv, os.path.join(rundir, kind["output"]) if kind["output"] else None
