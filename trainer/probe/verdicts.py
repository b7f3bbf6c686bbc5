"""The probe's verdict cache: a case's result kept on the target, reused by the next probe that would
run the same case on the same software and hardware.

A verdict is keyed by everything that decides it: the torch build (version and git commit), CUDA
and the driver, the GPU models, the hash of the trainer's own source (the case runs the trainer's
replica and engines), the device, the case (policy, topology, workers or ranks), the timed steps.
Any of them changed, the key is another one and the case runs again; `--fresh` runs every case and
overwrites what was kept.

Where it lives: `$DFLASH_PROBE_CACHE` when set, else WORKDIR/probe-cache. The default is per target
(the target's workdir): containers of one node do not see each other's workdirs. Containers that
share a folder (a bind mount from the node) can share verdicts by pointing DFLASH_PROBE_CACHE at it
(the target's `env:`); the key already holds everything that differs between them.

Not kept: timeouts (a loaded machine, not the build, may be the cause), skipped cases, and a case
the probe was stopped during. Files are written whole (temp + rename), one per key.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from trainer.files import atomic_file

ENV = "DFLASH_PROBE_CACHE"
KEPT = ("ok", "wrong", "failed", "crashed")


def cache_dir(workdir: str | None) -> Path | None:
    where = os.environ.get(ENV) or (os.path.join(workdir, "probe-cache") if workdir else None)
    return Path(where) if where else None


def source_hash(root: Path | None = None) -> str:
    """sha256 over the trainer package's .py and .yaml files (paths and bytes), in path order."""
    root = root or Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def base_key(build: dict, device: str, steps: int) -> dict:
    """What every case of this probe shares: the software and hardware the verdict depends on."""
    return {"torch": build.get("torch"), "torch_git": build.get("torch_git"), "cuda": build.get("cuda"),
            "driver": build.get("driver"), "gpus": [g.get("name") for g in build.get("gpus") or []],
            "trainer": source_hash(), "device": device, "steps": steps}


def _file(folder: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return folder / f"{digest}.json"


def case_key(base: dict, policy: str, topology: str, n: int) -> dict:
    return dict(base, policy=policy, topology=topology, n=n)


def load(folder: Path | None, key: dict) -> dict | None:
    """The kept case record for `key` (with "reused": the time it was made), or None."""
    if folder is None:
        return None
    try:
        kept = json.loads(_file(folder, key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("key") != key or not isinstance(kept.get("case"), dict):
        return None
    return dict(kept["case"], reused=kept.get("time"))


def store(folder: Path | None, key: dict, case: dict, when: str) -> None:
    if folder is None or case.get("outcome") not in KEPT:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_file(str(_file(folder, key))) as f:
            json.dump({"key": key, "time": when, "case": case}, f, indent=1)
    except OSError:
        pass   # a cache that cannot be written costs the next probe its time, not this one its result
