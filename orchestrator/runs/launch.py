"""Launching a run on one target, controller side: the launch spec, its checks, the agent call
and the reply (several nodes: nodes.py; status and metrics: status.py; `logs`: follow.py).

Library functions: they return data, never print or exit. Everything that
happens on the target is done by the runs agent (remote/runs/, sent as one program), run
with the target's python in one round trip per call; the run records live on the target
(WORKDIR/runs/RUN/), so any controller can pick a run up later.
"""
from __future__ import annotations

import getpass
import hashlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field, fields

from orchestrator.ssh import agent_call
from orchestrator.envvars import user_env
from orchestrator.errors import OpsError, StepFailed, UsageError
from orchestrator.inventory import Inventory, Target
from orchestrator.remote.runs.kinds import KINDS, trainer_flags   # stdlib only, shared with the runs agent
from orchestrator.remote.runs.spec import normalize     # the launch spec declared once, shared likewise
from orchestrator.runs.options import LaunchOptions
from orchestrator.ssh.session import Session


class LaunchRefused(OpsError):
    """launch said no: nothing deployed, not enough free GPUs, no probe result (exit 1)."""


# The runs agent's refusals of a request the target can never meet (GPUs it does not have): bad
# input, exit 2, as the same request refused here before connecting (check_gpus).
IMPOSSIBLE = ("too_many_gpus", "bad_gpu_ids")


# --- pure helpers (unit-tested) -----------------------------------------------------------------

def new_run_id(target: str, now: float | None = None) -> str:
    """UTC time + a short hash: sorts by start time, unique across controllers."""
    now = time.time() if now is None else now
    salt = f"{target}:{now!r}:{os.getpid()}:{os.urandom(8).hex()}"
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + "-" + \
        hashlib.sha256(salt.encode()).hexdigest()[:6]


def check_gpu_ids(opts: LaunchOptions, target: Target) -> None:
    """`--gpu-ids 0,3` names GPUs the target has (hosts.yaml `gpus:`)."""
    if opts.gpu_ids is not None and any(not 0 <= i < target.gpus for i in opts.gpu_ids):
        have = f"0..{target.gpus - 1}" if target.gpus else "none (gpus: 0)"
        ids = ",".join(map(str, opts.gpu_ids))
        raise UsageError(f"--gpu-ids {ids}: {target.name} has GPUs {have} (hosts.yaml `gpus:`)")


def check_gpus(opts: LaunchOptions, target: Target) -> int | None:
    """The GPUs the launch asks of `target` (None: a resumed run's own), checked against what it
    has: more GPUs than it has, or a GPU id it does not have, is an impossible request, bad input
    (UsageError, exit 2), wherever it is asked (launch, regen, a playbook's launch step)."""
    check_gpu_ids(opts, target)
    gpus = (None if opts.resume is not None else target.gpus) if opts.gpus is None else opts.gpus
    if gpus is not None and gpus > target.gpus:
        raise UsageError(f"{target.name}: --gpus {gpus} is more than the target's "
                         f"{target.gpus} GPU(s) (hosts.yaml `gpus:`)")
    return gpus


def refusal_message(target: Target, doc: dict) -> str:
    """The one line a refused launch prints, with what to do about it."""
    t, reason = target.name, doc.get("reason")
    if reason == "no_release":
        return f"{t}: no release deployed in {target.workdir}; run `dflash-ops deploy {t}` first"
    if reason == "no_probe":
        return (f"{t}: --compile-policy auto needs the probe's choice and {target.workdir}/probe.json does "
                f"not exist; run `dflash-ops probe {t}` first (or pass --compile-policy NAME)")
    if reason == "no_torch":
        if target.is_local:
            return f"{t}: {doc.get('python')} has no torch; install the trainer's side with `pip install -e '.[train]'`"
        return (f"{t}: {doc.get('python')} (hosts.yaml `python:`) has no torch; install it with "
                f"`dflash-ops play playbooks/bootstrap.yaml {t} --var torch=WHEEL|INDEX_URL|torch==VERSION`")
    if reason == "has_gpus":
        n = doc.get("gpus")
        return (f"{t}: the container has {n} GPU(s) but hosts.yaml gives {t} none (`gpus:` is 0 when omitted), "
                f"so the run would train on the CPU; set `gpus: {n}` under targets.{t} in hosts.yaml, or pass "
                f"--gpus 0 to train on the CPU")
    if reason in ("too_many_gpus", "no_space", "io", "bad_gpu_ids", "network", "one_node", "bad_kind"):
        return f"{t}: {doc.get('message')}"
    if reason == "not_found":
        return f"{t}: {doc.get('message')} (see `dflash-ops status {t}`)"
    if reason == "not_resumable":
        if doc.get("state") == "running":
            return f"{t}: {doc.get('message')}; it is still going (`dflash-ops logs {t}` follows it)"
        return f"{t}: {doc.get('message')}"
    if reason == "busy":
        holders = doc.get("holders") or []
        # a bench-decode's agent holds its slot as `bench-PID` (remote/runs/bench.py) until it ends
        who = ", ".join(f"a bench-decode (pid {h['pid']})" if str(h["run"]).startswith("bench-") else
                        f"run {h['run']} (pid {h['pid']}" + (", no supervisor: it holds them until it ends)"
                                                             if h.get("unsupervised") else ")")
                        for h in holders) or "another run"
        run_ids = [h["run"] for h in holders if not str(h["run"]).startswith("bench-")] or ["RUN"]
        busy = sorted(doc.get("busy") or {})
        if busy == ["cpu"]:
            what = "the CPU slot is"
        else:
            what = "GPU(s) " + ", ".join(s[3:] for s in busy) + " are"
        if holders and all(str(h["run"]).startswith("bench-") for h in holders):
            return (f"{t}: {what} in use by {who}; wait for it to end, or end it with "
                    f"`dflash-ops stop {t} {holders[0]['run']}`")
        return (f"{t}: {what} in use by {who}; free them with `dflash-ops stop {t} {run_ids[0]}` "
                f"or wait for it to end")
    return f"{t}: launch failed: {doc.get('message')}"


# --- launch -------------------------------------------------------------------------------------

@dataclass
class LaunchResult:
    target: str
    run: str
    pid: int
    supervisor_pid: int | None = None
    release: str | None = None
    commit: str | None = None
    compile_policy: str | None = None   # as asked (auto: the trainer resolves it; status shows its choice)
    gpus: int = 0
    gpu_ids: list[int] = field(default_factory=list)
    slots: list[str] = field(default_factory=list)
    log: str | None = None
    command_line: str | None = None
    kind: str = "train"                 # train | regen (LaunchOptions.kind; remote/runs/kinds.py)
    output: str | None = None           # regen: the JSONL it writes on the target
    cleared: list[dict] = field(default_factory=list)
    name: str | None = None
    attempt: int = 1
    resumed_from: str | None = None     # the state of the attempt this one continues
    seconds: float = 0.0
    env: dict = field(default_factory=dict)     # the variables set for the trainer, secrets masked
    unsupervised: bool = False      # its supervisor died as it started: no exit status will be recorded
    cut_off: str | None = None      # the launch's agent was cut off and the run was then found running

    def as_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_reply(cls, target: str, doc: dict, **own) -> "LaunchResult":
        """The runs agent's launch reply (remote/runs/runs_agent.py _launch; a run's status record after a
        cut-off) read once: each field from the key of its name, an absent or null key its default;
        `own` holds what the controller knows itself (the time it took, the variables it set). The
        keys that are no field (ok, rundir) are not read."""
        missing = [k for k in ("run", "pid") if doc.get(k) is None]
        if missing:
            raise OpsError(f"{target}: the runs agent's launch reply has no {', '.join(missing)}: {doc}")
        values = {f.name: doc[f.name] for f in fields(cls)
                  if f.name not in own and f.name != "target" and doc.get(f.name) is not None}
        return cls(target=target, **values, **own)


@dataclass
class LaunchSpec:
    """What launch_on sends: `doc`, the runs agent's launch spec (ONE JSON document on its stdin,
    recorded in run.json; its `user_env` masked), and `env`, the caller's variables unmasked, which
    only travel in the launch command (EnvTransport) and are never sent as data or recorded."""
    doc: dict
    env: dict[str, str] | None = None


def launch_spec(inv: Inventory, target: Target, opts: LaunchOptions, run: str | None = None,
                nnodes: int = 1) -> LaunchSpec:
    """The runs agent's launch spec of `opts` on `target` (run: the job's id, else a new one; nnodes:
    the job's nodes), with the checks that need the target (UsageError) and the
    trainer's own check of its flags and config (UsageError)."""
    gpus = check_gpus(opts, target)
    kind = KINDS[opts.kind]
    if nnodes > 1 and not kind["nodes"]:     # its program takes no rendezvous flags
        raise UsageError(f"a {opts.kind} run runs on one target; name one, not {nnodes}")
    env = dict(opts.env) or None
    spec = normalize({**opts.doc(), "run": run or new_run_id(target.name), "target": target.name, "gpus": gpus,
                      "target_gpus": target.gpus, "controller": _controller(),
                      "user_env": user_env(inv, target, env),   # recorded in run.json, secrets masked
                      # CPU only because nobody said how many GPUs: the runs agent refuses it on a target with GPUs
                      "cpu_by_default": opts.gpus is None and opts.resume is None and not gpus})
    if opts.resume is None and kind["checked"]:    # regen's flags are trainer.regen's, checked there
        check_trainer_config(spec, nnodes)
    return LaunchSpec(spec, env)


def check_trainer_config(spec: dict, nnodes: int = 1) -> None:
    """The trainer's own config rules (trainer/run/config.py, torch-free) applied here to the flags
    and YAML the runs agent will give it (built by the agent's own trainer_flags), so a typo is
    exit 2 before anything starts, not a failed run. What needs the target (its files,
    --flex-tiles) is still checked by the trainer there."""
    from trainer.controller_view import UsageError as TrainerUsage, check_before_launch

    # The config's text is checked as text (the agent's --config names its copy on the target); a
    # job's rendezvous values are placeholders of the right form (nodes.launch adds the real ones).
    nodes = {"targets": ["node"] * nnodes, "index": 0, "endpoint": "node:1", "address": "node"} if nnodes > 1 else None
    argv = trainer_flags(dict(spec, nodes=nodes), spec["gpus"] or 0, spec["compile_policy"])
    try:
        check_before_launch(argv, spec.get("config_text"), spec.get("config_name") or "config")
    except TrainerUsage as e:
        said = str(e) if str(e).startswith(f"{spec.get('config_name')}:") else f"the trainer would refuse: {e}"
        raise UsageError(f"{said}; nothing was launched") from None


def launch_on(s: Session, target: Target, launch: LaunchSpec) -> LaunchResult:
    """Send one launch spec to the target's runs agent; what it started."""
    spec = launch.doc
    start = time.monotonic()
    sent = sum(f["size"] for f in spec.get("files") or [])
    try:
        doc = agent_call.call(s.transport(target, env=launch.env), target, agent_call.RUNS, ["launch", target.workdir],
                         stdin=_launch_stdin(spec), what="launch the trainer",
                         timeout=120 + sent / UPLOAD_FLOOR_BPS)
    except agent_call.Refused as e:
        if e.reason == "spawn":
            raise StepFailed(target.name, "launch the trainer", 1, e.doc.get("message", "")) from None
        if e.reason in IMPOSSIBLE:
            raise UsageError(refusal_message(target, e.doc)) from None
        raise LaunchRefused(refusal_message(target, e.doc)) from None
    except StepFailed as e:
        # The agent was cut off (killed, the connection dropped): its exit status says nothing of
        # the run, which may run or may never have started. Ask the target.
        doc = _after_cut_off(s, target, spec, e)
    own = {"seconds": round(time.monotonic() - start, 3), "env": spec["user_env"]}
    if doc.get("gpus") is None:
        own["gpus"] = spec["gpus"] or 0
    return LaunchResult.from_reply(target.name, doc, **own)


def _after_cut_off(s: Session, target: Target, spec: dict, cut: StepFailed) -> dict:
    """What a launch whose agent was cut off left on the target: the run's status as a launch
    reply when it runs; otherwise the cut itself, saying that nothing runs (the launch sequence
    on the target is crash-safe: docs/reliability.md)."""
    run = spec["run"]
    try:
        found = agent_call.call(s.transport(target), target, agent_call.RUNS, ["status", target.workdir, "--", run],
                           what="read the run", timeout=60)["runs"]
    except OpsError:
        raise cut from None
    if found and found[0]["state"] == "running" and found[0].get("pid"):
        return {**found[0], "compile_policy": found[0].get("compile_policy") or "?",
                "cut_off": f"the agent ended with status {cut.exit_code_remote}"}
    if found and found[0]["state"] == "running":
        said = f"run {run} is still being started there (see `dflash-ops status {target.name} {run}`)"
    else:
        said = f"run {run} did not start; its slots are free" if found else "nothing was started"
    raise StepFailed(target.name, "launch the trainer", cut.exit_code_remote,
                     f"the launch was cut off ({cut.stderr_tail.strip() or 'no message'}); {said}") from None


def _controller() -> dict:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        user = None
    try:
        from importlib.metadata import version
        ver = version("dflash-ops")
    except Exception:  # noqa: BLE001
        ver = None
    return {"user": user, "host": socket.gethostname(), "dflash_ops": ver}


UPLOAD_FLOOR_BPS = 1 << 20     # a launch's uploads get this long on top of its 120 s: a slow link's pace


def _launch_stdin(spec: dict):
    """The launch spec as one JSON line (its files without their local paths), then each file's bytes."""
    files = spec.get("files") or []
    head = dict(spec, files=[{k: v for k, v in f.items() if k != "path"} for f in files]) if files else spec
    yield json.dumps(head).encode() + b"\n"
    for f in files:
        with open(f["path"], "rb") as src:
            yield from iter(lambda: src.read(1 << 20), b"")


__all__ = ["launch_spec", "launch_on", "LaunchSpec", "LaunchResult", "LaunchRefused", "new_run_id",
           "check_gpu_ids", "check_gpus", "refusal_message", "IMPOSSIBLE"]
