"""`tensorboard`: bring runs' TensorBoard event files home, incrementally, and serve them here.

The trainer writes its metrics as event files in RUNDIR/tensorboard/ (trainer/run/trackers.py). `sync`
asks each target's runs agent (its `tensorboard` verb, remote/runs/tensorboard.py) over the Session's
connection, the one `logs --follow` streams through, for what its files hold beyond the sizes of the
copies here, and appends that to the copies: a pass moves only new bytes and new files. The copies live
in home()/TARGET/RUN/ ($DFLASH_OPS_HOME/tensorboard, ~/.dflash-ops/tensorboard), one folder per run per
target, so runs of several targets and nodes sit side by side. `serve` starts TensorBoard (the
`tensorboard` package of this python) on that folder, on 127.0.0.1, and returns its URL; the command
then syncs again every few seconds until Ctrl-C. Library functions: return data, never print.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Sequence

from orchestrator.errors import NotFound, OpsError, StepFailed, UsageError
from orchestrator.inventory import Inventory, Target
from orchestrator.runs.status import not_found
from orchestrator.ssh import agent_call
from orchestrator.ssh import fanout
from orchestrator.ssh.session import owned_session
from orchestrator.ssh.session import Session

START_TIMEOUT_S = 180.0          # TensorBoard's start on a loaded machine (its first import: seconds)
URL_RE = re.compile(r"TensorBoard \S+ at (http://\S+?)/? ")


def home() -> Path:
    """Where the event files come: $DFLASH_OPS_HOME/tensorboard (~/.dflash-ops/tensorboard)."""
    return Path(os.environ.get("DFLASH_OPS_HOME", Path.home() / ".dflash-ops")) / "tensorboard"


@dataclass
class SyncedRun:
    """One run of one target after a pass: its folder here, what the pass brought."""
    target: str
    run: str
    state: str
    folder: str
    files: int = 0                   # event files here
    new_bytes: int = 0               # brought by this pass
    new_files: list[str] = field(default_factory=list)

    def as_json(self) -> dict:
        return asdict(self)


TransferError = agent_call.TransferError     # the stream did not hold what its header announced (exit 1)


def _have(folder: Path) -> dict[str, dict[str, int]]:
    """{run: {name: size}} of the copies under home()/TARGET (what the agent need not send again)."""
    have: dict[str, dict[str, int]] = {}
    if not folder.is_dir():
        return have
    for run in sorted(os.listdir(folder)):
        base = folder / run
        if run.startswith(".") or not base.is_dir():
            continue
        sizes = {}
        for root, _, names in os.walk(base):
            for name in names:
                path = Path(root) / name
                sizes[path.relative_to(base).as_posix()] = path.stat().st_size
        have[run] = sizes
    return have


def _safe_name(name: object) -> str:
    """A file name the agent sent, relative and inside its run's folder, or TransferError."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        raise TransferError(f"the target sent a file name that is not a relative path: {name!r}")
    parts = PurePosixPath(name).parts
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise TransferError(f"the target sent a file name that is not a relative path: {name!r}")
    return name


class _Receiver(agent_call.StreamSink):
    """The stdout sink: the header line, then each announced range written into its copy at its offset."""

    def __init__(self, folder: Path):
        super().__init__("runs agent")
        self.folder = folder
        self.todo: list[tuple[Path, int, int]] = []     # (copy, offset, bytes left)
        self.extra = 0

    def opened(self, header: dict) -> None:
        for r in header.get("runs", []):
            run = _safe_name(r["run"])
            for f in r["files"]:
                path = self.folder / run / _safe_name(f["name"])
                self.todo.append((path, int(f["offset"]), int(f["size"])))
        self._open_next()

    def take(self, data: bytes) -> None:
        while data:
            if not self.todo:
                self.extra += len(data)
                return
            path, offset, left = self.todo[0]
            take, data = data[:left], data[left:]
            self.out.write(take)
            left -= len(take)
            self.todo[0] = (path, offset, left)
            if left == 0:
                self._close()
                self.todo.pop(0)
                self._open_next()

    def _open_next(self) -> None:
        while self.todo:
            path, offset, left = self.todo[0]
            path.parent.mkdir(parents=True, exist_ok=True)
            self.out = open(path, "r+b" if path.exists() else "wb")
            self.out.seek(offset)
            self.out.truncate()     # a copy longer than the file there (sent again from 0) loses its tail
            if left:
                return
            self._close()
            self.todo.pop(0)

    def _close(self) -> None:
        self.out.close()

    def check(self) -> None:
        if self.todo:
            raise TransferError(f"the stream ended with {len(self.todo)} event file(s) incomplete; the next pass "
                                "brings the rest")
        if self.extra:
            raise TransferError(f"{self.extra} bytes more than the header announced")


def sync_target(session: Session, target: Target, runs: Sequence[str],
                fresh: bool = False) -> tuple[list[SyncedRun], list[str]]:
    """One pass over `runs` (ids or `latest`) of one target: (runs found, with what came; names not found).
    fresh: over a new connection (the last one failed)."""
    folder = home() / target.name
    stdin = json.dumps({"have": _have(folder)}).encode()
    recv = _Receiver(folder)
    try:
        agent_call.stream(session.transport(target, fresh=fresh), target, agent_call.RUNS,
                     ["tensorboard", target.workdir, "--", *runs], what="bring the event files",
                     stdout=recv, stdin=stdin)
    finally:
        if recv.todo and not recv.out.closed:
            recv.out.close()
    if recv.header is None:
        raise StepFailed(target.name, "bring the event files", 0, "the agent sent no header")
    agent_call.reply(target, recv.header)        # a refusal, in the one reply format, is raised as such
    recv.check()
    done = []
    for r in recv.header["runs"]:
        base = folder / r["run"]
        count = sum(len(names) for _, _, names in os.walk(base))
        done.append(SyncedRun(target.name, r["run"], r["state"], str(base), count,
                              sum(int(f["size"]) for f in r["files"]),
                              [f["name"] for f in r["files"] if int(f["offset"]) == 0]))
    return done, list(recv.header.get("missing", []))


def sync(inv: Inventory, targets: Sequence[Target], runs: Sequence[str] = ("latest",), *,
         session: Session | None = None, fresh: bool = False) -> list[SyncedRun]:
    """One pass over every target (in parallel): each named run found on any of them comes home.
    NotFound (102) for a run found on none; a target that could not be reached is TargetsFailed (1)."""
    with owned_session(inv, session) as s:
        group = fanout.fan_out(list(targets), lambda t: sync_target(s, t, runs, fresh))
    group.raise_failures()
    found: list[SyncedRun] = []
    missing: dict[str, list[str]] = {}
    for t in targets:
        assert group[t.name].value is not None      # raise_failures: every target answered
        got, lost = group[t.name].value
        found += got
        for name in lost:
            missing.setdefault(name, []).append(t.name)
    for name, where in missing.items():
        if len(where) == len(targets):
            if len(targets) == 1:
                raise not_found(targets[0], name)
            raise NotFound(f"no run {name!r} on {', '.join(where)} (see `dflash-ops status {' '.join(where)}`)")
    return found


def require_server() -> None:
    """UsageError (2) unless this python has the tensorboard package, which serving needs (not syncing)."""
    import importlib.util
    if importlib.util.find_spec("tensorboard") is None:
        raise UsageError("serving needs the tensorboard package in this python "
                         "(pip install 'dflash-ops[tensorboard]'); --no-serve brings the event files home "
                         "without it")


class Server:
    """A TensorBoard process serving `logdir` on 127.0.0.1; its output read by a thread (the last
    lines kept, for the error should it end)."""

    def __init__(self, logdir: Path, port: int | None = None):
        require_server()
        argv = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
                "--reload_interval", "5"] + (["--port", str(port)] if port is not None else [])
        self.lines: list[str] = []
        self.url: str | None = None
        self._seen = threading.Event()
        # Its own session: a Ctrl-C at the terminal reaches this command, which ends it (stop()).
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
        threading.Thread(target=self._read, name="tensorboard-output", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None     # Popen(stdout=PIPE)
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            self.lines = (self.lines + [line])[-20:]
            m = URL_RE.search(line + " ")
            if m and self.url is None:
                self.url = m.group(1) + "/"
                self._seen.set()
        self._seen.set()

    def wait_url(self, timeout: float = START_TIMEOUT_S) -> str:
        """Its URL once it listens; OpsError (1) when it ended first or did not say within `timeout`."""
        self._seen.wait(timeout)
        if self.url is None:
            self.stop()
            said = "; ".join(x for x in self.lines[-3:] if x) or "nothing"
            raise OpsError(f"TensorBoard did not start (it said: {said})")
        return self.url

    def stop(self) -> None:
        """End the process this object started (and only it), and wait for it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _die_with_parent() -> None:
    """In the child: SIGTERM when the command that started it dies, SIGKILL included (Linux's
    PR_SET_PDEATHSIG, prctl option 1), so no TensorBoard outlives its command. Elsewhere: nothing."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def watch(inv: Inventory, targets: Sequence[Target], runs: Sequence[str], session: Session, every: float,
          on_pass, on_error) -> None:
    """Sync every `every` seconds until interrupted (Ctrl-C, SIGTERM as errors.Terminated): on_pass(runs)
    after a pass that brought bytes, on_error(error) for one that failed (the next pass tries again, on
    a new connection)."""
    failed = False
    while True:
        time.sleep(every)
        try:
            got = sync(inv, targets, runs, session=session, fresh=failed)
        except OpsError as e:
            failed = True
            on_error(e)
            continue
        failed = False
        if any(r.new_bytes for r in got):
            on_pass(got)


__all__ = ["home", "sync", "sync_target", "SyncedRun", "Server", "watch", "require_server", "TransferError"]
