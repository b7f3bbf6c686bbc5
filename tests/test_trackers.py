"""The trainer's trackers (trainer/run/trackers.py): which numbers become which curve, --report-to's
refusals before any work, and W&B offline. W&B is not in the venv: its test runs under `make test-wandb`
(wandb installed into an ignored folder on that run's PYTHONPATH), the refusal of a missing wandb here."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_quick import QUICK, subprocess_env

from trainer.run import trackers

HAVE_WANDB = trackers.installed("wandb")


def test_step_and_eval_records_become_curves_and_other_events_none():
    step = {"step": 3, "loss": 2.5, "accuracy": 0.25, "acc_per_position": [0.5, None], "lr": 1e-3, "grad_norm": 1.0,
            "eta_s": None}
    assert trackers.scalars(step) == [("train/loss", 2.5), ("train/accuracy", 0.25), ("train/acc_per_position/1", 0.5),
                                      ("train/lr", 1e-3), ("train/grad_norm", 1.0)]
    ev = {"event": "eval", "step": 4, "acceptance_length": 1.5, "rounds": 10, "tau_ci95": [1.2, 1.8],
          "accept_rate_by_position": [0.4]}
    assert trackers.scalars(ev) == [("eval/tau", 1.5), ("eval/rounds", 10.0), ("eval/tau_ci95_low", 1.2),
                                    ("eval/tau_ci95_high", 1.8), ("eval/accept_rate_by_position/1", 0.4)]
    done = {"event": "done", "step": 9, "loss": 2.0, "steps_trained": 9, "trained_s": 3.0, "acceptance_length": 1.7}
    assert trackers.scalars(done) == [("eval/tau", 1.7)]          # the final eval; the loss is the last step's
    for other in ({"event": "checkpoint", "step": 5, "seconds": 0.1}, {"event": "resume", "step": 5},
                  {"event": "done", "step": 9, "loss": 2.0, "acceptance_length": None}):
        assert trackers.scalars(other) == []


@pytest.mark.parametrize("value, names", [("auto", None), ("none", ()), ("tensorboard", ("tensorboard",)),
                                          ("wandb,tensorboard,wandb", ("wandb", "tensorboard"))])
def test_report_to_names(value, names):
    assert trackers.parse(value) == names


def _trainer(tmp_path: Path, *flags: str, **env: str) -> subprocess.CompletedProcess:
    variables = subprocess_env(**env)
    if os.environ.get("PYTHONPATH"):      # make test-wandb's folder, after the checkout
        variables["PYTHONPATH"] += os.pathsep + os.environ["PYTHONPATH"]
    return subprocess.run([sys.executable, "-m", "trainer", *QUICK, "--steps", "4", "--eval-every", "2",
                           "--out", str(tmp_path / "out"), *flags], capture_output=True, text=True, timeout=300,
                          env=variables, cwd=tmp_path)


@pytest.mark.parametrize("flag, words", [("tb", "--report-to 'tb': expected auto, none, or a comma list"),
                                         ("tensorboard,", "--report-to 'tensorboard,': expected")])
def test_an_unknown_tracker_is_one_line_exit_2(tmp_path, flag, words):
    r = _trainer(tmp_path, "--report-to", flag)
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(HAVE_WANDB, reason="wandb is installed here: nothing to refuse")
def test_wandb_asked_for_and_missing_is_one_line_exit_2_before_any_work(tmp_path):
    r = _trainer(tmp_path, "--report-to", "tensorboard,wandb")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("trainer: error: --report-to wandb: the wandb package is not installed in this python "
                                "(pip install wandb); or leave wandb out of --report-to")
    assert not (tmp_path / "out").exists()      # refused before the run folder, the data, torch


def test_none_writes_no_event_files(tmp_path):
    r = _trainer(tmp_path, "--report-to", "none", "--eval-prompts", "0")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "metrics.jsonl").exists() and not (tmp_path / "out" / trackers.TB_DIR).exists()


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_WANDB, reason="wandb is not installed (make test-wandb installs it apart)")
def test_wandb_offline_run_has_the_metrics_and_says_how_to_sync(tmp_path):
    """WANDB_MODE=offline (nothing is sent anywhere): the W&B run is written under OUT/wandb, and the log's
    last W&B line is the `wandb sync DIR` to run later; TensorBoard's event files are written beside it."""
    r = _trainer(tmp_path, "--report-to", "tensorboard,wandb", WANDB_MODE="offline", WANDB_SILENT="true",
                 WANDB_DISABLE_GIT="true")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    said = [line for line in r.stdout.splitlines() if line.startswith("[trainer] W&B")]
    assert said and said[-1].startswith("[trainer] W&B run written offline; send it with: wandb sync ")
    folder = Path(said[-1].rsplit(" ", 1)[1])
    assert folder.parent == out / trackers.WANDB_DIR and folder.name.startswith("offline-run-")
    [data] = folder.glob("run-*.wandb")
    assert data.stat().st_size > 0 and (out / trackers.TB_DIR).is_dir()


def test_a_resumed_run_continues_its_curves_from_the_checkpoint(tmp_path):
    """A run of 4 steps, then --resume to 6: one curve, steps 1..6 each once, the checkpoint's step kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert _trainer(tmp_path, "--eval-prompts", "0").returncode == 0
    r = _trainer(tmp_path, "--eval-prompts", "0", "--resume", "--steps", "6")
    assert r.returncode == 0, r.stderr
    acc = EventAccumulator(str(tmp_path / "out" / trackers.TB_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]


def test_a_resume_purges_what_the_interrupted_run_logged_after_its_checkpoint(tmp_path):
    """The interrupted run logged steps 1..4 and its checkpoint was step 2: the resumed run's curves take
    over from step 3 (purge_step), so steps 3 and 4 are there once, with the resumed run's values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = trackers.Trackers(("tensorboard",), tmp_path, lambda line: None)
    for step in range(1, 5):
        first.record({"step": step, "loss": 10.0 + step})
    first.close()
    resumed = trackers.Trackers(("tensorboard",), tmp_path, lambda line: None)
    resumed.record({"event": "resume", "step": 2})
    for step in (3, 4):
        resumed.record({"step": step, "loss": 20.0 + step})
    resumed.close()
    acc = EventAccumulator(str(tmp_path / trackers.TB_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0)]
