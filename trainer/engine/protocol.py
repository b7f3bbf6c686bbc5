"""What an engine is: the methods the training loop (trainer/train/loop.run_loop) and the probe's
cases (trainer/probe/case.py) call, which both engines have. workers.ThreadEngine runs the replicas
in worker threads of one process (`--topology threads`), ranks.RankEngine is one torchrun rank's
replica in DDP (`--topology processes`); the loop drives either without knowing which.

mypy checks that both satisfy it (the assignments under TYPE_CHECKING at the end: a class whose
methods lack one of these, or take other arguments, is an error there), and checks the loop's and
the probe's calls against it. Under threads most of the collectives are no-ops (`agree` returns its
flag, `barrier` does nothing); under ranks every call marked "collective" below must be made at the
same point on every rank.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:     # types only: importing this module imports no engine (nor torch)
    from trainer.engine.step import Replica, ShardStats
    from trainer.engine.workers import StepOut
    from trainer.run.data import Batch

_T = TypeVar("_T")


class Stepped(Protocol):
    """A step's results: StepOut itself (ranks: read when step() returns) or a PendingStep (threads:
    the step is queued, and result() waits for its update)."""

    def result(self) -> StepOut:
        """The step summed over every shard; raises the step's TrainerError (a non-finite norm)."""
        ...


class Engine(Protocol):
    """The replicas of a run and the step that trains them, for run_loop and the probe."""

    @property
    def writer(self) -> bool:
        """This process logs metrics and evaluates (threads; rank 0)."""
        ...

    @property
    def saver(self) -> bool:
        """This process writes checkpoints (threads; rank 0 and the first rank of every other node)."""
        ...

    @property
    def primary(self) -> Replica:
        """The replica that evaluation and checkpoints read (worker 0's, or this rank's)."""
        ...

    @property
    def replicas(self) -> list[Replica]:
        """The replicas this process holds (one per worker; a rank's one)."""
        ...

    @property
    def size(self) -> int:
        """How many shards a batch is cut into: the workers, or the world's ranks."""
        ...

    def step(self, batch: Batch, step: int, lr: float, grad_clip: float, ahead: Batch | None = None) -> Stepped:
        """One training step on the global batch (collective); `ahead`, the next step's batch, is prefetched."""
        ...

    def settle(self) -> None:
        """Wait for the last step's update and check its norm, before anything reads the weights."""
        ...

    def compute(self, batch: Batch, host: bool = True, ahead: Batch | None = None) -> list[ShardStats]:
        """Forward + backward of this process's shards and the gradient sum (collective); no update."""
        ...

    def update(self, lr: float, grad_clip: float, step: int) -> float:
        """The optimizer update in every replica after compute(); the pre-clip gradient norm."""
        ...

    def run_each(self, fn: Callable[..., Any], per_worker_args: list[tuple]) -> list:
        """fn(replica, *args) for each replica this process holds, where that replica lives."""
        ...

    def check_replicas(self, step: int) -> None:
        """The replicas' weights bit-identical, else ReplicasDiverged (collective)."""
        ...

    def on_primary(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """fn(*args, **kwargs) where the primary replica lives (worker 0's thread; this rank)."""
        ...

    def agree(self, flag: bool) -> bool:
        """True on every rank when any rank's flag is (collective; a step boundary for SIGTERM's grace)."""
        ...

    def collectives_done(self) -> None:
        """No collective follows: this rank's end from here on is no failure of the job."""
        ...

    def excuse_until_boundary(self) -> None:
        """Others wait for one rank's work before the next boundary: no SIGTERM deadline meanwhile."""
        ...

    def own_work(self) -> AbstractContextManager[object]:
        """While this rank works alone (a checkpoint, an eval), SIGTERM's grace does not run out."""
        ...

    def barrier(self) -> None:
        """Every rank waits for the others (collective)."""
        ...

    def close(self) -> None:
        """Stop the workers (threads); nothing for a rank."""
        ...


if TYPE_CHECKING:     # mypy's proof that both engines are Engines (nothing runs here)
    from trainer.engine.ranks import RankEngine
    from trainer.engine.workers import ThreadEngine

    _threads: type[Engine] = ThreadEngine
    _ranks: type[Engine] = RankEngine
