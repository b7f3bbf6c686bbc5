"""The run lifecycle, controller side: launch, logs (follow), status, stop, metrics.

Library functions: they return data or yield events, never print or exit (style habit 1).
Everything that happens on the target is done by `remote/runs_agent.py`, run with the target's
python in one round trip per call; the run records live on the target (WORKDIR/runs/RUN/), so
any controller can pick a run up later.

`follow` keeps ONE connection streaming the log; when it drops it reconnects with backoff and
resumes at the byte offset it has received up to, so no byte is lost or repeated.
"""
from __future__ import annotations

import getpass
import hashlib
import json
import os
import queue
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence, Union

from .deploy import agent_source, run_agent
from .errors import (EXIT_OK, EXIT_RUN_FAILED, EXIT_RUN_RUNNING, EXIT_RUN_STOPPED, ConnectError,
                     ConnectionLost, ContainerError, HostKeyError, NotFound, OpsError, StepFailed,
                     UsageError)
from .inventory import Inventory, Target
from .transport import Session, SshTransport

AGENT = "runs_agent.py"
TOPOLOGIES = ("threads", "processes")
STATE_EXIT = {"succeeded": EXIT_OK, "failed": EXIT_RUN_FAILED, "running": EXIT_RUN_RUNNING,
              "stopped": EXIT_RUN_STOPPED}
BACKOFF_S = (0.1, 0.5, 1.0, 2.0, 4.0, 5.0)   # then 5 s between attempts
GIVE_UP_S = 600.0     # reconnect attempts stop after this long without a connection
DEAD_S = 15.0         # no byte (log or heartbeat) for this long: the connection is dead
STOP_TIMEOUT_S = 120.0
RUN_ID_RE = re.compile(r"^\d{8}-\d{6}-[0-9a-f]+$")


class LaunchRefused(OpsError):
    """launch said no: nothing deployed, not enough free GPUs, no probe result (exit 1)."""


# --- pure helpers (unit-tested) -----------------------------------------------------------------

def new_run_id(target: str, now: float | None = None) -> str:
    """UTC time + a short hash: sorts by start time, unique across controllers."""
    now = time.time() if now is None else now
    salt = f"{target}:{now!r}:{os.getpid()}:{os.urandom(8).hex()}"
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + "-" + \
        hashlib.sha256(salt.encode()).hexdigest()[:6]


def exit_code_for(state: str) -> int:
    return STATE_EXIT.get(state, EXIT_RUN_FAILED)


def resolve_target(inv: Inventory, name: str | None) -> Target:
    return inv.target(name) if name else inv.default_target()


def split_target_run(inv: Inventory, args: Sequence[str]) -> tuple[Target, str]:
    """`[TARGET] [RUN]`: one word is a run of the default target when it looks like a run id
    (or is `latest`), else a target (an unknown one is an error that suggests a near name)."""
    args = list(args)
    if len(args) > 2:
        raise UsageError(f"expected [TARGET] [RUN], got {' '.join(args)}")
    if len(args) == 2:
        return inv.target(args[0]), args[1]
    if len(args) == 1:
        if args[0] not in inv.targets and (args[0] == "latest" or RUN_ID_RE.match(args[0])):
            return inv.default_target(), args[0]
        return inv.target(args[0]), "latest"
    return inv.default_target(), "latest"


def refusal_message(target: Target, doc: dict) -> str:
    """The one line a refused launch prints, with what to do about it."""
    t, reason = target.name, doc.get("reason")
    if reason == "no_release":
        return f"{t}: no release deployed in {target.workdir}; run `dflash-ops deploy {t}` first"
    if reason == "no_probe":
        return (f"{t}: --policy auto needs the probe's choice and {target.workdir}/probe.json does "
                f"not exist; run `dflash-ops probe {t}` first (or pass --policy NAME)")
    if reason == "too_many_gpus":
        return f"{t}: {doc.get('message')}"
    if reason == "busy":
        holders = doc.get("holders") or []
        who = ", ".join(f"run {h['run']} (pid {h['pid']})" for h in holders) or "another run"
        busy = sorted(doc.get("busy") or {})
        if busy == ["cpu"]:
            what = "the CPU slot is"
        else:
            what = "GPU(s) " + ", ".join(s[3:] for s in busy) + " are"
        first = holders[0]["run"] if holders else "RUN"
        return (f"{t}: {what} in use by {who}; free them with `dflash-ops stop {t} {first}` "
                f"or wait for it to end")
    return f"{t}: launch failed: {doc.get('message')}"


# --- launch -------------------------------------------------------------------------------------

@dataclass
class LaunchResult:
    target: str
    run: str
    pid: int
    supervisor_pid: int | None = None
    release: str | None = None
    commit: str | None = None
    policy: str | None = None
    compile_policy: str | None = None
    probe_policy: str | None = None
    gpus: int = 0
    gpu_ids: list[int] = field(default_factory=list)
    slots: list[str] = field(default_factory=list)
    log: str | None = None
    command_line: str | None = None
    cleared: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def as_json(self) -> dict:
        return asdict(self)


def launch(inv: Inventory, target_name: str | None, *, gpus: int | None = None,
           config: str | None = None, topology: str = "threads", policy: str = "auto",
           workers: int | None = None, extra: Sequence[str] = (),
           session: Session | None = None) -> LaunchResult:
    """Start the trainer detached on the target; returns once it runs (the run goes on alone)."""
    target = resolve_target(inv, target_name)
    gpus = target.gpus if gpus is None else gpus
    if gpus < 0:
        raise UsageError("--gpus must be >= 0")
    if gpus > target.gpus:
        raise LaunchRefused(f"{target.name}: --gpus {gpus} is more than the target's "
                            f"{target.gpus} GPU(s) (hosts.yaml `gpus:`)")
    if topology not in TOPOLOGIES:
        raise UsageError(f"--topology must be one of {', '.join(TOPOLOGIES)}")
    spec = {"run": new_run_id(target.name), "target": target.name, "gpus": gpus,
            "target_gpus": target.gpus, "topology": topology, "policy": policy or "auto",
            "workers": workers, "extra": list(extra), "controller": _controller()}
    if config:
        path = Path(config).expanduser()
        try:
            spec["config_text"] = path.read_text(encoding="utf-8")
        except OSError as e:
            raise UsageError(f"--config {config}: cannot read: {e.strerror or e}") from None
        spec["config_name"] = path.name
        spec["config_source"] = str(path.resolve())
    start = time.monotonic()
    with _session(inv, session) as s:
        t = s.transport(target)
        doc = run_agent(t, target, ["launch", target.workdir], agent=AGENT,
                        stdin=json.dumps(spec).encode(), what="launch the trainer", timeout=120)
    if not doc.get("ok"):
        if doc.get("reason") == "spawn":
            raise StepFailed(target.name, "launch the trainer", 1, doc.get("message", ""))
        raise LaunchRefused(refusal_message(target, doc))
    return LaunchResult(
        target=target.name, run=doc["run"], pid=doc["pid"], supervisor_pid=doc.get("supervisor_pid"),
        release=doc.get("release"), commit=doc.get("commit"), policy=spec["policy"],
        compile_policy=doc.get("compile_policy"), probe_policy=doc.get("probe_policy"), gpus=gpus,
        gpu_ids=doc.get("gpu_ids") or [], slots=doc.get("slots") or [], log=doc.get("log"), command_line=doc.get("command_line"),
        cleared=doc.get("cleared") or [], seconds=round(time.monotonic() - start, 3))


def _controller() -> dict:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        user = None
    try:
        from importlib.metadata import version
        ver = version("dflash-ops")
    except Exception:  # noqa: BLE001
        ver = None
    return {"user": user, "host": socket.gethostname(), "dflash_ops": ver}


class _session:
    """Use the caller's Session, or open one for this call and close it after."""

    def __init__(self, inv: Inventory, session: Session | None):
        self.own = session is None
        self.session = session or Session(inv)

    def __enter__(self) -> Session:
        return self.session

    def __exit__(self, *exc) -> None:
        if self.own:
            self.session.close()


# --- status -------------------------------------------------------------------------------------

def status(inv: Inventory, names: Sequence[str] = (), *, all_targets: bool = False,
           runs: Sequence[str] = (), session: Session | None = None) -> tuple[list[dict], dict[str, str]]:
    """(rows, errors): the runs of each target (default: the default target), fetched in
    parallel; a row per run, oldest first per target; errors maps a target that could not be
    read to why."""
    targets = list(inv.targets.values()) if all_targets else inv.select(list(names))
    with _session(inv, session) as s:
        def one(target: Target):
            try:
                doc = run_agent(s.transport(target), target, ["status", target.workdir, *runs],
                                agent=AGENT, what="read the runs", timeout=60)
            except OpsError as e:
                return target.name, None, e.render()
            return target.name, doc, None

        with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
            results = list(pool.map(one, targets))
    rows, errors = [], {}
    for name, doc, err in results:
        if err:
            errors[name] = err
            continue
        for r in doc["runs"]:
            rows.append({"target": name, **r})
        for r in doc.get("missing") or []:
            errors[name] = f"{name}: no run {r!r}"
    return rows, errors


def _not_found(target: Target, run: str) -> NotFound:
    if run in ("", "latest"):
        return NotFound(f"{target.name}: no runs yet in {target.workdir}/runs; start one with "
                        f"`dflash-ops launch {target.name}`")
    return NotFound(f"{target.name}: no run {run!r} (see `dflash-ops status {target.name}`)")


# --- stop ---------------------------------------------------------------------------------------

def stop(inv: Inventory, target: Target, run: str = "latest", *, force: bool = False,
         timeout: float = STOP_TIMEOUT_S, session: Session | None = None) -> dict:
    """SIGTERM (SIGKILL with force) to the run's process group, wait for it to exit. Returns the
    agent's document: {"run", "already": bool, "state", "timed_out": bool, ...}."""
    args = ["stop", target.workdir, run, "--timeout", str(timeout)] + (["--force"] if force else [])
    with _session(inv, session) as s:
        doc = run_agent(s.transport(target), target, args, agent=AGENT, what="stop the run",
                        timeout=timeout + 60)
    if not doc.get("found"):
        raise _not_found(target, run)
    doc["target"] = target.name
    return doc


# --- metrics ------------------------------------------------------------------------------------

def metrics(inv: Inventory, target: Target, run: str = "latest", *,
            session: Session | None = None) -> dict:
    """{"run", "status": {...}, "metrics": [the log's JSON metric lines]}."""
    with _session(inv, session) as s:
        doc = run_agent(s.transport(target), target, ["metrics", target.workdir, run], agent=AGENT,
                        what="read the metrics", timeout=300)
    if not doc.get("found"):
        raise _not_found(target, run)
    doc["target"] = target.name
    return doc


# --- logs ---------------------------------------------------------------------------------------

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
    reconnects: int = 0
    signatures: dict[str, int] = field(default_factory=dict)
    hits: list[dict] = field(default_factory=list)
    classified: str | None = None     # the catalog's name for the failure (text, then exit status)
    exit: dict | None = None
    elapsed_s: float | None = None

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
            except ValueError:
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
           dead_s: float = DEAD_S) -> Iterator[Event]:
    """Stream the run's log: yields Line for each line as it arrives (annotated with the failure
    signatures it matches), Reconnecting/Resumed around dropped connections, and End last
    (with the summary and the exit code of the contract). Raises NotFound for an unknown run."""
    if catalog is None:
        from trainer.signatures import load_catalog
        catalog = load_catalog()
    matcher = catalog.matcher()
    events: queue.Queue = queue.Queue()
    stopping = threading.Event()
    own = session is None
    session = session or Session(inv)
    state = {"run": run, "offset": -1 if tail is not None else 0, "reconnects": 0}

    def worker() -> None:
        attempt, down_since, calls, streamed = 0, None, 0, False
        while not stopping.is_set():
            stream = _Stream(events, state["offset"])
            conn: dict = {}
            try:
                calls += 1
                t = session.transport(target, fresh=calls > 1)
                conn["ssh"] = state["ssh"] = _ssh_of(session, target)
                args = ["follow", target.workdir, state["run"], str(state["offset"])]
                if not follow:
                    args.append("--no-follow")
                if tail is not None and state["offset"] < 0:
                    args += ["--tail", str(tail)]
                conn["running"] = True
                threading.Thread(target=_watch, args=(stream, conn, dead_s, stopping),
                                 daemon=True).start()
                try:
                    r = t.run([target.python, "-c", agent_source(AGENT), *args],
                              stdout=stream.on_stdout, stderr=stream.on_stderr)
                finally:
                    conn["running"] = False
                _sync(stream)
                if stream.header is not None and stream.header.get("error") == "not_found":
                    events.put(("error", _not_found(target, run)))
                    return
                if stream.end is None:
                    if stream.header is not None and r.exit_code in (0, 255) and \
                            not "".join(stream.stderr_text).strip():
                        # the agent was cut off mid-stream (sshd sends exit-signal, not status)
                        raise ConnectionLost(target.name, "the log stream ended early")
                    raise StepFailed(target.name, "follow the log", r.exit_code,
                                     "\n".join(stream.stderr_text) or "no log stream")
                events.put(("end", stream.end))
                return
            except BaseException as e:  # noqa: BLE001 - sorted here; the main thread re-raises
                _sync(stream)
                streamed = streamed or stream.header is not None
                if stopping.is_set():
                    return
                # Before any stream ran, a failure is the answer (SshTransport has already
                # retried its connect); reconnecting is for streams that were cut.
                if not streamed or not _retryable(e):
                    events.put(("error", e))
                    return
                if stream.header is not None:      # that connection worked: a new outage
                    attempt, down_since = 0, None
                now = time.monotonic()
                down_since = down_since or now
                if now - down_since > give_up_s:
                    events.put(("error", e))
                    return
                delay = backoff[min(attempt, len(backoff) - 1)]
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

    thread = threading.Thread(target=worker, name="dflash-follow", daemon=True)
    thread.start()
    pending = b""
    number = 0
    hits_seen: list[dict] = []
    counts: dict[str, int] = {}
    total = 0
    down_since: float | None = None

    def make_line(data: bytes) -> Line:
        nonlocal number
        number += 1
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
                yield End(_summary(target, item, counts, hits_seen, number, total,
                                   state["reconnects"], catalog))
                return
    finally:
        stopping.set()
        if own:
            session.close()
        elif thread.is_alive() and state.get("ssh") is not None:
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


def _summary(target: Target, end: dict, counts: dict[str, int], hits: list[dict], lines: int,
             total: int, reconnects: int, catalog) -> Summary:
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
                   reconnects=reconnects, signatures=dict(counts), hits=hits,
                   classified=classified, exit=ex or None, elapsed_s=end.get("elapsed_s"))


__all__ = ["launch", "status", "stop", "metrics", "follow", "LaunchResult",
           "LaunchRefused", "Line", "Reconnecting", "Resumed", "End", "Summary", "new_run_id",
           "split_target_run", "resolve_target", "exit_code_for", "refusal_message"]
