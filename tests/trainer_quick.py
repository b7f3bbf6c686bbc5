"""Shared by the tests: a seconds-long `tiny` run and readers of what it wrote, the same run through
dflash-ops, and waiting for a condition."""
from __future__ import annotations

import json
import os
from pathlib import Path

from trainer import faults, procs
from trainer.exits import run

from trainer.train import train_entry

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--target", "tiny", "--data", "synthetic", "--batch-size", "4", "--block-size", "4", "--anchors", "4",
         "--synthetic-samples", "32", "--synthetic-prompt-len", "8", "--synthetic-new-tokens", "24",
         "--draft-layers", "1", "--cpu-threads", "1", "--eval-prompts", "2", "--eval-new-tokens", "8",
         "--checkpoint-every", "0", "--lr", "3e-3", "--seed", "5",
         "--adam-beta2", "0.95", "--steps", "200"]  # the pre-recipe beta2 and steps: later flags override


def train(out: Path, *extra: str) -> int:
    """`python -m trainer QUICK --out OUT EXTRA` in this process; its exit status."""
    return run(train_entry, [*QUICK, "--out", str(out), *extra])


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def step_losses(out: Path) -> dict[int, float]:
    """step -> loss, the later line winning (a resumed run supersedes lines after its checkpoint)."""
    return {m["step"]: m["loss"] for m in metrics(out) if "loss" in m and "event" not in m}


def subprocess_env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **extra)
    env.pop("DFLASH_OPS_WORKDIR", None)
    return env


def sigterm_once_training(cmd: list[str], *, after_step: int = 3, timeout: float = 60, stop=None):
    """Start `cmd` (a trainer), SIGTERM it once a step >= after_step is logged (or call `stop(proc)`
    then instead); returns (exit status, the rest of stdout, stderr). The process is killed if it
    outlives `timeout`."""
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # wait until it is really training
            if line.startswith("{") and json.loads(line).get("step", 0) >= after_step:
                break
        if stop is None:
            proc.send_signal(signal.SIGTERM)
        else:
            stop(proc)
        rest, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, rest, err


def children(pid: int) -> list[int]:
    """The pids of `pid`'s child processes (a launcher's torchrun ranks), ended ones included."""
    return [p for p, (parent, _) in procs.table().items() if parent == pid]


# ---- a trainer launched through dflash-ops (tests against the sshd + pct stand-in) ----------------

# `launch` flags for a run that only has to keep running while a test works beside it: after its first
# steps (its first checkpoint at checkpoint_every 2) it sleeps 0.2 s before each step (the trainer's
# step_pause fault point) instead of keeping a core busy that the test's own processes share.
IDLE_RUN = ["--env", "=".join(faults.setting(step_pause="4:0.2"))]
CLI_MAIN = "from orchestrator.cli import main; main()"   # `python -c CLI_MAIN -i INV ...` is dflash-ops
TINY_RUN = {"target": "tiny", "data": "synthetic", "synthetic_samples": 8, "synthetic_prompt_len": 4,
            "synthetic_new_tokens": 32, "batch_size": 2, "seq_len": 64, "anchors": 4, "draft_layers": 1,
            "eval_prompts": 1, "eval_new_tokens": 16, "cpu_threads": 1, "checkpoint_every": 0,
            "adam_beta2": 0.95, "steps": 200}


def tiny_run_config(**overrides) -> str:
    """A `--config` YAML for a seconds-long CPU run launched with `dflash-ops launch`."""
    return "".join(f"{k}: {v}\n" for k, v in {**TINY_RUN, **overrides}.items())


def copy_trainer(root: Path) -> Path:
    """Only the trainer package under root (what a run needs, quick to deploy); returns root."""
    import shutil

    shutil.copytree(ROOT / "trainer", root / "trainer", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return root


def gone(pid: int) -> bool:
    """The process has ended: no such process, or a zombie its parent has not reaped yet."""
    return procs.table().get(pid, (0, "Z"))[1] in ("Z", "X")


def wait_for(pred, timeout: float = 120, what: str = "condition", every: float = 0.05):
    """pred()'s first truthy value, polled every `every` s; AssertionError after `timeout` s."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")

