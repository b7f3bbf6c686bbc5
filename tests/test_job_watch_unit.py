"""trainer/train/job_watch.py's logic, against a real TCPStore on loopback (in this process) or a stand-in
store where a store's timing is the point: which of a node's failures is the job's, what a launcher
does once rank 0 passed its last collective, when the judge calls a store gone; and SIGTERM's grace
(trainer/train/grace.py: measured from the steps; work a rank does alone does not run it out, on any rank).
The grace and the judge run on a fake clock (tests/fakeclock.py), in the test's thread: their verdicts
are checked at exact times, whatever else loads the machine."""
from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from fakeclock import FakeClock  # noqa: E402
from trainer.signatures import classify  # noqa: E402
from trainer.train import grace as grace_module  # noqa: E402
from trainer.train import job_watch as watch


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


@pytest.fixture
def clock(monkeypatch):
    """StopGrace on a fake clock: `grace(rank)` is one whose deadline thread's work (_expire) the test
    runs itself, and `ended` the times at which it would have exited 143."""
    clock = FakeClock(100.0)
    monkeypatch.setattr(grace_module, "time", clock.module())
    monkeypatch.setattr(grace_module, "POLL_S", 0.25)
    clock.ended = []
    monkeypatch.setattr(grace_module, "exit_process", lambda code, finalize=None: clock.ended.append((clock.now, code)))

    def grace(rank: int) -> grace_module.StopGrace:
        g = grace_module.StopGrace(rank)
        g._held = clock.event()
        return g
    clock.grace = grace
    return clock


def test_the_grace_is_three_of_the_longest_steps(clock):
    grace = clock.grace(0)
    grace.least = 0.3
    assert grace.seconds() == 0.3
    grace.boundary()
    clock.advance(0.25)
    grace.boundary()
    assert grace.seconds() == 0.75                    # 3 x the 0.25 s step
    clock.advance(0.125)
    grace.boundary()
    assert grace.seconds() == 0.75                    # the longest step, not the last
    grace.excuse_until_boundary()
    clock.advance(5.0)                                # a step and a checkpoint: no step's time
    grace.boundary()
    assert grace.seconds() == 0.75
    clock.advance(1000.0)
    grace.boundary()
    assert grace.seconds() == grace_module.STOP_GRACE_MAX_S


def test_the_grace_outlasts_a_ranks_own_work(clock):
    grace = clock.grace(0)
    work = grace.busy()
    work.__enter__()                            # a checkpoint being written when the deadline passes ...
    clock.at(102.0, lambda: work.__exit__(None, None, None))     # ... until 102.0
    grace._expire(0.5)                          # SIGTERM at 100.0, a grace of 0.5 s
    assert clock.ended == [(102.5, 143)]        # not at 100.5: a fresh grace once the work ended
    grace.hold()                                # the ranks agreed to stop: no deadline
    grace._expire(0.5)
    assert clock.ended == [(102.5, 143)]


def test_a_rank_waiting_for_another_ranks_work_is_excused_until_the_boundary(clock):
    # rank 1 waits in the next agreement while rank 0 evaluates: its deadline must not pass meanwhile
    grace = clock.grace(1)
    grace.boundary()
    grace.excuse_until_boundary()
    clock.at(102.0, grace.boundary)             # the agreement after rank 0's eval, four deadlines long
    grace._expire(0.5)
    assert clock.ended == [(102.5, 143)]        # not before: the deadline counts from the boundary
    assert grace.longest == 0.0                 # a stretch with an eval is no step's time
    grace.excuse_until_boundary()
    clock.at(clock.now + 2.0, grace.boundary)
    clock.at(clock.now + 2.0, grace.hold)       # ... where the ranks agree on the stop
    grace._expire(0.5)
    assert clock.ended == [(102.5, 143)]


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
    clock = FakeClock(100.0)                            # the launcher's rounds, 0.125 s apart
    monkeypatch.setattr(watch, "time", clock.module())
    node = node_watch(endpoint)
    node.silent = 0.25
    keys.set("node/0", "127.0.0.2/1")
    keys.add("nodes", 1)
    keys.set("done/0", "1")
    for _ in range(5):
        node.tick(keys)
        clock.advance(0.125)
    assert not keys.check([watch.FAILED]) and not node._armed
    keys.delete_key("done/0")                           # before rank 0 is done, B's silence is a failure
    node = node_watch(endpoint)
    node.silent = 0.25
    for _ in range(3):                                  # B's beat seen at 100.625, unchanged 0.25 s later
        node.tick(keys)
        clock.advance(0.125)
    assert not keys.check([watch.FAILED])
    node.tick(keys)                                     # ... and 0.375 s later: silent
    assert "has not been heard from for 0.25 s" in watch.json.loads(keys.get(watch.FAILED))["error"]


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

@pytest.fixture
def judge(monkeypatch):
    """The judge (Watch._judge) on a fake clock, run in the test's thread until `end`: POLL_S 0.25,
    UNREACHABLE_S 1; the reader's store calls are scheduled on the clock (`call(start, seconds)`), as
    _Timed marks them. Returns (clock, call, run), run() the judge's verdicts as (time, why)."""
    clock = FakeClock(100.0)
    monkeypatch.setattr(watch, "time", clock.module())
    monkeypatch.setattr(watch, "POLL_S", 0.25)
    monkeypatch.setattr(watch, "UNREACHABLE_S", 1.0)
    ends: list = []
    w = watch.Watch("127.0.0.1:1", "job", lambda why, failed: ends.append((clock.now, why)))
    w._ended = clock.event()

    def call(start: float, seconds: float | None) -> None:
        """A store call in flight from `start` for `seconds` (None: it never returns)."""
        def begin() -> None:
            w._call_started = clock.now
        clock.at(start, begin)
        if seconds is not None:
            clock.at(start + seconds, lambda: setattr(w, "_call_started", None))

    def run(end: float = 110.0) -> list:
        clock.at(end, w._ended.set)     # the watch ends (the job did) if the judge has not ended it first
        w._judge()
        return ends
    return clock, call, run


def test_a_slow_store_whose_every_call_answers_in_time_is_not_gone(judge):
    clock, call, run = judge
    for k in range(12):                 # rounds of two calls, each 0.75 s of the 1 s allowed, back to back
        call(100.0 + 1.5 * k, 0.75)
        call(100.75 + 1.5 * k, 0.75)
    assert run() == []


def test_a_store_call_that_never_returns_is_the_store_gone(judge):
    clock, call, run = judge
    call(100.5, 0.5)
    call(101.125, None)
    (end,) = run()
    assert end[0] == 102.25 and "has not answered for 1 s" in end[1]    # the first look past 1 s in flight


@pytest.mark.parametrize("lasts, gone_at", [(21.25, None), (None, 122.25)])
def test_a_process_that_stalled_does_not_call_its_store_gone(judge, lasts, gone_at):
    """A call in flight while the process stood still for 20 s (swapped, SIGSTOPped): the judge wakes up
    late (121.0) and counts the call from then on. Answered 0.75 s later, the store is not gone; never
    answered, it is gone 1 s after the wake-up, not at once (20.5 s after the call began)."""
    clock, call, run = judge
    call(100.5, lasts)
    clock.at(101.0, lambda: setattr(clock, "now", clock.now + 20.0))
    assert [at for at, _ in run(130.0)] == ([] if gone_at is None else [gone_at])


def test_a_store_call_is_marked_in_flight_while_it_runs():
    """_Timed, the reader's store: the judge reads _call_started."""
    w = watch.Watch("127.0.0.1:1", "job", lambda why, failed: None)
    seen = []
    store = SimpleNamespace(check=lambda keys: seen.append(w._call_started) or False)
    assert watch._Timed(store, w).check(["failed"]) is False
    assert seen[0] is not None and w._call_started is None


class Gets:
    """The real store, each get noted: `waited` the keys a get asked for before they were there (such a
    get waits for its key, up to the store's timeout), `got` all. What a round waited on, without a clock."""

    def __init__(self, store):
        self.store, self.waited, self.got = store, [], []

    def get(self, key):
        self.got.append(key)
        if not self.store.check([key]):
            self.waited.append(key)
        return self.store.get(key)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_node_counted_but_not_yet_written_does_not_block_the_launchers_round(store):
    endpoint, keys = store
    keys.add("nodes", 1)                    # another launcher took index 0, and has not written node/0 yet
    node, seen = node_watch(endpoint), Gets(keys)
    node.tick(seen)         # a get of node/0 would wait the store's whole timeout (5 s), then raise out of tick
    assert seen.waited == [] and "node/1" in seen.got      # no get of a key not there: nothing waited
    assert keys.get("node/1").decode() == node.key and node._beats == {}    # registered; node/0 skipped
    keys.set("node/0", "127.0.0.3/1")       # once written, the next round reads it and watches that node
    node.tick(seen)
    assert seen.waited == [] and "node/0" in seen.got and set(node._beats) == {"127.0.0.3/1"}

