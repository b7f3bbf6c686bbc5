"""`--topology processes`: one process per device under torchrun, the drafter in DDP.

    python -m trainer --topology processes --gpus N ...      (or --gpus 0 --workers K on CPU)

That command is the launcher: it checks the flags, then runs torchrun's own launcher in-process
(`torch.distributed.run`, --standalone, nproc = N or K) on `python -m trainer` with the same
settings, so users and `dflash-ops launch` need not know torchrun. Each child sees torchrun's
environment (LOCAL_RANK, WORLD_SIZE, ...) and runs one rank (`rank_main`).

A rank runs the same model, loss, data and loop (trainer/train/loop.py) as the threaded trainer: every
rank builds the same global batch and takes its shard; DDP (gloo on CPU, NCCL on GPU) SUMS the
gradients (a comm hook: each shard's loss is already divided by the global batch weight, as in
threads), so the two topologies compute the same update. CUDA-graph policies are allowed here:
each process has its own CUDA Graph Trees state. Compilation is not serialized across ranks (they
are separate processes; they share only the on-disk Inductor caches).

Logs: on one node rank 0's stdout is the run's log exactly as in threads ([trainer] lines and JSON
metrics); every other line a rank writes (rank 0's stderr, everything from ranks 1..N-1) is
prefixed `[rankN]: `. With several nodes rank 0's stdout is prefixed too (`[rank0]: `): the
node's launcher and torchrun write unprefixed lines into the same log, and `logs` labels each
line with its node and rank. Only rank 0 writes metrics and evaluates; rank 0 writes checkpoints, and with several
nodes the first rank of each other node writes the same checkpoint into its own node's --out.

Several nodes (--nnodes K, one launcher per node, the same --rdzv-endpoint and --rdzv-id, one node
with --rdzv-host): torchrun's c10d rendezvous joins them into one world of K x N ranks; every node
writes OUT/node.json (its node rank, its ranks) since the rendezvous decides which node gets rank 0.
Failures: the rank entry is wrapped in torch's @record, so a rank's exception lands in its error
file and torchrun names it as the root cause; the launcher prints torchrun's summary and exits with
the failing rank's status (1 failure, 2 bad input, 128+N for a signal).
SIGTERM to the launcher: torchrun forwards it to every rank; the ranks agree at the next step
boundary (one tiny all-reduce per step), rank 0 writes a checkpoint, all exit 143, and so does the
launcher; a rank that reaches no step boundary within its grace exits 143 without one. If the
launcher dies, the ranks get SIGTERM too (PR_SET_PDEATHSIG). With several nodes the job ends as one:
the first rank that fails anywhere ends every other within seconds (exit 3; trainer/train/job_watch.py).
"""
from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import fields
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from trainer import policies
from trainer.run import checkpoint
from trainer.exits import exit_process, in_rank
from trainer.files import atomic_file
from trainer.run.config import TrainConfig
from trainer.errors import EXIT_PEER_FAILED, UsageError
from trainer.run.log import QuietLog
from trainer.engine.ranks import RankEngine, device_barrier, wrap_ddp
from trainer.engine.step import Replica, build_replica
from trainer.train import loop, setup
from trainer.train.grace import StopGrace
from trainer.train.job_watch import describe, record_failures, watch_rank

# torchrun waits this long for the ranks to checkpoint and exit after forwarding SIGTERM, then
# SIGKILLs them (its default is 30 s: too short to save a 1B-parameter drafter's optimizer state).
# Read by torch >= 2.10 (TORCH_ELASTIC_SHUTDOWN_TIMEOUT); older torchrun keeps its 30 s.
SHUTDOWN_TIMEOUT_S = "300"
# How long a rank waits for the other ranks to connect the process group's mesh (gloo's full mesh);
# DFLASH_MESH_TIMEOUT_S in the environment (`launch --env`) changes it.
MESH_TIMEOUT_S = 120.0
# torch's own timeout for the mesh comes this much later, so the line that ends a rank is ours, which
# says what to check, not torch's store error racing it.
MESH_MARGIN_S = 10.0
# How long a rank that failed waits for the job's watch to name an earlier failure elsewhere (its own
# is then a consequence: a collective whose peer died) before its own error ends it.
FAILURE_SEEN_S = 3.0


def main(cfg: TrainConfig) -> int:
    if not in_rank():
        return launch(cfg)
    code = rank_main(cfg)
    # None: @record turned a SystemExit(0) into a return; exit_process needs the 0 (os._exit in a rank)
    return 0 if code is None else code


# ---- the launcher ---------------------------------------------------------------------------------

def launch(cfg: TrainConfig) -> int:
    """Run torchrun on `python -m trainer` with cfg's settings; returns the run's exit status."""
    # Cheap checks here, so bad input is one line before any process starts.
    device = setup.devices_for(cfg)[0]
    setup.resolve_policy(cfg, device)
    setup.open_run(cfg, writer=False)
    nproc = cfg.n_devices
    logs = Path(cfg.out) / "torchelastic"  # torchrun's per-rank error files (@record) land here
    logs.mkdir(parents=True, exist_ok=True)
    args = [*rendezvous_argv(cfg), f"--nproc_per_node={nproc}", f"--log_dir={logs}",
            "--module", "trainer", *config_argv(cfg)]
    # The ranks must import this same trainer, wherever the launcher was started from.
    root = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.cpu_threads or 1))  # else torchrun sets 1 and warns
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S)
    print(f"[trainer] topology processes: torchrun {' '.join(rendezvous_argv(cfg))} --nproc-per-node {nproc} "
          f"-m trainer (ranks' errors in {logs})", flush=True)

    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    # torchrun installs its own handlers (SIGTERM -> forward to the ranks); put ours back after.
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    job = None
    try:
        try:
            with record_failures(cfg) as job:   # several nodes: the job's first failure ends every node's ranks
                torchrun.run(torchrun.parse_args(args))
            return 0
        finally:
            # From here on a SIGTERM must not kill the launcher. With several nodes, a stop that
            # reaches another node first ends this node's ranks too (all ranks agree on it at a step
            # boundary and exit 143), torchrun returns, and this node's own SIGTERM lands after it:
            # dying of it would record the run's end as a signal instead of the ranks' 143.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except SignalException as e:
        print(f"[trainer] {e.sigval.name}: the ranks were told to checkpoint and stop", flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        if job is not None and job.ended_by_peer(e.failures):   # its SIGKILL, for another node's failure
            print(f"[trainer] {describe(job.failure)}: this node's ranks were ended for it (exit {EXIT_PEER_FAILED})",
                  file=sys.stderr, flush=True)
            return EXIT_PEER_FAILED
        code = child_exit_code([f.exitcode for f in e.failures.values()], e.get_first_failure()[1].exitcode)
        if code == 143:   # a stop that reached another node first (above): not a failure
            print("[trainer] SIGTERM on another node: the ranks checkpointed and stopped", flush=True)
        else:
            print(str(e), file=sys.stderr, flush=True)
        return code
    except RendezvousConnectionError as e:   # several nodes: the node hosting the rendezvous ended
        print(f"[trainer] torchrun lost the rendezvous store at {cfg.rdzv_endpoint} (the node hosting it "
              f"ended): {e}", file=sys.stderr, flush=True)
        return EXIT_PEER_FAILED
    finally:
        for s, h in saved.items():
            if s != signal.SIGTERM or not loop.owns_process():   # a late SIGTERM stays harmless to the end
                signal.signal(s, h)


def rendezvous_argv(cfg: TrainConfig) -> list[str]:
    """How this node finds the others. One node: --standalone. Several: torchrun's c10d rendezvous at
    --rdzv-endpoint, hosted by the node given --rdzv-host (said explicitly: torchrun's own guess compares
    the endpoint with the addresses the hostname resolves to, which in a container is not the training
    network's). --local-addr is the address the other nodes reach this one at: rank 0's node serves the
    process group's store there (torchrun would otherwise advertise its FQDN, which other nodes may
    not resolve). Node ranks follow the sorted --local-addr values, so rank 0 need not be the host."""
    if cfg.nnodes <= 1:
        return ["--standalone", "--nnodes=1"]
    return [f"--nnodes={cfg.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={cfg.rdzv_endpoint}",
            f"--rdzv-id={cfg.rdzv_id}", f"--rdzv-conf=is_host={'1' if cfg.rdzv_host else '0'}",
            f"--local-addr={cfg.node_address}", "--max-restarts=0"]


def config_argv(cfg: TrainConfig) -> list[str]:
    """Flags that reproduce cfg (every non-default value, as --name=value)."""
    argv = []
    for f in fields(TrainConfig):
        v = getattr(cfg, f.name)
        if v == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            argv.append(flag)  # store_true flags: a non-default bool is True
        else:
            argv.append(f"{flag}={v}")
    return argv


def child_exit_code(codes: list[int], first: int) -> int:
    """The run's status from the ranks': all SIGTERM'd -> 143; else the first failure's (a signal as 128+N)."""
    if codes and all(c in (143, -signal.SIGTERM) for c in codes):
        return 143
    return first if first > 0 else 128 - first if first < 0 else 1


# ---- a rank ---------------------------------------------------------------------------------------

@record
def rank_main(cfg: TrainConfig) -> int:
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    _prefix_output(rank, several_nodes=cfg.nnodes > 1)
    _die_with_parent()
    if world != cfg.n_devices * cfg.nnodes:
        raise UsageError(f"torchrun started {world} processes but the settings ask for {cfg.n_devices} "
                         f"({'--gpus' if cfg.gpus else '--workers'}) on each of {cfg.nnodes} node(s); "
                         f"use --nproc-per-node {cfg.n_devices}")
    if local == 0:
        _write_node_record(cfg, rank, world)
    device = torch.device(f"cuda:{local}") if cfg.gpus else torch.device("cpu")
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise UsageError(f"rank {rank}: cuda:{local} does not exist ({torch.cuda.device_count()} visible)")
        torch.cuda.set_device(device)
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    # Until the mesh is formed SIGTERM keeps its default action: a rank blocked there (in C++, where
    # Python's handler would only run once the call returns) ends at once, with nothing to save. The
    # mesh gets MESH_TIMEOUT_S: every node has joined the rendezvous by now, so a peer that does not
    # connect within it has failed (gloo's default would wait 30 minutes).
    # Then one timeout for every collective: long enough for a rank to compile while the others wait
    # in the first step's all-reduce (and for rank 0 to make synthetic data or run an eval). A torch
    # without _set_pg_timeout uses that one for the mesh too.
    collectives = timedelta(seconds=max(60.0, cfg.warmup_timeout))
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    mesh = float(os.environ.get("DFLASH_MESH_TIMEOUT_S") or MESH_TIMEOUT_S)
    # With several nodes the job's first failure, wherever it happens, ends this rank from here on
    # (trainer/train/job_watch.py); after the mesh, so does a SIGTERM that finds no step boundary in time.
    job, restore_signal = watch_rank(cfg, rank), None
    try:
        with _deadline(mesh, f"rank {rank}: the process group's mesh did not form within {mesh:g} s (a rank on "
                             f"another node failed, or cannot reach this node's address)"):
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    timeout=timedelta(seconds=mesh + MESH_MARGIN_S) if set_timeout else collectives)
        if set_timeout:
            set_timeout(collectives)
        stop, restore_signal = loop.on_sigterm()
        grace = StopGrace(rank)
        with grace.watching():
            return _rank(cfg, rank, world, local, device, stop, grace, job)
    except Exception:
        if job is not None:   # a failure caused by another rank's (a collective or mesh that lost its peer):
            job.wait(FAILURE_SEEN_S)  # the watch ends this rank naming that one, unless none is recorded
        raise
    finally:
        if job is not None:
            job.disarm()
        if dist.is_initialized():
            dist.destroy_process_group()
        if restore_signal is not None:
            restore_signal()


@contextmanager
def _deadline(seconds: float, message: str):
    """End the process (exit 1, `message` on stderr) if the block runs longer than `seconds`. For a
    call blocked in C++ that its own timeout does not bound: gloo's side of a pair that waits for its
    peer to connect waited on (seen: 3 minutes past a 120 s timeout) while the peer had failed."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(seconds):
            print(f"[trainer] {message}", file=sys.stderr, flush=True)
            exit_process(1, finalize=False)
    threading.Thread(target=watch, name="dflash-deadline", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _rank(cfg: TrainConfig, rank: int, world: int, local: int, device: torch.device, stop, grace, job) -> int:
    """One rank's run; `local` is its rank on this node (LOCAL_RANK), 0 for the node's first."""
    writer = rank == 0
    # every node's first rank records the settings in its own --out (with its checkpoints, a node's
    # folder is then a complete run for `python -m trainer.export`)
    with setup.run_folder(cfg, writer=local == 0) as (out, resume_from):  # rank 0 is a first rank too
        log = setup.open_log(cfg, out) if writer else QuietLog()
        try:
            policy, why = setup.resolve_policy(cfg, device, out if writer else None)
            log.info(f"torch {torch.__version__} | {world} ranks on {device.type} | topology processes "
                     f"({dist.get_backend()}) | compile policy {policy}"
                     + (" (auto: from probe.json)" if cfg.compile_policy == "auto" else ""))
            if why:
                log.info(why)
            prep = setup.prepare(cfg, device, log, out, resume_from, stop, writer=writer,
                                 barrier=lambda: device_barrier(device),
                                 load_checkpoint=lambda path: _checkpoint_everywhere(path, rank, world),
                                 agree_min=lambda n: _least(n, device))

            def build() -> Replica:
                return build_replica(rank, device, prep.drafter, prep.target, policy=policy, n_devices=1, lr=cfg.lr,
                                     betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay,
                                     pos_weights=prep.pos_weights,
                                     optimizer_state=prep.ck.optimizer if prep.ck else None,
                                     wrap=lambda m: wrap_ddp(m, device),
                                     compile_target=policies.compiled_part(cfg.compile_target, policy, device),
                                     compile_update=policies.compiled_part(cfg.compile_update, policy, device),
                                     objective=prep.objective, muon=prep.muon)

            engine = RankEngine(build, rank, world, device, log, guard=not cfg.skip_compile_guard,
                                node_first=local == 0, grace=grace, job=job)
            if prep.ck is not None:
                checkpoint.restore_rng(prep.ck.rng)
            return loop.run_loop(cfg, engine, prep, log, stop)
        finally:
            log.close()


def _least(n: int, device: torch.device) -> int:
    """The least n over every rank (one all-reduce)."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _write_node_record(cfg: TrainConfig, rank: int, world: int) -> None:
    """OUT/node.json: which ranks this node runs. With several nodes, only one of them holds rank 0's
    metrics and checkpoints, and this is how a reader finds it (node ranks come from the rendezvous)."""
    doc = {"node_rank": int(os.environ.get("GROUP_RANK", "0")), "nnodes": cfg.nnodes, "world": world,
           "ranks": [rank, rank + cfg.n_devices - 1], "address": cfg.node_address or None,
           "rank0": rank == 0}
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_file(out / "node.json", sync=False) as f:
        f.write(json.dumps(doc) + "\n")


def _checkpoint_everywhere(path: Path | None, rank: int, world: int) -> checkpoint.Checkpoint | None:
    """The checkpoint every rank resumes from. Each node's first rank writes the checkpoints into that
    node's --out; a node may still lack the newest (it was added to the job, or its disk was wiped).
    Each rank says which step it has; when they differ, the newest checkpoint travels from the lowest
    rank that has it to all (one broadcast)."""
    have = int(json.loads((path / "meta.json").read_text())["step"]) if path is not None else -1
    steps: list = [None] * world
    dist.all_gather_object(steps, have)
    newest = max(steps)
    if newest < 0:
        return None
    if all(s == newest for s in steps):
        assert path is not None         # every rank has step `newest` >= 0
        ck = checkpoint.load(path)
        # every rank continues with rank 0's random state, as on one node where all read rank 0's folder
        box: list[Any] = [ck.rng if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)    # box[0]: rank 0's
        ck.rng = box[0]
        return ck
    src = steps.index(newest)
    sent: list[checkpoint.Checkpoint | None] = [checkpoint.load(path) if rank == src and path is not None else None]
    dist.broadcast_object_list(sent, src=src)
    return sent[0]


class _LinePrefixer(io.TextIOBase):
    """Writes whole lines only, each prefixed: one write per batch of lines, so lines of ranks
    sharing one log file never interleave mid-line."""

    def __init__(self, stream, prefix: str):
        self._stream, self._prefix, self._partial = stream, prefix, ""

    def write(self, text: str) -> int:
        self._partial += text
        if "\n" in self._partial:
            done, _, self._partial = self._partial.rpartition("\n")
            self._stream.write("".join(self._prefixed(line) + "\n" for line in done.split("\n")))
            self._stream.flush()
        return len(text)

    def _prefixed(self, line: str) -> str:
        # torch's own excepthook (init_process_group) already prefixes uncaught tracebacks
        return line if line.startswith(self._prefix) else self._prefix + line

    def flush(self) -> None:
        if self._partial:
            self._stream.write(self._prefixed(self._partial))
            self._partial = ""
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self):
        return getattr(self._stream, "encoding", "utf-8")

    def writable(self) -> bool:
        return True


def _prefix_output(rank: int, several_nodes: bool = False) -> None:
    """Rank 0's stdout stays the run's log (unprefixed, as in threads) on one node; every other
    stream, and with several nodes rank 0's stdout too, is `[rankN]: `."""
    sys.stdout = _LinePrefixer(sys.stdout, "" if rank == 0 and not several_nodes else f"[rank{rank}]: ")
    sys.stderr = _LinePrefixer(sys.stderr, f"[rank{rank}]: ")


def _die_with_parent() -> None:
    """SIGTERM this rank when its launcher dies (e.g. SIGKILLed): torchrun starts ranks in their own
    sessions, so a signal to the launcher's process group does not reach them."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
