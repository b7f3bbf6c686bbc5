"""The pipeline gate (trainer/gate.py) on the tiny target: a working pipeline passes with every round
accepting the whole block, by both engines and the reference; a pipeline broken between training and
decoding (the export writing another token's id as the mask token) and one that does not learn each fail at
their stage, named, exit 1."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import faults
from trainer_quick import ROOT, subprocess_env

TRAIN = ["--block-size", "4", "--draft-layers", "1", "--anchors", "8", "--lr", "3e-3", "--cpu-threads", "1",
         "--adam-beta2", "0.95"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("gate") / "data.jsonl"
    with path.open("w") as f:
        for _ in range(3):
            ids = [rng.randrange(3, 250) for _ in range(32)]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 8 + [1] * 24}) + "\n")
    return path


def gate(data: Path, out: Path, *extra: str, env: dict | None = None, steps: int = 60):
    r = subprocess.run([sys.executable, "-m", "trainer.gate", "--target", "tiny", "--data", str(data), "--steps",
                        str(steps), "--new-tokens", "24", "--gpus", "0", "--out", str(out), "--", *TRAIN, *extra],
                       cwd=ROOT, env=subprocess_env(**(env or {})), capture_output=True, text=True, timeout=300)
    doc = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None
    return r, doc


def test_a_working_pipeline_passes_with_the_whole_block_accepted_by_every_decoder(data, tmp_path):
    """Here on a row longer than the run's --seq-len, which keeps the end of its prompt and passes. Cut by
    --seq-len, the row's last tokens would never be trained and their drafts rejected: a sound pipeline
    would fail. The prompt gives up its first tokens instead, and says so. (A row that fits is neither cut
    nor said to be: the next test's run.)"""
    r, doc = gate(data, tmp_path / "g", "--seq-len", "30")
    assert r.returncode == 0 and doc["passed"], r.stderr[-2000:]
    assert doc["row_tokens"] == {"prompt": 6, "continuation": 24}
    assert "[gate] row: its prompt keeps its last 6 of 8 tokens, so that prompt and continuation fit --seq-len 30" \
        in r.stderr
    d = doc["decode"]
    assert d["decoders"] == ["eager", "graphs", "reference"]
    assert all(n == 4 for n in d["rounds"][:-1]) and d["tau"] > 3.5
    assert doc["train"]["last_loss"] < doc["train"]["first_loss"] / 10
    stages = [line.split(":")[0] for line in r.stderr.splitlines() if line.startswith("[gate] ")]
    assert stages == ["[gate] row"] * 2 + ["[gate] train"] * 2 + ["[gate] export", "[gate] decode", "[gate] PASSED"]
    assert "PASSED: every round accepted the whole block of 4" in r.stderr


def test_an_export_with_the_wrong_mask_token_fails_at_decode(data, tmp_path):
    r, doc = gate(data, tmp_path / "g", env=faults.env(export_mask_shift="1"))
    assert r.returncode == 1 and not doc["passed"] and doc["failed"] == "decode", r.stderr[-2000:]
    assert "FAILED at decode:" in r.stderr and "Traceback" not in r.stderr
    assert doc["train"]["last_loss"] < doc["train"]["first_loss"] / 10     # training itself looked fine
    # the row fits the run's --seq-len: its whole prompt is trained on and decoded, nothing said of a cut
    assert doc["row_tokens"] == {"prompt": 8, "continuation": 24}
    stages = [line.split(":")[0] for line in r.stderr.splitlines() if line.startswith("[gate] ")]
    assert stages[:5] == ["[gate] row", "[gate] train", "[gate] train", "[gate] export", "[gate] decode"]


def test_a_run_that_does_not_learn_fails_at_train_and_bad_input_is_one_line(data, tmp_path):
    r, doc = gate(data, tmp_path / "g", "--lr", "1e-9", "--min-lr", "0", steps=20)
    assert r.returncode == 1 and doc["failed"] == "train" and "the loss did not fall on one row" in doc["error"]
    r = subprocess.run([sys.executable, "-m", "trainer.gate", "--target", "tiny", "--data", str(data), "--row", "9"],
                       cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().endswith("--row 9: " + str(data) + " has 3 row(s)"), r.stderr
    assert r.stderr.count("\n") == 1
