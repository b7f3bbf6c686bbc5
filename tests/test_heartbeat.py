"""Long silent phases say they are still going: the heartbeat, alone (its timing on a fake clock) and in a real
tiny run."""
import io
import subprocess
import sys
import time

import pytest

from fakeclock import FakeClock
from trainer.run import log as log_module
from trainer.run.log import RunLog, heartbeat


def test_heartbeat_lines_while_a_phase_runs_and_none_after(monkeypatch):
    """The beat's loop on a fake clock (tests/fakeclock.py), run in the test's thread: a phase of 70 s
    beats at 20, 40 and 60 s, and not once it has ended."""
    clock = FakeClock(100.0)
    monkeypatch.setattr(log_module, "time", clock.module())
    out = io.StringIO()
    beat = heartbeat(RunLog(stream=out), "compiling worker 0", every=20)
    beat._start, beat._done = clock.now, clock.event()
    clock.at(170.0, beat._done.set)                 # the phase ends after 70 s
    beat._beat()
    assert out.getvalue().splitlines() == [f"[trainer] still compiling worker 0 ({s} s)" for s in (20, 40, 60)]
    beat._beat()                                    # ended: no more lines
    assert len(out.getvalue().splitlines()) == 3


def test_heartbeat_beats_from_its_thread():
    out = io.StringIO()
    with heartbeat(RunLog(stream=out), "compiling worker 0", every=0.01):
        deadline = time.monotonic() + 60            # the first beat, however loaded the machine (a bound, no measure)
        while not out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert out.getvalue().startswith("[trainer] still compiling worker 0 (")


def test_a_short_phase_prints_nothing():
    out = io.StringIO()
    with heartbeat(RunLog(stream=out), "compiling worker 0", every=5):
        pass
    assert out.getvalue() == ""


def test_a_real_run_beats_during_data_generation_and_warm_up(tmp_path):
    pytest.importorskip("torch")
    from trainer_quick import QUICK, ROOT, subprocess_env

    r = subprocess.run([sys.executable, "-m", "trainer", *QUICK, "--steps", "1", "--gpus", "0",
                        "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
                       # a cache of its own: the data is generated here, not reused from an earlier run's
                       env=subprocess_env(DFLASH_HEARTBEAT_S="0.001", DFLASH_OPS_CACHE=str(tmp_path / "cache")),
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "[trainer] still generating synthetic data (32 + 2 held-out rows) (" in r.stdout
    assert "[trainer] still warming up worker 0 (" in r.stdout or "[trainer] still compiling worker 0 (" in r.stdout


def test_a_step_line_tells_elapsed_time_pace_and_eta():
    """A run says what the rest will take: the pace of this process's steps so far (evals and
    checkpoints in), not one step's time; the first step logged has no pace yet."""
    from trainer.run.log import clock, step_line

    m = {"step": 30, "loss": 2.0, "accuracy": 0.5, "acc_per_position": [0.6], "lr": 1e-4, "grad_norm": 1.0,
         "tokens_per_s": 1000.0, "samples_per_s": 2.0, "elapsed_s": 125.0, "steps_per_s": 0.24,
         "eta_s": (10_000 - 30) / 0.24}
    assert step_line(m, 10_000).endswith("| 2:05 elapsed, 0.24 steps/s, eta 11:32:22")
    assert "eta" not in step_line({**m, "steps_per_s": None, "eta_s": None}, 10_000)
    assert [clock(s) for s in (0.4, 45, 725, 3 * 3600 + 130, 2 * 86400 + 15000)] == [
        "0s", "45s", "12:05", "3:02:10", "2d 04:10:00"]


def test_on_a_terminal_each_record_is_said_once_as_text_and_the_metrics_file_has_them_all(tmp_path):
    """A trainer run by hand printed every event twice (its JSON and its text); the log a launch writes
    (not a terminal) keeps the JSON lines `dflash-ops logs` reads."""
    import json as json_

    from trainer.run.log import step_line

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    step = {"step": 1, "loss": 2.0, "accuracy": 0.5, "acc_per_position": [0.6], "lr": 1e-4, "grad_norm": 1.0,
            "tokens_per_s": 10.0, "samples_per_s": 1.0}
    records = [step, {"event": "eval", "step": 1, "acceptance_length": 1.5},
               {"event": "checkpoint", "step": 1, "path": "/r/step-1", "seconds": 0.25}]
    for stream, want_json in ((Terminal(), 0), (io.StringIO(), 3)):
        log = RunLog(tmp_path / f"m{want_json}.jsonl", stream=stream)
        log.info(step_line(step, 10))
        for r in records:
            log.metrics(r)
        lines = stream.getvalue().splitlines()
        assert sum(line.startswith("{") for line in lines) == want_json
        assert [json_.loads(x) for x in (tmp_path / f"m{want_json}.jsonl").read_text().splitlines()] == records
    assert lines[0].startswith("[trainer] step 1/10")
    human = Terminal()
    log = RunLog(None, stream=human)
    log.metrics(records[2])
    assert human.getvalue() == "[trainer] checkpoint: step 1, path /r/step-1, seconds 0.25\n"
