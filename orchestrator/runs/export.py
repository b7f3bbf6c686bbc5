"""`export`: bring a run's trained drafter from the target, as a DFlash draft-model folder.

The export runs on the target (`python -m trainer.export`, through the runs agent's `export`
verb, remote/runs/export.py) and the folder comes back over the same SSH connection as one stream: a
header with each file's size and sha256, then the bytes. Here the files are written into a hidden
folder beside the destination, checked against the header (sizes and hashes), and only then renamed
to the destination: it is either absent or complete. Nothing is left on the target. Hidden folders that
a killed export left beside it (`.dflash-export.partial-PID-*`, PID no longer running) are removed by
the next export into the same folder. An -o of `/`, the current folder or a folder holding it, or one
holding a local target's workdir, is refused before anything travels; an existing -o is replaced
only with --force and only when it is an earlier export (its files and its provenance record,
trainer/owned.py): a folder holding anything else is refused whatever the flags, byte for byte untouched.
The export on the target lives as long as this call: its stdin stays open until the stream is in
(hold.Hold), and EOF there (this process killed, its connection dropped) ends it, worker and
temporary folder included. Ctrl-C or SIGTERM (ui.sigterm_raises) hangs up first and waits for that
end, removes the hidden folder, then raises errors.Interrupted (exit 130 / 143).
Library function: returns data, never prints.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

from orchestrator.ssh import agent_call
from orchestrator.ssh.session import owned_session
from orchestrator.errors import Interrupted, NotFound, OpsError, StepFailed, Terminated, UsageError
from orchestrator.inventory import Inventory, Target
from orchestrator.ssh.session import Session
from orchestrator.ssh.hold import Hold
from trainer.controller_view import NotOurs, not_an_export, swap_in   # torch-free

DTYPES = ("bfloat16", "float16", "float32")
TIMEOUT_S = 3600.0
# (label, total bytes) -> update(n), or None: no progress shown for that transfer (a small one)
Progress = Callable[[str, int], Callable[[int], None] | None]


TransferError = agent_call.TransferError     # the folder arrived incomplete or different from what was sent (exit 1)


@dataclass
class ExportResult:
    target: str
    run: str
    step: int
    output: str
    dtype: str
    files: list[dict] = field(default_factory=list)
    bytes: int = 0
    checkpoint: str | None = None
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    running: bool = False                  # the run was still running (--running-ok): `step` is what it held
    target_changed: list[str] = field(default_factory=list)   # what --target-changed-ok let through
    seconds: float = 0.0

    def as_json(self) -> dict:
        return asdict(self)


class _Receiver(agent_call.StreamSink):
    """The stdout sink: the header line, then each file's bytes into `folder`, hashed on the way."""

    def __init__(self, folder: Path, progress: Progress | None, label: str):
        super().__init__("export agent")
        self.folder, self.progress, self.label = folder, progress, label
        self.files: list[dict] = []
        self.index, self.left = 0, 0
        self.out: BinaryIO | None = None
        self.hash = hashlib.sha256()        # each file's, anew in _next
        self.got: list[dict] = []
        self.update: Callable[[int], None] | None = None
        self.extra = 0

    def opened(self, header: dict) -> None:
        self.files = list(header["files"])
        self.folder.mkdir(parents=True)
        if self.progress:
            self.update = self.progress(self.label, sum(f["size"] for f in self.files))
        self._next()

    def take(self, data: bytes) -> None:
        while data:
            if self.out is None:
                self.extra += len(data)   # more than the header announced: checked in finish()
                return
            take, data = data[: self.left], data[self.left:]
            self.out.write(take)
            self.hash.update(take)
            self.left -= len(take)
            if self.update:
                self.update(len(take))
            if self.left == 0:
                self._close_file()
                self._next()

    def _next(self) -> None:
        while self.index < len(self.files):
            f = self.files[self.index]
            name = f["name"]
            if "/" in name or name in ("", ".", ".."):
                raise TransferError(f"the target sent a file name that is not a plain name: {name!r}")
            self.out = open(self.folder / name, "wb")
            self.hash = hashlib.sha256()
            self.left = int(f["size"])
            if self.left > 0:
                return
            self._close_file()

    def _close_file(self) -> None:
        assert self.out is not None       # called with a file open
        self.out.flush()
        os.fsync(self.out.fileno())
        self.out.close()
        self.out = None
        f = self.files[self.index]
        self.got.append({"name": f["name"], "size": f["size"], "sha256": self.hash.hexdigest()})
        self.index += 1

    def close(self) -> None:
        """Close a file left open by a stream that stopped midway (it is discarded with the folder)."""
        out, self.out = self.out, None
        if out is not None:
            try:
                out.close()
            except OSError:   # its buffer cannot reach a full disk: the error that stopped the stream says so
                pass

    def check(self) -> None:
        """Every announced file complete, with the announced hash, and nothing more."""
        if len(self.got) != len(self.files):
            raise TransferError(f"the stream ended after {len(self.got)} of {len(self.files)} files")
        bad = [g["name"] for g, f in zip(self.got, self.files) if g["sha256"] != f["sha256"]]
        if bad:
            raise TransferError(f"sha256 mismatch for {', '.join(bad)}")
        if self.extra:
            raise TransferError(f"{self.extra} bytes more than the manifest announced")


def default_output(run: str, step: int) -> str:
    return f"dflash-{run}-step{step}"


def exports_home(target: str) -> Path:
    """Where an export lands without -o: $DFLASH_OPS_HOME/exports/TARGET (~/.dflash-ops/...),
    outside any checkout, so a deploy never ships a drafter back to the target."""
    return Path(os.environ.get("DFLASH_OPS_HOME", Path.home() / ".dflash-ops")) / "exports" / target


def export(inv: Inventory, target: Target, run: str = "latest", *, output: str | None = None,
           step: int | None = None, dtype: str = "bfloat16", force: bool = False, running_ok: bool = False,
           target_changed_ok: bool = False, progress: Progress | None = None,
           session: Session | None = None, hold: Hold | None = None) -> ExportResult:
    """Export RUN (default: the newest succeeded run) at `step` (default: its last checkpoint) and
    write the folder to `output` (default: exports_home(TARGET)/dflash-RUN-stepN). Raises NotFound for no such run.
    running_ok and target_changed_ok go to the target's export (docs/export.md); force replaces an
    existing output folder here. hold: the agent's held stdin, for a caller that ends the export from
    another thread (play's interrupt: hold.end(...)); by default its own."""
    if dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}")
    if step is not None and step < 0:
        raise UsageError("--step must be >= 0")
    if output is not None:
        check_output(output, force, target)
    if output is None:
        exports_home(target.name).mkdir(parents=True, exist_ok=True)
    where = Path(output).expanduser().resolve().parent if output else exports_home(target.name)
    if not where.is_dir():
        raise UsageError(f"-o {output}: the folder {where} does not exist")
    sweep_partials(where)
    partial = where / f"{PARTIAL}{os.getpid()}-{time.monotonic_ns()}"
    args = ["export", target.workdir] + (["--step", str(step)] if step is not None else []) + \
        ["--dtype", dtype] + ["--running-ok"] * running_ok + ["--target-changed-ok"] * target_changed_ok + ["--", run]
    start = time.monotonic()
    recv, hold = _Receiver(partial, progress, target.name), hold or Hold()
    try:
        with owned_session(inv, session) as s:
            r = agent_call.stream(s.transport(target), target, agent_call.RUNS, args, what="export the drafter",
                             stdout=recv, timeout=TIMEOUT_S, stdin=hold)
        recv.close()
        head = recv.header
        if head is None:
            raise StepFailed(target.name, "export the drafter", r.exit_code, "the agent sent no header")
        try:
            agent_call.reply(target, head)
        except agent_call.Refused as e:
            raise refusal(target, run, e) from None
        recv.check()
        dest = Path(output).expanduser() if output else where / default_output(head["run"], head["step"])
        _check_dest(dest, force)
        _move_into_place(partial, dest)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        size = sum(int(f.get("size", 0)) for f in recv.files)
        raise OpsError(f"{target.name}: export into {where}: disk full ({e.strerror}; the drafter is {size:,} bytes); "
                       "the partial folder was removed: free space there or pass another -o") from None
    except StepFailed as e:
        if e.exit_code_remote not in (128 + 9, 128 + 15):
            raise
        killed = e.exit_code_remote == 128 + 9      # the OOM killer, `stop --force`; SIGTERM: its cleanup ran
        how = "killed" if killed else "ended by SIGTERM"
        raise OpsError(f"{target.name}: the export's agent on the target was {how} "
                       f"(exit {e.exit_code_remote}); nothing written in {where}; its worker ended with it"
                       + ("; the next export removes what it left there" if killed else "")) from None
    except KeyboardInterrupt as e:      # Ctrl-C, or SIGTERM as errors.Terminated (ui.sigterm_raises)
        signum = signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT
        end = ("it had not started on the target" if hold.state == Hold.WAITING else
               "the export on the target ended" if hold.ended else
               f"the target did not confirm its end within {hold.grace_s:g} s; it ends when it sees the connection "
               "gone")
        raise Interrupted(signum, f"{target.name}: export interrupted ({signum.name}): nothing written in {where}; "
                                  f"{end}") from None
    finally:
        recv.close()
        shutil.rmtree(partial, ignore_errors=True)
    return ExportResult(target=target.name, run=head["run"], step=head["step"], output=str(dest), dtype=dtype,
                        files=recv.got, bytes=sum(f["size"] for f in recv.got), checkpoint=head.get("checkpoint"),
                        mask_token_id=head.get("mask_token_id"), target_layer_ids=head.get("target_layer_ids"),
                        running=bool(head.get("running")), target_changed=head.get("target_changed") or [],
                        seconds=round(time.monotonic() - start, 3))


def refusal(target: Target, run: str, refused: agent_call.Refused, verb: str = "export") -> OpsError:
    """The runs agent's refusal of RUN (export's, or bench-decode's before its own) in the user's
    words; `verb`: what the user wanted done with the run."""
    t, head = target.name, refused.doc
    if refused.reason == "not_found":
        if run in ("", "latest"):
            if head.get("any_runs"):
                return NotFound(f"{t}: no succeeded run in {target.workdir}/runs to {verb}; name one "
                                f"(`dflash-ops status {t}`)")
            return NotFound(f"{t}: no runs yet in {target.workdir}/runs; start one with `dflash-ops launch {t}`")
        return NotFound(f"{t}: no run {run!r} (see `dflash-ops status {t}`)")
    if refused.reason == "running":
        return UsageError(f"{t}: run {head.get('run')}: {head.get('message')}")
    if refused.reason == "no_release":
        return OpsError(f"{t}: {head.get('message')}; run `dflash-ops deploy {t}` first")
    msg = f"{t}: run {head.get('run')}: cannot export: {head.get('message')}"
    return UsageError(msg) if head.get("exit_code") == 2 else OpsError(msg)


PARTIAL = ".dflash-export.partial-"


def unsafe_output(dest: Path, target: Target) -> str | None:
    """Why `dest` may not be an export's -o even with --force (which moves what is there aside and
    removes it): `/`, the current folder or a folder holding it, a folder holding a local target's
    workdir (its runs). None when it may."""
    out = Path(os.path.abspath(dest.expanduser()))   # `..` resolved as typed, symlinks below as they are
    real = dest.expanduser().resolve()
    cwd = Path.cwd().resolve()
    if real == Path(real.anchor):
        return "is the root folder; name a folder of its own"
    if cwd == real or real in cwd.parents or cwd == out or out in cwd.parents:
        return f"is the current folder or holds it ({cwd}); name a folder of its own"
    if target.is_local:
        work = Path(os.path.expanduser(target.workdir)).resolve()
        if work == real or real in work.parents:
            return f"holds {target.name}'s workdir {work} (its runs); name a folder of its own"
    return None


def check_output(output: str, force: bool, target: Target) -> None:
    """UsageError where -o OUTPUT may not be written: unsafe_output's places, an existing folder
    without --force, or with it one that is not an earlier export. Export checks it before anything
    travels; `play` before its first step."""
    if why := unsafe_output(Path(output), target):
        raise UsageError(f"-o {output}: {why}")
    _check_dest(Path(output), force)


def sweep_partials(where: Path) -> list[str]:
    """Remove the hidden folders in `where` that exports killed midway left (PARTIAL + the pid of a
    process no longer running); one whose writer still runs is its own. Returns the names removed."""
    gone: list[str] = []
    try:
        names = os.listdir(where)
    except OSError:
        return gone
    for name in names:
        if not name.startswith(PARTIAL):
            continue
        pid = name[len(PARTIAL):].partition("-")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(where / name, ignore_errors=True)
        gone.append(name)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:     # another user's process: alive
        return True
    return True


def _check_dest(dest: Path, force: bool) -> None:
    """An existing -o is replaced only with --force, and only when it is an earlier export."""
    dest = dest.expanduser()
    if not os.path.lexists(dest):
        return
    if not force:   # empty or not
        raise UsageError(f"-o {dest}: already exists (pass --force to replace an earlier export)")
    if why := not_an_export(dest):
        raise UsageError(f"-o {dest}: {why}; nothing was replaced: export into a new folder instead, e.g. "
                         f"-o {dest / 'dflash-export'}")


def _move_into_place(partial: Path, dest: Path) -> None:
    """Rename the checked folder to dest; an existing dest (an earlier export, --force) is moved aside
    first and removed after, so dest is never a mix of the two (trainer/files.py, swap_in)."""
    try:
        swap_in(partial, dest, not_an_export)
    except NotOurs as e:    # it changed since the check before the transfer
        raise UsageError(f"-o {e}") from None


__all__ = ["export", "refusal", "ExportResult", "TransferError", "default_output", "exports_home", "DTYPES",
           "unsafe_output", "check_output", "sweep_partials"]
