"""A job over several nodes ends as one (`--nnodes K`), and a rank ends on SIGTERM wherever it waits.

Every rank and every node's launcher watch one key space, `dflash/RDZV_ID/`, in the store the nodes
already share: torchrun's c10d rendezvous store at --rdzv-endpoint, served by the --rdzv-host node's
launcher.

- `failed`: the job's first failure, JSON {"rank", "node", "error"}, written once (compare_set). A
  launcher writes it as soon as its torchrun sees one of its ranks fail (record_failures: the exit
  status or signal, the error file's line), or when another node's launcher has not been heard from
  for SILENT_S.
- `node/I`, `beat/ADDR/PID`, `left/ADDR/PID`: each launcher registers its node, adds 1 to its beat every
  POLL_S while its ranks run, and says when it leaves (a node that left is not silent).
- `done/RANK`: the rank has passed its last collective. Its end from then on (a crash in teardown) is
  no failure of the job; once `done/0` is set (every rank has passed the last agreement) no launcher
  ends a rank or judges another node's silence: rank 0's final eval is its own.

A rank (its Watch, from its mesh on) reads `failed` every POLL_S: once it is set the rank logs one
line naming the failed rank, its node and the error, and exits EXIT_PEER_FAILED (3) at once,
wherever it is blocked: a collective whose peer died otherwise waits for the process group's
timeout, and NCCL may not notice the death at all. A store that answers with an error (the node
serving it ended) or leaves one call unanswered for UNREACHABLE_S (it froze, or its network went) ends
the rank the same way. The watch stops (`finished`) once no collective is left, so a node that ended
normally never ends another's checkpoint or final eval. A launcher (NodeWatch) watches the same way
and SIGKILLs its own ranks that still run GRACE_S after the job failed (a rank stopped, or stuck
where its watch thread cannot run).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import cast

import torch.distributed as dist

from trainer import procs
from trainer.errors import EXIT_PEER_FAILED, EXIT_SIGTERM
from trainer.exits import exit_process

POLL_S = 1.0          # how often ranks and launchers read the key space
UNREACHABLE_S = 10.0  # a store that has not answered for this long is gone
SILENT_S = 15.0       # a node whose launcher has not beaten for this long has died (DFLASH_NODE_SILENT_S)
GRACE_S = 10.0        # a launcher SIGKILLs its ranks still running this long after the job failed
FAILED = "failed"


def key_space(endpoint: str, run_id: str) -> dist.Store:
    """A client of the rendezvous store at `endpoint`, limited to the job's keys."""
    host, _, port = endpoint.rpartition(":")
    store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=UNREACHABLE_S))
    return dist.PrefixStore(f"dflash/{run_id}/", store)


def describe(failure: dict) -> str:
    """`rank 1 (node 10.0.0.2) failed: killed by SIGKILL`, from a `failed` record."""
    who = f"rank {failure['rank']} (node {failure['node']})" if failure.get("rank") is not None \
        else f"node {failure['node']}"
    return f"{who} failed: {failure.get('error') or 'no error recorded'}"


class Watch:
    """Reads the key space from a thread; `on_end(why, failed)` runs once, while armed, when the job
    has failed (failed=True) or its store is gone. A second thread judges the first: a store that froze blocks a
    read forever (TCPStore's check has no timeout)."""

    def __init__(self, endpoint: str, run_id: str, on_end):
        self.endpoint, self.run_id, self._on_end = endpoint, run_id, on_end
        self._armed = True
        self._call_started: float | None = None     # when the store call in flight began
        self.failure: dict | None = None             # the `failed` record read, once read
        self._ended = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> Watch:
        threading.Thread(target=self._read, name="dflash-watch", daemon=True).start()
        threading.Thread(target=self._judge, name="dflash-watch-judge", daemon=True).start()
        return self

    def disarm(self) -> None:
        """No collective is left: a failure from here on is none of this process's business."""
        self._armed = False

    def finished(self, rank: int) -> None:
        """`rank` has passed its last collective: disarm, and say so (`done/RANK`; waits 2 s at most)."""
        self.disarm()
        _in_thread(lambda: key_space(self.endpoint, self.run_id).set(f"done/{rank}", "1"), 2.0)

    def wait(self, seconds: float) -> bool:
        """True once the job has ended for this watch (its on_end ran or was skipped)."""
        return self._ended.wait(seconds)

    def tick(self, store: dist.Store) -> None:
        """Each read's own work (a launcher's beat)."""

    def _connect(self) -> dist.Store | None:
        """The store, once it answers. It may not be up yet (the host's launcher starts it, maybe later
        than this one); a host that never comes is torchrun's join timeout's business."""
        while not self._ended.is_set():
            try:
                store = key_space(self.endpoint, self.run_id)
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(POLL_S)
                continue
            return cast(dist.Store, _Timed(store, self))   # _Timed stands in for the store: it forwards every call
        return None

    def _read(self) -> None:
        store = self._connect()
        if store is None:
            return
        try:
            while not self._ended.is_set():
                self.tick(store)
                if store.check([FAILED]):
                    self.failure = json.loads(store.get(FAILED))
                    self._end(describe(self.failure), failed=True)
                    return
                time.sleep(POLL_S)
        except Exception as e:  # noqa: BLE001 - the store's errors (DistNetworkError, ...) all mean it is gone
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            self._end(f"the job's store at {self.endpoint} stopped answering ({first}): the node serving it "
                      "(the rendezvous host) ended")

    def _judge(self) -> None:
        """Fires when one store call has been in flight for UNREACHABLE_S. A wake-up late by more than
        POLL_S means this process stalled (swapped, stopped), not the store: the call's time counts
        from then on."""
        woke = resumed = time.monotonic()
        while not self._ended.wait(POLL_S):
            now = time.monotonic()
            if now - woke > 2 * POLL_S:
                resumed = now
            woke, started = now, self._call_started
            if started is not None and now - max(started, resumed) > UNREACHABLE_S:
                self._end(f"the job's store at {self.endpoint} has not answered for {UNREACHABLE_S:g} s: the node "
                          "serving it (the rendezvous host) froze or lost its network")

    def _end(self, why: str, failed: bool = False) -> None:
        with self._lock:
            if self._ended.is_set():
                return
            self._ended.set()
        if self._armed:
            self._on_end(why, failed)


def watch_rank(cfg, rank: int) -> Watch | None:
    """A rank's watch over a job of several nodes (None on one node: its torchrun ends the others)."""
    if cfg.nnodes <= 1:
        return None

    def end(why: str, failed: bool) -> None:
        print(f"[trainer] rank {rank}: ending (exit {EXIT_PEER_FAILED}): {why}", file=sys.stderr, flush=True)
        exit_process(EXIT_PEER_FAILED, finalize=False)
    return Watch(cfg.rdzv_endpoint, cfg.rdzv_id, end).start()


# ---- the launcher's side --------------------------------------------------------------------------

class NodeWatch(Watch):
    """A node's launcher: its beat, the other nodes' beats, its ranks SIGKILLed GRACE_S after the
    job failed."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg.rdzv_endpoint, cfg.rdzv_id, self._kill_ranks_later)
        self.node = cfg.node_address or socket.gethostname()
        self.key = f"{self.node}/{os.getpid()}"     # unique where two "nodes" share an address (one host)
        self._registered = False
        self.killed = False     # this launcher SIGKILLed its ranks after the job failed
        self.own_failed: set[int] = set()   # this node's ranks that torchrun saw fail
        self._beats: dict[str, tuple[int, float]] = {}   # node -> (its beat, when it last moved)
        self.silent = float(os.environ.get("DFLASH_NODE_SILENT_S") or SILENT_S)

    def tick(self, store: dist.Store) -> None:
        if not self._registered:
            index = store.add("nodes", 1) - 1
            store.set(f"node/{index}", self.key)
            self._registered = True
        store.add(f"beat/{self.key}", 1)
        if store.check(["done/0"]):     # every rank passed the last agreement: nothing left to end
            self.disarm()
        if not self._armed:
            return
        now = time.monotonic()
        for i in range(store.add("nodes", 0)):
            if not store.check([f"node/{i}"]):      # counted, not yet written (get would wait for it)
                continue
            other = store.get(f"node/{i}").decode()
            if other == self.key or store.check([f"left/{other}"]):
                continue
            beat = store.add(f"beat/{other}", 0)
            seen = self._beats.get(other)
            if seen is None or seen[0] != beat:
                self._beats[other] = (beat, now)
            elif now - seen[1] > self.silent:
                why = f"its launcher has not been heard from for {self.silent:g} s (the node died, froze or lost " \
                      "its network)"
                self.fail({"rank": None, "node": other.rpartition("/")[0], "error": why}, store)

    def fail(self, failure: dict, store: dist.Store) -> None:
        """Record the job's first failure (a later one changes nothing)."""
        store.compare_set(FAILED, "", json.dumps(failure))

    def ranks_failed(self, failures: dict) -> None:
        """torchrun's monitor saw ranks of this node fail: the first that failed on its own before its
        last collective is the job's failure. Written by a thread of its own: a frozen store never
        answers, and torchrun must go on."""
        self.own_failed |= set(failures)

        def write() -> None:
            failure = None
            try:
                store = key_space(self.endpoint, self.run_id)
                done = {r for r in failures if store.check([f"done/{r}"])}
                failure = first_failure(failures, self.node, done)
                if failure:
                    self.fail(failure, store)
            except Exception as e:  # noqa: BLE001 - the store is gone: the other nodes see that themselves
                print(f"[trainer] could not record {describe(failure) if failure else 'a failure'} in the job's "
                      f"store: {e}", file=sys.stderr, flush=True)
        threading.Thread(target=write, name="dflash-watch-fail", daemon=True).start()

    def ended_by_peer(self, failures=()) -> bool:
        """This launcher SIGKILLed its ranks for another node's failure (not one of `failures`, this
        node's ranks' as torchrun reports them, nor one its monitor saw)."""
        return self.killed and self.failure is not None and \
            self.failure.get("rank") not in {*failures, *self.own_failed}

    def leave(self) -> None:
        """This node's ranks have ended: not silent from now on; stop watching (waits 2 s at most)."""
        self.disarm()
        self._ended.set()
        _in_thread(lambda: key_space(self.endpoint, self.run_id).set(f"left/{self.key}", "1"), 2.0)

    def _kill_ranks_later(self, why: str, failed: bool) -> None:
        """After the job failed: SIGKILL this node's ranks that still run GRACE_S later (a store gone is
        the ranks' own business: one may be alone in its final eval), unless rank 0 has passed its last
        collective by then (`done/0`: the job has finished, whatever ends now); then end the launcher itself if
        torchrun has not returned GRACE_S after its ranks ended (torchrun's own shutdown talks to the
        rendezvous store, and one that froze never answers)."""
        def kill() -> None:
            waited = 0.0
            while (waited < GRACE_S or not failed) and _ranks_running():
                time.sleep(POLL_S)
                waited += POLL_S
            ranks = _ranks_running() if self._armed else []
            if ranks and _in_thread(lambda: key_space(self.endpoint, self.run_id).check(["done/0"]), GRACE_S):
                self.disarm()
                ranks = []
            if ranks:
                self.killed = True
                which = "ranks" if self.ended_by_peer() else "other ranks"    # peer-failed's pattern: "ranks"
                print(f"[trainer] {why}; this node's {which} still ran {GRACE_S:g} s later: SIGKILL "
                      f"{' '.join(map(str, ranks))}", file=sys.stderr, flush=True)
            for pid in ranks:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(GRACE_S)
            if self._armed:
                print(f"[trainer] {why}; torchrun has not returned {GRACE_S:g} s after this node's ranks "
                      f"ended: the launcher exits {EXIT_PEER_FAILED}", file=sys.stderr, flush=True)
                exit_process(EXIT_PEER_FAILED, finalize=False)
        threading.Thread(target=kill, name="dflash-watch-kill", daemon=True).start()


@contextmanager
def record_failures(cfg):
    """While torchrun runs this node's ranks (several nodes): the node's watch, and the first rank that
    fails here recorded as the job's failure the moment torchrun's monitor sees it, before torchrun
    stops this node's other ranks. torchrun has no hook for that: its agent's _monitor_workers is
    wrapped, in this process only, for the duration (torch 2.x's LocalElasticAgent; without it the
    other nodes still end through their own ranks' failures, the silent-node check or the timeouts)."""
    if cfg.nnodes <= 1:
        yield None
        return
    watch = NodeWatch(cfg).start()
    try:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        original = LocalElasticAgent._monitor_workers
    except (ImportError, AttributeError):
        LocalElasticAgent = original = None

    def monitor(agent, group):
        result = original(agent, group)
        if result.is_failed():
            watch.ranks_failed(result.failures)
        return result

    if original is not None:
        LocalElasticAgent._monitor_workers = monitor
    try:
        yield watch
    finally:
        if original is not None:
            LocalElasticAgent._monitor_workers = original
        watch.leave()


def first_failure(failures: dict, node: str, done: set | frozenset = frozenset()) -> dict | None:
    """The earliest of torchrun's ProcessFailures (by timestamp, then global rank) that is a failure of
    its own: not a rank that a stop ended (143, SIGTERM), nor one another rank's failure ended
    (EXIT_PEER_FAILED), nor one that ended after its last collective (in `done`)."""
    own = [(r, f) for r, f in failures.items()
           if f.exitcode not in (EXIT_SIGTERM, -signal.SIGTERM, EXIT_PEER_FAILED) and r not in done]
    if not own:
        return None
    rank, f = min(own, key=lambda rf: (getattr(rf[1], "timestamp", 0) or 0, rf[0]))
    if f.exitcode < 0:
        error = f"killed by {f.signal_name()}"
    else:
        message = f.message if getattr(f, "error_file_data", None) else ""
        lines = message.strip().splitlines() if isinstance(message, str) else []
        error = lines[0] if lines else f"exit status {f.exitcode}"
    return {"rank": rank, "node": node, "error": error}


def _in_thread(call, seconds: float):
    """call()'s result, from a thread of its own waited for `seconds` at most (a frozen store never
    answers); None when it did not return in time or raised (a store that is gone)."""
    box: list = []

    def run() -> None:
        try:
            box.append(call())
        except Exception:  # noqa: BLE001 - a store that is gone answers nothing
            pass
    t = threading.Thread(target=run, name="dflash-watch-call", daemon=True)
    t.start()
    t.join(seconds)
    return box[0] if box else None


class _Timed:
    """A store whose calls mark their start on the watch while in flight (the judge reads it)."""

    def __init__(self, store: dist.Store, watch: Watch):
        self._store, self._watch = store, watch

    def __getattr__(self, name: str):
        call = getattr(self._store, name)

        def timed(*args):
            self._watch._call_started = time.monotonic()
            try:
                return call(*args)
            finally:
                self._watch._call_started = None
        return timed


def _ranks_running() -> list[int]:
    """This launcher's child processes (its ranks) that still run."""
    return procs.children(os.getpid())
