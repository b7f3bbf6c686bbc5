"""`logs`, controller side: stream a run's log through dropped connections.

`follow` keeps ONE connection streaming the log (the runs agent's `follow` command: a JSON
header line, then raw log bytes; heartbeats and the final status as JSON lines on stderr). When
the connection drops, or goes silent for DEAD_S, it reconnects with backoff and resumes at the
byte offset it has received up to, so no byte is lost or repeated. It yields events and never
prints: Line per log line (with the failure signatures it matches),
Reconnecting/Resumed around an outage, End with the Summary last.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Generator, Iterator, Sequence, Union

from orchestrator.ssh import agent_call
from orchestrator.ssh.session import owned_session
from orchestrator.errors import (ConnectError, ConnectionLost, ContainerError, HostKeyError, NotFound, OpsError,
                     StepFailed, UsageError)
from orchestrator.inventory import Inventory, Target
from orchestrator.runs.status import LOST, exit_code_for, not_found
from orchestrator.ssh.session import Session
from orchestrator.ssh.transport import SshTransport

BACKOFF_S = (0.1, 0.5, 1.0, 2.0, 4.0, 5.0)   # then 5 s between attempts
GIVE_UP_S = 600.0     # reconnect attempts stop after this long without a connection
DEAD_S = 15.0         # no byte (log or heartbeat) for this long: the connection is dead


@dataclass
class Line:
    """One line of the log as it arrived (bytes, newline included except maybe the last)."""
    data: bytes
    number: int                       # 1-based, counted from where this stream started
    hits: list = field(default_factory=list)   # trainer.signatures.Signature objects

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace").rstrip("\r\n")


@dataclass
class Reconnecting:
    attempt: int
    delay: float
    reason: str
    offset: int
    since: float = 0.0                # time.monotonic() when the outage was first noticed


@dataclass
class Resumed:
    offset: int
    down_s: float                     # from noticing the drop to the new stream's first byte


@dataclass
class Summary:
    target: str
    run: str
    state: str
    exit_code: int                    # the CLI's: 0, 100, 101, 103
    step: int | None = None
    loss: float | None = None
    tau: float | None = None
    lines: int = 0
    bytes: int = 0
    offset: int = 0
    reconnects: int = 0               # reconnect attempts, failed ones included
    outages: int = 0                  # times the stream was cut (each followed by one or more attempts)
    signatures: dict[str, int] = field(default_factory=dict)
    hits: list[dict] = field(default_factory=list)
    classified: str | None = None     # the catalog's name for the failure (text, then exit status)
    exit: dict | None = None
    elapsed_s: float | None = None
    kind: str = "train"               # what the run runs: train (python -m trainer) or regen
    rows: int | None = None           # a regen: the rows written so far

    def as_json(self) -> dict:
        return asdict(self)


@dataclass
class End:
    summary: Summary


Event = Union[Line, Reconnecting, Resumed, End]


class _Stream:
    """One connection's stdout/stderr sinks: a header line, then raw log bytes; stderr carries
    JSON control lines (heartbeats, the final status)."""

    def __init__(self, out: "queue.Queue", offset: int):
        self.out, self.offset = out, offset
        self.header: dict | None = None
        self._head = b""
        self._err = b""
        self.end: dict | None = None
        self.stderr_text: list[str] = []
        self.last_rx = time.monotonic()

    def on_stdout(self, data: bytes) -> None:
        self.last_rx = time.monotonic()
        if self.header is None:
            self._head += data
            if b"\n" not in self._head:
                return
            line, data = self._head.split(b"\n", 1)
            self.header = json.loads(line.decode())
            if "offset" in self.header:
                self.offset = self.header["offset"]
            self.out.put(("header", self.header))
        if data:
            self.offset += len(data)
            self.out.put(("data", data))

    def on_stderr(self, data: bytes) -> None:
        self.last_rx = time.monotonic()
        self._err += data
        *lines, self._err = self._err.split(b"\n")
        for raw in lines:
            text = raw.decode("utf-8", errors="replace")
            try:
                doc = json.loads(text)
            except (ValueError, RecursionError):
                doc = None
            if isinstance(doc, dict) and "end" in doc:
                self.end = doc["end"]
            elif not (isinstance(doc, dict) and "hb" in doc):
                self.stderr_text.append(text)
                del self.stderr_text[:-20]


def _retryable(e: BaseException) -> bool:
    if isinstance(e, (HostKeyError, ContainerError, NotFound, UsageError)):
        return False
    if isinstance(e, ConnectError):
        return not e.reason.startswith("authentication failed")
    if isinstance(e, (ConnectionLost, EOFError, OSError)):
        return True
    if isinstance(e, OpsError):
        return False
    return True   # paramiko's SSHException and friends: the connection broke mid-call


def _ssh_of(session: Session, target: Target) -> SshTransport | None:
    return session.ssh(target.host) if target.host is not None else None


def follow(inv: Inventory, target: Target, run: str = "latest", *, follow: bool = True,
           tail: int | None = None, session: Session | None = None, catalog=None,
           backoff: Sequence[float] = BACKOFF_S, give_up_s: float = GIVE_UP_S,
           dead_s: float = DEAD_S) -> Generator[Event, None, None]:
    """Stream the run's log: yields Line for each line as it arrives (annotated with the failure
    signatures it matches), Reconnecting/Resumed around dropped connections, and End last
    (with the summary and the exit code `logs` documents in README "Exit codes": 0, 100-104; a
    container found stopped after the stream was cut ends the follow as the run's end, `lost`).
    Raises NotFound for an unknown run."""
    if catalog is None:
        from trainer.controller_view import load_catalog
        catalog = load_catalog()
    with owned_session(inv, session) as s:
        yield from _follow(s, session is None, target, run, follow, tail, catalog, backoff,
                           give_up_s, dead_s)


def _follow(session: Session, own: bool, target: Target, run: str, follow: bool, tail: int | None,
            catalog, backoff: Sequence[float], give_up_s: float, dead_s: float) -> Iterator[Event]:
    matcher = catalog.matcher()
    events: queue.Queue = queue.Queue()
    stopping = threading.Event()
    state: dict[str, Any] = {"run": run, "offset": -1 if tail is not None else 0, "reconnects": 0, "outages": 0}
    header: dict = {}       # the last stream's header (the run's kind)

    def worker() -> None:
        attempt, down_since, calls, streamed = 0, None, 0, False
        headless = False    # a reconnect's agent already ended before its header once
        while not stopping.is_set():
            stream = _Stream(events, state["offset"])
            conn: dict = {}
            try:
                calls += 1
                t = session.transport(target, fresh=calls > 1)
                conn["ssh"] = state["ssh"] = _ssh_of(session, target)
                args = ["follow", target.workdir, "--offset", str(state["offset"])]
                if not follow:
                    args.append("--no-follow")
                if tail is not None and state["offset"] < 0:
                    args += ["--tail", str(tail)]
                args += ["--", state["run"]]    # a value: never read as an option
                conn["running"] = True
                threading.Thread(target=_watch, args=(stream, conn, dead_s, stopping),
                                 daemon=True).start()
                try:
                    r = agent_call.stream(t, target, agent_call.RUNS, args, what="follow the log",
                                     stdout=stream.on_stdout, stderr=stream.on_stderr, check=False)
                finally:
                    conn["running"] = False
                _sync(stream)
                if stream.header is not None and stream.header.get("reason") == "not_found":
                    events.put(("error", not_found(target, run)))
                    return
                if stream.end is None:
                    killed = r.exit_code - 128 if 128 < r.exit_code < 128 + 65 else None
                    if stream.header is not None and (killed or r.exit_code in (0, 255) and
                                                      not "".join(stream.stderr_text).strip()):
                        # The agent was cut off mid-stream: killed by signal N, which every transport
                        # reports as 128+N (over plain SSH as in a container, whatever the shell said
                        # about it on stderr), or its shell was (255: no exit status): the run goes
                        # on, so the follow reconnects and resumes at its offset.
                        raise ConnectionLost(target.name, "the log stream ended early" +
                                             (f" (its agent was killed by signal {killed})" if killed else ""))
                    if streamed and target.vmid is not None and not headless and (killed or r.exit_code == 1):
                        # A reconnect that reached a container while it went down (`pct shutdown`): its
                        # agent was killed, or lxc-attach could not enter, before any header. One more
                        # attempt, whose `pct status` says what became of the container.
                        headless = True
                        raise ConnectionLost(target.name, "the log stream's agent ended before it started "
                                                          f"(exit {r.exit_code})")
                    raise StepFailed(target.name, "follow the log", r.exit_code,
                                     "\n".join(stream.stderr_text) or "no log stream")
                events.put(("end", stream.end))
                return
            except BaseException as e:  # noqa: BLE001 - sorted here; the main thread re-raises
                _sync(stream)
                streamed = streamed or stream.header is not None
                if stopping.is_set():
                    return
                if streamed and isinstance(e, ContainerError) and e.state is not None:
                    # The container stopped under the run being followed (pct answered its state):
                    # every process of the run ended with it. That is the follow's end, not an error.
                    events.put(("end", _ended_with_container(target, e, state, header)))
                    return
                # Before any stream ran, a failure is the answer (SshTransport has already
                # retried its connect); reconnecting is for streams that were cut.
                if not streamed or not _retryable(e):
                    events.put(("error", e))
                    return
                if stream.header is not None:      # that connection worked: a new outage
                    attempt, down_since, headless = 0, None, False
                now = time.monotonic()
                down_since = down_since or now
                if now - down_since > give_up_s:
                    events.put(("error", e))
                    return
                delay = backoff[min(attempt, len(backoff) - 1)]
                state["outages"] += attempt == 0
                attempt += 1
                state["reconnects"] += 1
                reason = e.render() if isinstance(e, OpsError) else (str(e) or type(e).__name__)
                events.put(("reconnecting", Reconnecting(attempt, delay, reason, state["offset"],
                                                         down_since)))
                stopping.wait(delay)

    def _sync(stream: _Stream) -> None:
        if stream.header is not None and "offset" in stream.header:
            state["run"] = stream.header["run"]     # "latest" is pinned once resolved
            state["offset"] = stream.offset
            header.update(stream.header)

    thread = threading.Thread(target=worker, name="dflash-follow", daemon=True)
    thread.start()
    pending = b""
    number = 0
    hits_seen: list[dict] = []
    counts: dict[str, int] = {}
    total = 0
    down_since: float | None = None

    last_step = [b""]       # the last step's JSON line seen: a run that ended with its container says where it was

    def make_line(data: bytes) -> Line:
        nonlocal number
        number += 1
        if data.startswith(b'{"step": '):
            last_step[0] = data
        hits = [sig for _, sig in matcher.feed(data.decode("utf-8", errors="replace"))]
        for sig in hits:
            counts[sig.id] = counts.get(sig.id, 0) + 1
            if len(hits_seen) < 200:
                hits_seen.append({"line": number, "signature": sig.id, "severity": sig.severity})
        return Line(data, number, hits)

    try:
        while True:
            try:
                kind, item = events.get(timeout=0.5)
            except queue.Empty:
                continue
            if kind == "data":
                total += len(item)
                pending += item
                if b"\n" not in item:
                    continue
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    yield make_line(raw + b"\n")
            elif kind == "header":
                if down_since is not None:
                    yield Resumed(item.get("offset", -1), round(time.monotonic() - down_since, 3))
                    down_since = None
            elif kind == "reconnecting":
                down_since = down_since or item.since
                yield item
            elif kind == "error":
                raise item
            elif kind == "end":
                if pending:
                    yield make_line(pending)
                    pending = b""
                if (item.get("exit") or {}).get("recorded_by") == "follow" and last_step[0]:
                    try:
                        seen = json.loads(last_step[0])
                        item.update(step=seen.get("step"), loss=seen.get("loss"))
                    except (ValueError, RecursionError):
                        pass
                yield End(_summary(target, item, counts, hits_seen, number, total,
                                   state["reconnects"], catalog, state["outages"]))
                return
    finally:
        stopping.set()
        # an own session is closed by follow(), which unblocks the worker's read; a caller's
        # stays open, so only the stream's connection is closed
        if not own and thread.is_alive() and state.get("ssh") is not None:
            # unblock the worker's read: closing the stream's connection is the only way
            try:
                state["ssh"].close()
            except Exception:  # noqa: BLE001
                pass


def _watch(stream: _Stream, conn: dict, dead_s: float, stopping: threading.Event) -> None:
    """Close a connection that has gone silent: the agent sends a heartbeat every 2 s, so
    silence means the network is gone even if no TCP reset ever arrives."""
    while conn.get("running") and not stopping.is_set():
        time.sleep(0.5)
        if conn.get("running") and time.monotonic() - stream.last_rx > dead_s:
            ssh = conn.get("ssh")
            if ssh is not None:
                ssh.close()
            return


def _ended_with_container(target: Target, e: ContainerError, state: dict, header: dict) -> dict:
    """The end of a follow whose run's container was found stopped (pct status) after its stream was cut:
    the run's end as the runs agent would give it, state `lost` (README, exit 104). Once the container
    runs again `status` says the same (`lost`), or `stopped` when a clean shutdown's SIGTERM let the
    trainer checkpoint first."""
    run, kind = state["run"], header.get("kind") or "train"
    reason = (f"ended with its container: CT {e.vmid} is {e.state} (`pct start {e.vmid}`, then "
              f"`dflash-ops status {target.name}` says how it ended and `dflash-ops launch {target.name} "
              f"--resume {run}` continues it from " + ("the rows it wrote)" if kind == "regen" else
                                                        "its last checkpoint)"))
    return {"run": run, "state": LOST, "offset": max(state["offset"], 0), "kind": kind,
            "exit": {"state": LOST, "lost": True, "container": e.state, "container_restarted": False,
                     "exit_code": None, "signal": None, "reason": reason, "recorded_by": "follow"}}


def _summary(target: Target, end: dict, counts: dict[str, int], hits: list[dict], lines: int,
             total: int, reconnects: int, catalog, outages: int = 0) -> Summary:
    state = end.get("state", "failed")
    ex = end.get("exit") or {}
    classified = None
    if state == "failed":
        fatal = [h["signature"] for h in hits if h["severity"] == "fatal"]
        if fatal:
            order = {s.id: i for i, s in enumerate(catalog)}
            specific = [f for f in fatal if not catalog.get(f).generic]
            classified = min(specific or fatal, key=lambda f: order.get(f, 1 << 30))
        else:
            code = ex.get("returncode")
            classified = catalog.classify("", code) if code is not None else None
    return Summary(target=target.name, run=end.get("run", ""), state=state,
                   exit_code=exit_code_for(state), step=end.get("step"), loss=end.get("loss"),
                   tau=end.get("tau"), lines=lines, bytes=total, offset=end.get("offset", 0),
                   reconnects=reconnects, outages=outages, signatures=dict(counts), hits=hits,
                   classified=classified, exit=ex or None, elapsed_s=end.get("elapsed_s"),
                   kind=end.get("kind") or "train", rows=end.get("rows"))


__all__ = ["follow", "Line", "Reconnecting", "Resumed", "End", "Summary", "Event"]
