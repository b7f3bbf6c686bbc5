"""What to launch: the options of `launch`, a playbook's launch step and a launch over several
nodes, built and checked once (`LaunchOptions.build`) and passed on as one frozen value.

The checks that need a target (GPU indexes in range, no more GPUs than it has) are made per
target by runs.launch_spec; everything else is checked here, before anything connects.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from trainer.controller_view import AUTO, POLICY_CHOICES, TOPOLOGIES   # names only (torch-free)

from orchestrator.errors import FileError, UsageError
from orchestrator.remote.runs.spec import DEFAULT_TOPOLOGY   # the launch spec's default (stdlib only)
from orchestrator.inventory import yamlnodes

POLICIES = POLICY_CHOICES     # auto: the probe's choice, resolved by the trainer on the target
RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")   # what the runs agent accepts as a run id
BENCH_ID_RE = re.compile(r"^bench-\d+$")     # a running bench-decode, as status lists it (remote/runs/locks.py)
LABEL_RE = re.compile(r"^[^\x00-\x1f\x7f]{1,64}$")            # launch --name: one printable line
# A config travels in the launch spec and is kept in run.json, which the runs agent reads up to 1 MB
# (remote/agent_base.MAX_RECORD_BYTES): a config is a few KB.
MAX_CONFIG_BYTES = 256 << 10


def check_run(run: str) -> str:
    """A run id as typed (or `latest`); anything else, an option after `--` included, is bad input."""
    if run != "latest" and not RUN_NAME_RE.match(run):
        raise UsageError(f"{run!r} is not a run id (they look like 20250101-120000-3fa9c1; "
                         f"see `dflash-ops status`)")
    return run


def _gpu_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise UsageError(f"--gpu-ids {text}: expected GPU indexes like 0,3") from None
    if len(set(ids)) != len(ids):
        raise UsageError(f"--gpu-ids {text}: a GPU is named twice")
    return ids


@dataclass(frozen=True)
class LaunchOptions:
    """A launch's options, each checked (build). gpus None: all of the target's (a resumed run:
    its own); gpu_ids: exactly these GPUs; config: the YAML file's
    text, name and absolute path; extra: the trainer's arguments; env: variables for the
    trainer, over the inventory's `env:` (they travel in the launch command, never as data).
    kind: what the run runs, `train` (`python -m trainer`) or `regen` (`python -m trainer.regen`,
    built by runs/regen.py); uploads: files sent with the launch into the run's folder (upload())."""
    gpus: int | None = None
    gpu_ids: tuple[int, ...] | None = None
    topology: str = DEFAULT_TOPOLOGY
    compile_policy: str = AUTO
    workers: int | None = None
    extra: tuple[str, ...] = ()
    name: str | None = None
    resume: str | None = None
    config_text: str | None = None
    config_name: str | None = None
    config_source: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    kind: str = "train"
    uploads: tuple[dict, ...] = ()

    @classmethod
    def build(cls, *, gpus: int | None = None, gpu_ids: str | None = None, config: str | None = None,
              topology: str | None = None, compile_policy: str | None = None, workers: int | None = None,
              extra: Sequence[str] = (), name: str | None = None, resume: str | None = None,
              env: Mapping[str, str] | None = None) -> "LaunchOptions":
        """The options checked (UsageError, exit 2); the config file read."""
        topology = topology or DEFAULT_TOPOLOGY
        compile_policy = compile_policy or AUTO
        if name is not None and not LABEL_RE.match(name):
            raise UsageError(f"--name {name!r}: one line of at most 64 printable characters")
        if compile_policy not in POLICIES:     # play's launch step (the CLI's Choice refused it before)
            raise UsageError(f"--compile-policy {compile_policy}: not a policy (choose from {', '.join(POLICIES)})")
        if topology not in TOPOLOGIES:
            raise UsageError(f"--topology must be one of {', '.join(TOPOLOGIES)}")
        if gpus is not None and gpus < 0:
            raise UsageError("--gpus must be >= 0")
        if workers is not None and workers < 1:
            raise UsageError("--workers must be >= 1")
        ids = _gpu_ids(gpu_ids) if gpu_ids is not None else None
        if ids is not None:
            if gpus is not None and gpus != len(ids):
                raise UsageError(f"--gpus {gpus} and --gpu-ids {gpu_ids} disagree; give one of them")
            gpus = len(ids)
        if resume is not None:
            check_run(resume)
            if config or extra or workers is not None:
                raise UsageError("--resume continues the run with its own config and trainer arguments; "
                                 "drop --config, --workers and the arguments after `--`")
        for i, arg in enumerate(extra, 1):
            try:
                arg.encode("utf-8")
            except UnicodeEncodeError:   # bytes the shell passed that are not UTF-8 (surrogate-escaped)
                raise UsageError(f"trainer argument {i} is not UTF-8 text: {arg!r}") from None
        text = cname = source = None
        if config:
            path = Path(config).expanduser()
            try:        # a regular file (a FIFO is not waited on), bounded, UTF-8: hosts.yaml's rules
                text = yamlnodes.decode(yamlnodes.read_bytes(path, MAX_CONFIG_BYTES, f"larger than "
                                                             f"{MAX_CONFIG_BYTES >> 10} KB; a trainer config is a "
                                                             f"few KB"), str(path))
            except FileError as e:
                raise UsageError(f"--config {e}") from None
            cname, source = path.name, str(path.resolve())
        return cls(gpus=gpus, gpu_ids=ids, topology=topology, compile_policy=compile_policy,
                   workers=workers, extra=tuple(extra), name=name, resume=resume, config_text=text,
                   config_name=cname, config_source=source, env=dict(env or {}))

    def doc(self) -> dict:
        """The options as the runs agent's launch spec names them (env and the config's absence left out)."""
        doc: dict[str, Any] = {"gpus": self.gpus, "topology": self.topology, "compile_policy": self.compile_policy,
               "workers": self.workers,
               "extra": list(self.extra), "name": self.name,
               "gpu_ids": list(self.gpu_ids) if self.gpu_ids is not None else None, "resume": self.resume,
               "kind": self.kind}
        if self.uploads:
            doc["files"] = [dict(u) for u in self.uploads]
        if self.config_text is not None:
            doc.update(config_text=self.config_text, config_name=self.config_name,
                       config_source=self.config_source)
        return doc


def upload(name: str, path: str) -> dict:
    """A file a launch sends into the run's folder as NAME: {"name", "path", "size", "sha256"} (the
    runs agent checks size and hash; the local path stays here); UsageError when it cannot be read."""
    h, size = hashlib.sha256(), 0
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
                size += len(chunk)
    except OSError as e:
        raise UsageError(f"{path}: cannot read: {e.strerror or e}") from None
    return {"name": name, "path": path, "size": size, "sha256": h.hexdigest()}


__all__ = ["LaunchOptions", "upload", "AUTO", "DEFAULT_TOPOLOGY", "POLICIES", "TOPOLOGIES", "check_run", "RUN_NAME_RE",
           "BENCH_ID_RE", "LABEL_RE"]
