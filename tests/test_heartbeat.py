"""Long silent phases say they are still going: the heartbeat, alone and in a real tiny run."""
import io
import subprocess
import sys
import time

import pytest

from trainer.run.log import RunLog, heartbeat


def test_heartbeat_lines_while_a_phase_runs_and_none_after():
    out = io.StringIO()
    with heartbeat(RunLog(stream=out), "compiling worker 0", every=0.05):
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3
    assert all(line.startswith("[trainer] still compiling worker 0 (") and line.endswith(" s)") for line in lines)
    n = len(lines)
    time.sleep(0.15)
    assert len(out.getvalue().splitlines()) == n      # stopped with the phase


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
                       env=subprocess_env(DFLASH_HEARTBEAT_S="0.001"), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "[trainer] still generating synthetic data (32 + 2 held-out rows) (" in r.stdout
    assert "[trainer] still warming up worker 0 (" in r.stdout or "[trainer] still compiling worker 0 (" in r.stdout
