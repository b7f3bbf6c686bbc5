"""`dflash-ops launch --gate` for real: the pipeline gate (trainer/gate.py) run as a run of kind `gate`
in a pct stand-in container behind a real sshd on 127.0.0.1, with the real run's config and trainer
arguments; the run is launched only after the gate passed. A drafter whose export is damaged (a test's
fault cuts its weights file in half, passed with `--env` as a user's variable would be) fails the gate at
`export`, named in one line, exit 1, and no training run is started."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_quick import CLI_MAIN, tiny_run_config

from orchestrator.errors import UsageError
from orchestrator.inventory import Target
from orchestrator.runs.gate import gate_options, verdict_of
from orchestrator.runs.options import LaunchOptions
from trainer import faults

RUN = tiny_run_config(block_size=4, steps=6, eval_new_tokens=8)


@pytest.fixture
def ct(fakepct, deployed_ct200, tmp_path):
    """CT 200 (CPU only) with the trainer deployed; cli(*args) is dflash-ops against it."""
    path = deployed_ct200()
    cfg = tmp_path / "run.yaml"
    cfg.write_text(RUN)

    def cli(*args, timeout=300):
        return subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", str(path), *map(str, args)],
                              capture_output=True, text=True, timeout=timeout, cwd=tmp_path)

    runs = fakepct.private(200) / "dflash" / "runs"
    return type("CT", (), dict(cli=staticmethod(cli), cfg=cfg, runs=runs))


def records(runs: Path) -> dict[str, dict]:
    return {p.name: json.loads((p / "run.json").read_text()) for p in runs.iterdir() if (p / "run.json").is_file()}


def test_the_gate_passes_then_the_run_starts_with_the_same_config(ct):
    r = ct.cli("launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", ct.cfg, "--gate")
    assert r.returncode == 0, r.stderr[-3000:]
    run = r.stdout.strip()
    recs = records(ct.runs)
    gate_run, = (k for k, v in recs.items() if v.get("kind") == "gate")
    assert set(recs) == {gate_run, run} and recs[run].get("kind", "train") == "train"
    assert gate_run < run                                   # the gate ran first (run ids sort by start)
    # the gate trained with the run's own config (its copy in the gate's run folder) and passed on its row
    verdict = json.loads((ct.runs / gate_run / "gate.json").read_text())
    assert verdict["passed"] and verdict["decode"]["block_size"] == 4
    assert all(n == 4 for n in verdict["decode"]["rounds"][:-1])
    assert verdict["target"] == "tiny" and verdict["data"] == "synthetic"
    assert f"gate run {gate_run}:" in r.stderr and "[gate] PASSED" in r.stderr
    assert f"the gate (run {gate_run}) passed: tau 3.92 = the block size 4" in r.stderr
    assert f"launched run {run}" in r.stderr and '{"target"' not in r.stderr     # its verdict is said, not dumped
    # and the run it let through trains to its end
    logs = ct.cli("logs", "ct200", run)
    assert logs.returncode == 0, logs.stderr[-2000:]
    table = ct.cli("status", "ct200").stdout.splitlines()
    assert table[0].split()[-3:] == ["ELAPSED", "STEPS/S", "ETA"]       # the pace: a running run's only
    row, = (line for line in table if line.startswith(run))
    assert row.split()[-2:] == ["-", "-"] and " succeeded " in row


def test_a_damaged_export_fails_the_gate_at_export_and_nothing_is_launched(ct):
    (name, value), = faults.env(export_corrupt="1").items()
    r = ct.cli("launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", ct.cfg, "--gate",
               "--env", f"{name}={value}", "--json")
    assert r.returncode == 1, r.stderr[-3000:]
    doc = json.loads(r.stdout)                              # --json: one document, the gate's verdict
    assert doc["gate"]["passed"] is False and doc["gate"]["stage"] == "export"
    assert doc["gate"]["result"]["train"]["last_loss"] < doc["gate"]["result"]["train"]["first_loss"] / 10
    last = r.stderr.strip().splitlines()[-1]
    assert "the gate failed at export: the export does not load" in last and "the run was not launched" in last
    assert "Traceback" not in r.stderr
    recs = records(ct.runs)
    assert [v.get("kind") for v in recs.values()] == ["gate"]       # no training run was started
    status = json.loads(ct.cli("status", "ct200", "--json").stdout)["runs"]
    assert [s["state"] for s in status] == ["failed"]


def test_bad_input_is_refused_before_the_gate_runs(ct):
    r = ct.cli("launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", ct.cfg, "--gate", "--",
               "--lr", "-1")
    assert r.returncode == 2 and "nothing was launched" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = ct.cli("launch", "ct200", "--resume", "20250101-000000-abcdef", "--gate")
    assert r.returncode == 2 and "--gate checks a new run's pipeline" in r.stderr, r.stderr
    assert not ct.runs.exists() or not records(ct.runs)


# --- pure ----------------------------------------------------------------------------------------

def test_gate_options_take_one_device_of_the_run_and_its_own_settings():
    t = Target(name="ct", host=None, vmid=None, python="python3", workdir="/w", gpus=8)
    g = gate_options(LaunchOptions.build(gpu_ids="3,5", workers=None, extra=["--lr", "1e-3"], name="big",
                                         compile_policy="inductor"), t)
    assert (g.kind, g.gpus, g.gpu_ids, g.extra, g.name, g.compile_policy) == (
        "gate", 1, (3,), ("--lr", "1e-3"), "gate of big", "inductor")
    assert gate_options(LaunchOptions.build(), t).gpus == 1          # all of the target's GPUs: the gate takes one
    assert gate_options(LaunchOptions.build(gpus=0, workers=2), t).gpus == 0
    assert gate_options(LaunchOptions.build(gpus=0, workers=2), t).workers is None
    with pytest.raises(UsageError, match="more than the target's 8"):
        gate_options(LaunchOptions.build(gpus=9), t)


def test_the_verdict_is_the_gate_documents_last_line_else_what_ended_it():
    doc = {"passed": False, "failed": "decode", "error": "decode: the decoders disagree"}
    v = verdict_of("ct", "r1", ["[gate] decode: ...", json.dumps(doc), "dflash-ops: trainer ended: exit code 1"], 100)
    assert (v.passed, v.stage, v.error) == (False, "decode", "decode: the decoders disagree")
    v = verdict_of("ct", "r1", [json.dumps({"passed": True})], 0)
    assert v.passed and v.stage is None
    v = verdict_of("ct", "r1", ["[gate] train: 300 steps", "dflash-ops: trainer (pid 9) ended: SIGTERM"], 103)
    assert not v.passed and v.stage is None and v.error.startswith("it was stopped: dflash-ops: trainer")
