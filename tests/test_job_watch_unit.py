"""The pure parts of trainer/train/watch.py: which of a node's failures is the job's, and SIGTERM's
grace (measured from the steps; a rank's own checkpoint or eval does not run it out)."""
from __future__ import annotations

import signal
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from trainer.train import watch  # noqa: E402


def failure(exitcode, message="", error_file=True, timestamp=0):
    return SimpleNamespace(exitcode=exitcode, message=message, timestamp=timestamp,
                           error_file_data={"message": message} if error_file else {},
                           signal_name=lambda: signal.Signals(-exitcode).name if exitcode < 0 else "")


def test_the_job_failure_is_a_rank_that_failed_on_its_own():
    # rank 2 ended by another's failure (3), rank 3 stopped (143): rank 1's error is the failure
    got = watch.first_failure({2: failure(3), 3: failure(143), 1: failure(1, "RuntimeError: boom\n  more")}, "n1")
    assert got == {"rank": 1, "node": "n1", "error": "RuntimeError: boom"}
    assert watch.first_failure({5: failure(-9)}, "n2")["error"] == "killed by SIGKILL"
    assert watch.first_failure({5: failure(7, "To enable traceback see: ...", error_file=False)}, "n2")["error"] \
        == "exit status 7"
    assert watch.first_failure({0: failure(3), 1: failure(-signal.SIGTERM)}, "n1") is None
    assert watch.describe({"rank": None, "node": "10.0.0.2", "error": "silent"}) == "node 10.0.0.2 failed: silent"


def test_the_grace_is_three_of_the_longest_steps_and_outlasts_a_ranks_own_work(monkeypatch):
    grace = watch.StopGrace(0)
    grace.least = 0.3
    assert grace.seconds() == 0.3
    grace.boundary()
    time.sleep(0.2)
    grace.boundary()
    assert 0.6 <= grace.seconds() < 0.9         # 3 x the 0.2 s step

    ended = threading.Event()
    monkeypatch.setattr(watch, "exit_process", lambda code, finalize=None: ended.set())
    t0 = time.monotonic()
    with grace.busy():                          # a checkpoint being written when the deadline passes
        th = threading.Thread(target=grace._expire, args=(0.3,))
        th.start()
        time.sleep(0.8)
        assert not ended.is_set()
    th.join(5)
    assert ended.is_set() and time.monotonic() - t0 >= 0.8 + 0.3 - 0.05   # a fresh grace after the work
    ended.clear()
    grace.hold()                                # the ranks agreed to stop: no deadline
    grace._expire(0.1)
    assert not ended.is_set()
