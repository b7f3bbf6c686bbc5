"""`deploy`: incremental, atomic code sync into each target's WORKDIR.

Per target, over one connection: `pct status` (pct targets), one round trip for the live
release's manifest and the target's python/torch versions, then (only if something changed)
one tar stream of the changed files into the release agent, which builds the new release from
the live one plus the changes and flips `WORKDIR/current` atomically.
"""
from __future__ import annotations

import getpass
import hashlib
import io
import json
import os
import socket
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

from orchestrator.ssh import agent_call
from orchestrator.ssh import fanout
from orchestrator.ssh.session import owned_session
from orchestrator.deploy import fileset
from orchestrator.errors import OpsError, UsageError
from orchestrator.inventory import Inventory, Target
from orchestrator.lines import LineBuffer
from orchestrator.ssh.session import Session
from orchestrator.ssh.transport import Transport

# (target, total bytes) -> update(n), or None: no progress shown for that transfer (a small one)
Progress = Callable[[str, int], Callable[[int], None] | None]


@dataclass(frozen=True)
class Source:
    root: Path
    files: list[str]
    manifest: dict[str, list]
    sparse: dict[str, int] = field(default_factory=dict)   # a file mostly holes -> its bytes on disk
    left_out: dict[str, str] = field(default_factory=dict)  # a folder the tool wrote -> what it is (never shipped)

    @property
    def total_bytes(self) -> int:
        return sum(m[1] for m in self.manifest.values())


def is_checkout(path: Path) -> bool:
    try:
        text = (path / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False
    return 'name = "dflash-ops"' in text and (path / "trainer").is_dir()


def source_root(explicit: str | None) -> tuple[Path, Path]:
    """(root, folder whose files ship): --source DIR, else the current directory when it is a
    dflash-ops checkout; anywhere else deploy refuses (shipping whatever happened to be installed
    would replace the live release's files without a word). Cheap: deploy calls it before
    connecting, so a bad --source fails at once."""
    if explicit:
        root = Path(explicit).expanduser()
        if not root.is_dir():
            raise UsageError(f"--source {explicit}: not a folder")
        return root, root
    if is_checkout(Path.cwd()):
        return Path.cwd(), Path.cwd()
    trainer = Path(str(resources.files("trainer").joinpath("__init__.py"))).parent
    raise UsageError(f"{Path.cwd()} is not a dflash-ops checkout: run deploy from one, or say what to ship "
                     f"with --source DIR (the installed trainer: --source {trainer.parent})")


def scan_source(root: Path, folder: Path, all_files: bool = False) -> Source:
    """The file set under folder (fileset.collect) and its content-hash manifest (paths relative to root)."""
    prefix = folder.relative_to(root).as_posix() if folder != root else ""
    found, left = fileset.without_outputs(folder.resolve(), fileset.collect_all(folder, all_files))
    files = [f"{prefix}/{f}" if prefix else f for f in found]
    if not files:
        raise UsageError(f"nothing to deploy in {root}")
    return Source(root.resolve(), files, fileset.manifest(root, files, fileset.hash_cache_path(root)),
                  sparse_files(root, files), {f"{prefix}/{k}" if prefix else k: v for k, v in left.items()})


SPARSE_MIN = 1 << 20     # a file of at least this many bytes, less than half of them on disk, is sparse


def sparse_files(root: Path, files: list[str]) -> dict[str, int]:
    """{file: bytes on disk} of the sparse files: they travel in full, holes as zeros (a tar stream
    of regular members), and take their whole size on the target; deploy says so."""
    found, base = {}, str(root)
    for f in files:
        try:
            st = os.stat(f"{base}/{f}")
        except OSError:
            continue
        if st.st_size >= SPARSE_MIN and st.st_blocks * 512 < st.st_size // 2:
            found[f] = st.st_blocks * 512
    return found


def plan(local: dict[str, list], remote: dict[str, list]) -> tuple[list[str], list[str]]:
    """(files to send, files that disappear): pure, by content hash and executable bit."""
    changed = [p for p, m in local.items() if remote.get(p) != m]
    deleted = [p for p in remote if p not in local]
    return sorted(changed), sorted(deleted)


def release_id(manifest: dict[str, list], now: float | None = None) -> str:
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:8]
    now = time.time() if now is None else now
    # Microseconds keep ids in creation order, which is what pruning sorts by.
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}"
    return f"{stamp}-{digest}"


class DeployRefused(OpsError):
    """The target said no: another deploy holds its lock, or the release does not fit (exit 1)."""


class SourceChanged(OpsError):
    """A file changed size between hashing and sending; the next deploy picks up its new content."""


class _Exact:
    """Reads exactly `size` bytes of an open file for the tar, or raises SourceChanged."""

    def __init__(self, f, size: int, path: Path):
        self.f, self.left, self.path = f, size, path

    def read(self, n: int = -1) -> bytes:
        want = self.left if n < 0 else min(n, self.left)
        data = self.f.read(want)
        if len(data) < want:     # a regular file reads short only at its end
            raise SourceChanged(f"{self.path} shrank while it was being sent; deploy again")
        self.left -= len(data)
        return data


def build_tar(source: Source, changed: list[str]):
    """The changed files plus the full manifest as one uncompressed tar (spooled to disk past 64 MiB).

    Each file goes as a regular file of the size it was hashed at, read through symlinks (the
    file set only keeps links to files inside the tree); a file that shrank since is an error
    naming it, one that changed content is caught by the agent's hash check."""
    import tarfile       # here: a deploy that changes nothing never needs it

    spool = tempfile.SpooledTemporaryFile(max_size=64 << 20)
    with tarfile.open(fileobj=spool, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for rel in changed:
            path = source.root / rel
            info = tarfile.TarInfo(rel)
            info.size = source.manifest[rel][1]
            info.mode = 0o755 if source.manifest[rel][2] else 0o644
            try:
                with open(path, "rb") as f:
                    info.mtime = os.fstat(f.fileno()).st_mtime
                    tar.addfile(info, _Exact(f, info.size, path))
            except OSError as e:
                raise SourceChanged(f"{path}: cannot read it to send: {e.strerror or e}") from None
        data = json.dumps(source.manifest).encode()
        info = tarfile.TarInfo(fileset.MANIFEST_NAME)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    size = spool.tell()
    spool.seek(0)
    return spool, size


class _Counting:
    def __init__(self, f, update: Callable[[int], None] | None):
        self.f, self.update = f, update

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        if data and self.update:
            self.update(len(data))
        return data


@dataclass
class TargetResult:
    target: str
    ok: bool = False
    release: str | None = None
    previous: str | None = None
    files_sent: int = 0
    bytes_sent: int = 0
    files_deleted: int = 0
    unchanged: bool = False
    dry_run: bool = False
    python: str | None = None
    torch: str | None = None
    changed: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)   # missing or damaged in the live release, sent again
    sparse: dict[str, list] = field(default_factory=dict)   # a sparse file sent: [size, bytes on disk here]
    left_out: dict[str, str] = field(default_factory=dict)  # the tool's own outputs in the source, not shipped
    pruned: list[str] = field(default_factory=list)
    deps: dict | None = None
    seconds: float = 0.0
    error: str | None = None

    def as_json(self) -> dict:
        return asdict(self)


def deploy_target(session: Session, target: Target, get_source: Callable[[], Source], *,
                  dry_run: bool = False, install_deps: bool = False, verify: bool = False,
                  progress: Progress | None = None,
                  on_line: Callable[[str, str], None] | None = None) -> TargetResult:
    """One target: read its live manifest (checked against the files there), send what changed
    or is damaged, flip `current`. get_source waits for the local file set, so hashing it
    overlaps the remote read. Planned again once when another deploy flipped `current` between
    the read and the build."""
    start = time.monotonic()
    res = TargetResult(target.name, dry_run=dry_run)
    t = session.transport(target)
    for attempt in (1, 2):
        args = ["manifest", target.workdir] + (["--verify"] if verify else []) + ([] if dry_run else ["--tidy"])
        live = agent_call.call(t, target, agent_call.RELEASE, args, what="read the live release")
        source = get_source()
        res.python, res.torch, res.previous = live["python"], live["torch"], live["release"]
        res.repaired = list(live.get("damaged") or [])
        changed, deleted = plan(source.manifest, live["manifest"] if live["release"] else {})
        res.changed, res.deleted = changed, deleted
        res.files_deleted = len(deleted)
        res.bytes_sent = sum(source.manifest[p][1] for p in changed)
        res.files_sent = len(changed)
        res.sparse = {p: [source.manifest[p][1], source.sparse[p]] for p in changed if p in source.sparse}
        res.left_out = dict(source.left_out)
        if dry_run:
            res.release, res.ok = live["release"], True
        elif live["release"] and not changed and not deleted:
            res.release, res.unchanged, res.ok = live["release"], True, True
        else:
            try:
                # a transport of its own, checked (PctTransport verify): a container that goes down under the
                # build is said as such (ContainerError), not as the agent's exit 137
                out = _apply(session.transport(target), target, source, changed, live["release"] or "",
                             res.bytes_sent, progress)
            except agent_call.Refused as e:
                if e.reason == "moved" and attempt == 1:
                    continue
                raise
            res.release, res.pruned, res.ok = out["release"], out["pruned"], True
        break
    if install_deps and not dry_run:
        # pip's lines, as they come, to on_line (a minute of installing is not silence)
        lines = LineBuffer(lambda line: on_line(target.name, line)) if on_line else None
        res.deps = agent_call.call(t, target, agent_call.RELEASE, ["install-deps", target.workdir],
                              what="install requirements", stderr=lines)
        if lines:
            lines.flush()
    res.seconds = round(time.monotonic() - start, 3)
    return res


def _apply(t: Transport, target: Target, source: Source, changed: list[str], base: str, need: int,
           progress: Progress | None) -> dict:
    rid = release_id(source.manifest)
    spool, size = build_tar(source, changed)
    update = progress(target.name, size) if progress else None
    with spool:
        try:
            args = ["apply", target.workdir, rid, base, f"{need}:{len(changed)}", _who()]   # BYTES:FILES
            return agent_call.call(t, target, agent_call.RELEASE, args, stdin=_Counting(spool, update),
                              what="build the release")
        except agent_call.Refused as e:
            if e.reason in ("locked", "no_space"):   # in the agent's own words
                raise DeployRefused(f"{target.name}: {e.doc.get('message')}") from None
            raise


def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        user = "?"
    return f"{user}@{socket.gethostname()}"


def deploy(inventory: Inventory, names: list[str], *, source: str | None = None, dry_run: bool = False,
           install_deps: bool = False, verify: bool = False, progress: Progress | None = None,
           session: Session | None = None, on_line: Callable[[str, str], None] | None = None,
           all_files: bool = False) -> dict[str, TargetResult]:
    """Deploy to every named target in parallel; one result per target. on_line(target, line):
    pip's output while it installs the requirements. all_files: every file of the source, not only
    what git tracks or would (fileset.collect)."""
    targets = inventory.select(names)
    where = source_root(source)
    # The local files are hashed while the targets connect and read their live manifests (the
    # remote side is mostly waiting); a target waits for the hashes when it needs them.
    with ThreadPoolExecutor(max_workers=1) as hasher, owned_session(inventory, session) as s:
        src: Future = hasher.submit(scan_source, *where, all_files)
        group = fanout.fan_out(targets, lambda target: deploy_target(
            s, target, src.result, dry_run=dry_run, install_deps=install_deps, verify=verify,
            progress=progress, on_line=on_line))
    failed = src.exception()
    if failed is not None:     # the source itself is bad: the whole command fails
        raise failed
    return {name: o.value if o.ok else TargetResult(name, error=o.error.render())
            for name, o in group.items()}
