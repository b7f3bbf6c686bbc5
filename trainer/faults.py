"""Faults that tests inject into the trainer: named points in product code, inert unless enabled.

Product code calls `faults.hit(NAME, ...)` (or asks `faults.enabled(NAME)`); nothing happens unless
a test has enabled NAME, through one environment variable (so the fault reaches `python -m trainer`
subprocesses and torchrun ranks):

    env = {**os.environ, **faults.env(fail_worker="1:hang")}    # DFLASH_TRAINER_FAULTS=fail_worker=1:hang
    monkeypatch.setenv(*faults.setting(diverge="1:2"))

The points (NAME=VALUE):
  fail_worker=I           worker/rank I raises in its warm-up (its first step); I:hang: it hangs there
  diverge=I:STEP          worker/rank I nudges one weight after update STEP (replicas then disagree)
  pause_in_checkpoint=STEP:FLAGFILE
                          while writing checkpoint STEP, after model.safetensors is in the temporary
                          folder, the writer creates FLAGFILE and sleeps (a test kills it mid-write)
  regen_batch=K           regen raises before it answers batch K; K:hang: it hangs there
  specdec_differ=I        specdec's reference decode of prompt I gets its last token changed (not lossless)
  step_pause=AFTER:S      after step AFTER, the training loop sleeps S seconds before each step (a test's run
                          that only has to keep running leaves the cores to the test's other processes)
  test_policies=1         the test-only compile policies are known (trainer/policies.py)
  probe_beat_s=S          the probe's heartbeat every S seconds, not every 10 (a test sees one however fast
                          its cases run)
  export_mask_shift=1     the export writes the next token's id as the mask token's (a broken pipeline for the gate)

Torch-free at import (the config and the policy names import it).
"""
from __future__ import annotations

import os
import time

ENV = "DFLASH_TRAINER_FAULTS"
POINTS = ("fail_worker", "diverge", "pause_in_checkpoint", "test_policies", "regen_batch", "specdec_differ",
          "step_pause", "export_mask_shift", "export_corrupt", "probe_beat_s")


def _check(points: dict[str, str]) -> None:
    unknown = [n for n in points if n not in POINTS]
    if unknown:
        raise ValueError(f"unknown fault point(s) {', '.join(unknown)}; known: {', '.join(POINTS)}")


def env(**points: str) -> dict[str, str]:
    """The environment that enables `points` in a trainer process and everything it starts."""
    _check(points)
    return {ENV: ",".join(f"{n}={v}" for n, v in points.items())}


def setting(**points: str) -> tuple[str, str]:
    """(ENV, value) enabling `points`, for monkeypatch.setenv."""
    ((name, value),) = env(**points).items()
    return name, value


def value(name: str) -> str | None:
    """NAME's value where a test enabled it, else None (ENV is read at each call)."""
    for item in os.environ.get(ENV, "").split(","):
        n, sep, v = item.partition("=")
        if sep and n == name:
            return v
    return None


def enabled(name: str) -> bool:
    return value(name) is not None


def hit(name: str, **where) -> None:
    """Fault point NAME, reached with what it needs to know (`where`): does nothing unless enabled."""
    v = value(name)
    if v is None:
        return
    if name in ("fail_worker", "regen_batch"):     # I or I:hang, I a worker's index or a regen batch
        who, _, how = v.partition(":")
        if who == str(where["index"]):
            if how == "hang":
                time.sleep(3600)
            what = f"worker {who} fails during warm-up" if name == "fail_worker" else f"regen fails at batch {who}"
            raise RuntimeError(f"test hook {name}={v}: {what}")
    elif name == "diverge":
        who, _, at = v.partition(":")
        if who == str(where["index"]) and at == str(where["step"]):
            import torch

            with torch.no_grad():
                where["params"][0].view(-1)[0] += 1e-3
    elif name == "step_pause":
        after, _, seconds = v.partition(":")
        if where["step"] > int(after):
            time.sleep(float(seconds))
    elif name == "pause_in_checkpoint":
        at, _, flag = v.partition(":")
        if flag and at == str(where["step"]):
            with open(flag, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)
    else:
        raise ValueError(f"fault point {name} is a switch: ask faults.enabled({name!r})")
