"""A job over several nodes ends as one (trainer/train/job_watch.py): two "nodes" on this machine, each
`python -m trainer --topology processes --nnodes 2` over loopback gloo (node A at 127.0.0.1 hosts
the rendezvous and runs rank 0, node B at 127.0.0.2 runs rank 1), one worker each.

- node B's rank SIGKILLed: node A's rank ends within seconds, naming rank 1, its node and the signal
  (before: it failed on its own, a gloo error that named nothing);
- node B frozen whole (SIGSTOP to its launcher and rank: a node that died without closing its
  connections): node A ends within seconds (before: at the collective's timeout, 900 s);
- node B's rank frozen and node A SIGTERMed: A's rank, blocked in a collective, ends within its
  grace and exits 143 (before: its handler only set a flag it never got to read).

The three jobs start at once (torch's start-up is most of their time) and each scenario begins as
soon as its job trains.
"""
from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from trainer_quick import QUICK, ROOT, children, subprocess_env  # noqa: E402

ENDS_WITHIN_S = 30
ENV = subprocess_env(DFLASH_STOP_GRACE_S="3", DFLASH_NODE_SILENT_S="5")   # 30 s and 15 s otherwise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """Two launchers of one job; node A hosts the rendezvous."""

    def __init__(self, tmp: Path, name: str):
        endpoint = f"127.0.0.1:{_free_port()}"
        self.logs = [tmp / f"{name}-a.log", tmp / f"{name}-b.log"]
        self.nodes = []
        for i, log in enumerate(self.logs):
            cmd = [sys.executable, "-m", "trainer", *QUICK, "--out", str(tmp / f"{name}-{'ab'[i]}"), "--steps",
                   "100000", "--gpus", "0", "--workers", "1", "--topology", "processes", "--compile-policy",
                   "eager", "--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-id", name,
                   "--node-address", f"127.0.0.{i + 1}", *(["--rdzv-host"] if i == 0 else [])]
            with open(log, "wb") as out:
                self.nodes.append(subprocess.Popen(cmd, cwd=ROOT, env=ENV,
                                                   stdout=out, stderr=subprocess.STDOUT))
        self.frozen: list[int] = []

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def training(self) -> bool:
        return self.log(0).count('{"step": ') >= 2

    def end(self) -> None:
        for p in self.nodes:
            if p.poll() is None:
                p.kill()
            p.wait()
        for pid in self.frozen:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _kill_b_rank(job: Job) -> None:
    for pid in children(job.nodes[1].pid):
        os.kill(pid, signal.SIGKILL)


def _freeze_b(job: Job) -> None:
    job.frozen = [*children(job.nodes[1].pid), job.nodes[1].pid]
    for pid in job.frozen:
        os.kill(pid, signal.SIGSTOP)


def _freeze_b_rank(job: Job) -> None:
    job.frozen = children(job.nodes[1].pid)
    for pid in job.frozen:
        os.kill(pid, signal.SIGSTOP)


def _stop_a(job: Job) -> None:
    job.nodes[0].send_signal(signal.SIGTERM)


# Each scenario's fault: its acts, each (seconds after the previous one, act); its time is its last act's.
# "stopped": 2 s after node B's rank froze, node A's rank is blocked in a collective with rank 1 (the
# other jobs are watched meanwhile: the wait holds up only its own job).
SCENARIOS = {"killed": [(0, _kill_b_rank)], "frozen": [(0, _freeze_b)],
             "stopped": [(0, _freeze_b_rank), (2, _stop_a)]}


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    """Each scenario's (node A's exit status, seconds from the fault to its end, node A's log)."""
    tmp = tmp_path_factory.mktemp("jobs")
    jobs = {name: Job(tmp, name) for name in SCENARIOS}
    acts = {name: list(acts) for name, acts in SCENARIOS.items()}   # each scenario's acts still to do
    last_act: dict[str, float] = {}                                 # when each scenario did its last act
    faulted: dict[str, float] = {}                                  # ... once it has done them all
    results: dict[str, tuple] = {}
    try:
        deadline = time.monotonic() + 180
        while len(results) < len(jobs) and time.monotonic() < deadline:
            for name, job in jobs.items():
                if name not in faulted and (name in last_act or job.training()):
                    after, act = acts[name][0]
                    if time.monotonic() - last_act.get(name, -math.inf) >= after:
                        act(job)
                        acts[name].pop(0)
                        last_act[name] = time.monotonic()
                        if not acts[name]:
                            faulted[name] = last_act[name]
                elif name in faulted and name not in results:
                    code = job.nodes[0].poll()
                    if code is not None or time.monotonic() - faulted[name] > ENDS_WITHIN_S + 30:
                        results[name] = (code, time.monotonic() - faulted[name], job.log(0))
                assert all(p.poll() is None for p in job.nodes) or name in faulted, job.log(0)[-3000:]
            time.sleep(0.2)
        yield results
    finally:
        for job in jobs.values():
            job.end()


def test_a_killed_rank_ends_the_other_nodes_ranks_within_seconds_naming_it(ended):
    code, _, log = ended["killed"]
    assert code is not None, log[-3000:]     # ended within the fixture's wait, not at gloo's 900 s
    assert "[rank0]: [trainer] rank 0: ending (exit 3): rank 1 (node 127.0.0.2) failed: killed by SIGKILL" in log, \
        log[-3000:]
    assert code == 3


def test_a_node_that_froze_ends_the_other_nodes_within_seconds(ended):
    code, _, log = ended["frozen"]
    assert code is not None, log[-3000:]     # the watcher's verdict below, not the collective's timeout
    assert "rank 0: ending (exit 3): node 127.0.0.2 failed: its launcher has not been heard from for 5 s" in log, \
        log[-3000:]


def test_sigterm_ends_a_rank_blocked_in_a_collective_within_its_grace(ended):
    code, _, log = ended["stopped"]
    assert code == 143, log[-3000:]     # within the fixture's wait; the grace's own words below
    assert "rank 0: no step boundary within 3 s of SIGTERM (blocked in a collective" in log, log[-3000:]
