"""End to end: `python -m trainer` on the tiny target raises acceptance length clearly above the untrained drafter's.

The tiny task is learnable by construction: synthetic data is the tiny target's own greedy
continuations, which settle into repeated patterns a drafter can learn to draft from context.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--target", "tiny", "--data", "synthetic", "--steps", "200", "--lr", "5e-3", "--batch-size", "8",
       "--block-size", "8", "--anchors", "16", "--synthetic-samples", "768", "--synthetic-new-tokens", "64",
       "--draft-layers", "2", "--cpu-threads", "1", "--eval-prompts", "8", "--eval-new-tokens", "64",
       "--eval-at-start", "--log-every", "10", "--checkpoint-every", "100", "--adam-beta2", "0.95",
       # one eval mid-run, not auto's nine (each decodes every eval prompt): the run still stops to measure tau
       # and trains on
       "--eval-every", "100"]
STEP_KEYS = {"step", "loss", "accuracy", "acc_per_position", "lr", "grad_norm", "tokens_per_s", "samples_per_s"}


@pytest.mark.slow
def test_training_raises_acceptance_length(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("DFLASH_OPS_WORKDIR", None)
    p = subprocess.run([sys.executable, "-m", "trainer", *RUN, "--out", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.strip() == "", p.stderr[-3000:]  # nothing on stderr in a healthy run

    records = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == list(range(10, 201, 10))
    for r in steps:
        assert STEP_KEYS <= r.keys() and len(r["acc_per_position"]) == 7  # block positions 1..7
    before = next(r for r in records if r.get("event") == "eval" and r["step"] == 0)["acceptance_length"]
    assert [r["step"] for r in records if r.get("event") == "eval"] == [0, 100]     # the baseline, then mid-run
    done = [r for r in records if r.get("event") == "done"]
    assert len(done) == 1 and done[0]["step"] == 200
    after = done[0]["acceptance_length"]
    print(f"acceptance length: untrained {before:.3f}, trained {after:.3f}")
    assert before < 1.2  # an untrained drafter drafts nothing the target accepts
    assert after >= before + 0.4, (before, after)
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0
    # every line of the log is either a readable [trainer] line or one JSON object
    assert all(line.startswith(("[trainer] ", "{")) for line in p.stdout.splitlines())

    # python -m trainer.eval measures the same thing on the same held-out prompts
    e = subprocess.run([sys.executable, "-m", "trainer.eval", "--out", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert e.returncode == 0, e.stderr
    res = json.loads(e.stdout.strip().splitlines()[-1])
    assert res["step"] == 200 and res["acceptance_length"] == pytest.approx(after, abs=1e-6)

    from trainer.run.acceptance import main as eval_main

    import io
    import contextlib

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert eval_main(["--out", str(out), "--untrained"]) == 0
    assert json.loads(buf.getvalue())["acceptance_length"] == pytest.approx(before, abs=1e-6)
