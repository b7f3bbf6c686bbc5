"""The fan-out over targets: fn(target) for every target in parallel, each target's outcome kept (its
value, or the OpsError that stopped only it), in the order the targets were given (Fabric's
GroupResult)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

from orchestrator.errors import SIGNAL_POLL_S, OpsError, TargetsFailed
from orchestrator.inventory import Target

MAX_WORKERS = 16
T = TypeVar("T")


@dataclass
class Outcome(Generic[T]):
    """One target's result: its value, or the error that stopped it."""
    target: str
    value: T | None = None
    error: OpsError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class GroupResult(dict):
    """{target name: Outcome}, in the order the targets were given (Fabric's GroupResult)."""

    @property
    def failures(self) -> dict[str, str]:
        return {name: o.error.render() for name, o in self.items() if o.error is not None}

    def raise_failures(self) -> None:
        """TargetsFailed naming every target that failed, once all have been reported."""
        if self.failures:
            raise TargetsFailed(self.failures)


def fan_out(targets: Sequence[Target], fn: Callable[[Target], T], *,
            max_workers: int = MAX_WORKERS, interrupted: Callable[[], None] | None = None) -> GroupResult:
    """fn(target) for every target in parallel. An OpsError stops only its own target (kept in
    its Outcome); anything else is a bug and propagates. interrupted: called when the caller's
    thread is interrupted (Ctrl-C, errors.Terminated) while the targets' calls run, to end them (close
    their connections) before the interruption goes on: the workers are waited for, and a call left
    running would hold the controller until its own timeout."""

    def one(target: Target) -> Outcome:
        try:
            return Outcome(target.name, value=fn(target))
        except OpsError as e:
            return Outcome(target.name, error=e)

    group = GroupResult()
    if not targets:
        return group
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(targets)))) as pool:
        futures = [pool.submit(one, t) for t in targets]
        try:
            for future in futures:
                # in slices: the main thread must run the handler of a signal another thread took
                # (errors.wait_for_event says why)
                while not wait([future], timeout=SIGNAL_POLL_S).done:
                    pass
                outcome = future.result()
                group[outcome.target] = outcome
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)      # the calls not started yet never start
            if interrupted is not None:
                interrupted()
            raise
    return group


__all__ = ["MAX_WORKERS", "Outcome", "GroupResult", "fan_out"]
