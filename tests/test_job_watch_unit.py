"""trainer/train/watch.py's logic, against a real TCPStore on loopback (in this process) or a stand-in
store where a store's timing is the point: which of a node's failures is the job's, what a launcher
does once rank 0 passed its last collective, when the judge calls a store gone; and SIGTERM's grace
(trainer/train/grace.py: measured from the steps; work a rank does alone does not run it out, on any rank)."""
from __future__ import annotations

import signal
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from trainer.signatures import classify  # noqa: E402
from trainer.train import grace as grace_module, watch  # noqa: E402


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


def test_the_grace_is_three_of_the_longest_steps(monkeypatch):
    now = [100.0]                               # a fake clock: the steps take exactly what the test says
    monkeypatch.setattr(grace_module, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=time.sleep))
    grace = grace_module.StopGrace(0)
    grace.least = 0.3
    assert grace.seconds() == 0.3
    grace.boundary()
    now[0] += 0.2
    grace.boundary()
    assert grace.seconds() == pytest.approx(0.6)      # 3 x the 0.2 s step
    now[0] += 0.1
    grace.boundary()
    assert grace.seconds() == pytest.approx(0.6)      # the longest step, not the last
    grace.excuse_until_boundary()
    now[0] += 5.0                                     # a step and a checkpoint: no step's time
    grace.boundary()
    assert grace.seconds() == pytest.approx(0.6)
    now[0] += 1000.0
    grace.boundary()
    assert grace.seconds() == grace_module.STOP_GRACE_MAX_S


def test_the_grace_outlasts_a_ranks_own_work(monkeypatch):
    grace = grace_module.StopGrace(0)
    ended = threading.Event()
    monkeypatch.setattr(grace_module, "exit_process", lambda code, finalize=None: ended.set())
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


def test_a_rank_waiting_for_another_ranks_work_is_excused_until_the_boundary(monkeypatch):
    # rank 1 waits in the next agreement while rank 0 evaluates: its deadline must not pass meanwhile
    monkeypatch.setattr(grace_module, "POLL_S", 0.05)
    ended = threading.Event()
    monkeypatch.setattr(grace_module, "exit_process", lambda code, finalize=None: ended.set())
    grace = grace_module.StopGrace(1)
    grace.boundary()
    grace.excuse_until_boundary()
    th = threading.Thread(target=grace._expire, args=(0.2,))
    th.start()
    time.sleep(0.8)                             # rank 0's eval, four deadlines long
    assert not ended.is_set()
    grace.boundary()                            # the agreement: a stretch with an eval is no step's time
    assert grace.longest == 0.0
    grace.hold()                                # ... where the ranks agree on the stop
    th.join(5)
    assert not ended.is_set()


# ---- the launcher's side, against a real store ----------------------------------------------------

@pytest.fixture
def store():
    import socket
    from datetime import timedelta

    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    yield f"127.0.0.1:{port}", dist.PrefixStore("dflash/job/", server)


def node_watch(endpoint, address="127.0.0.1"):
    return watch.NodeWatch(SimpleNamespace(rdzv_endpoint=endpoint, rdzv_id="job", node_address=address))


def test_a_rank_that_ends_after_its_last_collective_is_no_failure_of_the_job(store, monkeypatch):
    endpoint, keys = store
    assert watch.first_failure({1: failure(-6)}, "n2", done={1}) is None
    monkeypatch.setattr(watch, "key_space", lambda e, r: keys)
    node = node_watch(endpoint, "127.0.0.2")
    watch.Watch(endpoint, "job", None).finished(1)      # rank 1 passed its last collective ...
    node.ranks_failed({1: failure(-6)})                 # ... then aborted in its teardown
    time.sleep(0.5)
    assert not keys.check([watch.FAILED])
    node.ranks_failed({2: failure(1, "RuntimeError: boom")})   # rank 2 failed before its last collective
    deadline = time.monotonic() + 5
    while not keys.check([watch.FAILED]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watch.json.loads(keys.get(watch.FAILED)) == {"rank": 2, "node": "127.0.0.2", "error": "RuntimeError: boom"}


def test_once_rank_0_is_done_no_node_is_judged_silent(store, monkeypatch):
    # node B's launcher died after its ranks finished, before it said it left; rank 0 evaluates alone
    endpoint, keys = store
    node = node_watch(endpoint)
    node.silent = 0.2
    keys.set("node/0", "127.0.0.2/1")
    keys.add("nodes", 1)
    keys.set("done/0", "1")
    for _ in range(5):
        node.tick(keys)
        time.sleep(0.1)
    assert not keys.check([watch.FAILED]) and not node._armed
    keys.delete_key("done/0")                           # before rank 0 is done, B's silence is a failure
    node = node_watch(endpoint)
    node.silent = 0.2
    for _ in range(5):
        node.tick(keys)
        time.sleep(0.1)
    assert "has not been heard from" in watch.json.loads(keys.get(watch.FAILED))["error"]


@pytest.mark.parametrize("rank0_done", [True, False])
def test_the_launcher_kills_its_ranks_only_while_the_job_is_unfinished(store, monkeypatch, capsys, rank0_done):
    import subprocess
    import sys
    endpoint, keys = store
    monkeypatch.setattr(watch, "key_space", lambda e, r: keys)
    monkeypatch.setattr(watch, "GRACE_S", 0.3)
    monkeypatch.setattr(watch, "POLL_S", 0.05)
    exits = []
    monkeypatch.setattr(watch, "exit_process", lambda code, finalize=None: exits.append(code))
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])    # rank 0, in its final eval
    monkeypatch.setattr(watch, "_ranks_running", lambda: [rank.pid] if rank.poll() is None else [])
    try:
        if rank0_done:
            keys.set("done/0", "1")
        node = node_watch(endpoint)
        node.failure = {"rank": 1, "node": "127.0.0.2", "error": "killed by SIGABRT"}
        node._kill_ranks_later(watch.describe(node.failure), failed=True)
        time.sleep(1.2)
        assert (rank.poll() is None) == rank0_done
        assert node.killed == node.ended_by_peer({0: None}) == (not rank0_done)
        log = capsys.readouterr().err
        assert not rank0_done or not log
        if not rank0_done:       # a rank its launcher SIGKILLed for another node's failure is no OOM
            assert "this node's ranks still ran 0.3 s later: SIGKILL" in log
            assert classify(log, 3) == "peer-failed"     # (launch prints no torchrun summary then: no OOM line)
    finally:
        rank.kill()
        rank.wait()


# ---- the judge: one store call in flight too long, not a process that stalled ---------------------

class SlowStore:
    def __init__(self, seconds=0.0, stall=None):
        self.seconds, self.stall, self.hang = seconds, stall, threading.Event()

    def check(self, keys):
        if self.stall:
            self.stall()
        time.sleep(self.seconds)
        return False

    def add(self, key, n):
        time.sleep(self.seconds)
        return 0


class TwoCalls(watch.Watch):
    def tick(self, store):
        store.add("beat", 1)


def judged(monkeypatch, store, cls=watch.Watch, run_s=1.0):
    monkeypatch.setattr(watch, "POLL_S", 0.05)
    monkeypatch.setattr(watch, "UNREACHABLE_S", 0.5)
    monkeypatch.setattr(watch, "key_space", lambda e, r: store)
    ends = []
    w = cls("127.0.0.1:1", "job", lambda why, failed: ends.append(why)).start()
    w.wait(run_s)
    w._ended.set()
    return ends


def test_a_slow_store_whose_every_call_answers_in_time_is_not_gone(monkeypatch):
    assert judged(monkeypatch, SlowStore(0.3), TwoCalls) == []     # a round of 0.6 s, each call 0.3 s


def test_a_store_call_that_never_returns_is_the_store_gone(monkeypatch):
    store = SlowStore(30)
    ends = judged(monkeypatch, store)
    assert len(ends) == 1 and "has not answered for 0.5 s" in ends[0]


def test_a_process_that_stalled_does_not_call_its_store_gone(monkeypatch):
    clock = {"offset": 0.0}
    real = time.monotonic
    monkeypatch.setattr(watch, "time", SimpleNamespace(monotonic=lambda: real() + clock["offset"], sleep=time.sleep))

    def stall():        # the process stood still for 20 s (swapped, SIGSTOPped) during a call
        if clock["offset"] == 0.0:
            clock["offset"] = 20.0
    assert judged(monkeypatch, SlowStore(0.15, stall)) == []


def test_a_node_counted_but_not_yet_written_does_not_block_the_launchers_round(store):
    endpoint, keys = store
    keys.add("nodes", 1)                    # another launcher took index 0, and has not written node/0 yet
    t = time.monotonic()
    node_watch(endpoint).tick(keys)         # (get would wait for node/0: the store's whole timeout)
    assert time.monotonic() - t < 1.0
