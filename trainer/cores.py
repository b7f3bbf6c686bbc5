"""The CPU cores a job may use, and how torch's threads share them: this process's cores (its affinity),
the cores other work keeps busy now, torch's intra-op threads for a one-process CPU job and for K worker
threads on the CPU, and OpenMP's idle threads made to sleep. Used by regen, the small target's build
(cpu_shards), the trainer's CPU workers and the probe. Importing this module does not import torch.
"""
from __future__ import annotations

import os
import time


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # not on Linux
        return os.cpu_count() or 1


def passive_waits() -> None:
    """Idle OpenMP threads sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE, unless set): on a
    machine that other work also loads, spinning threads take the cores the working ones need, and
    regen and specdec slow down several times over (docs/decisions.md has the figures). OpenMP reads
    it once, when torch loads it: call before torch is imported."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def busy_cores(window: float = 0.3) -> float:
    """How many of this process's cores other work keeps busy NOW: the busy share of the cores in
    /proc/stat over `window` seconds (busy: user, nice, system, irq, softirq, steal; free: idle and
    iowait), times the cores this process may run on (cores(): its affinity, which a container's
    cpuset narrows while /proc/stat may still count the host's). Not the load average: its
    one-minute mean still counts work that just ended (the venv's install before a first demo, the
    probe before the build), which made a quiet machine look busy. Off Linux: the one-minute
    load average."""
    def sample() -> list[int] | None:
        try:
            with open("/proc/stat") as f:
                return [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None

    a = sample()
    if a is not None:
        time.sleep(window)
        b = sample()
        if b is not None and (busy := busy_between(a, b, cores())) is not None:
            return busy
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def busy_between(a: list[int], b: list[int], n_cpus: int) -> float | None:
    """Busy cores of n_cpus between two samples of /proc/stat's `cpu` line (user, nice, system, idle,
    iowait, irq, softirq, steal: summed over the machine's cpus): the busy share times n_cpus; None
    when no time passed."""
    d = [y - x for x, y in zip(a, b)]
    total, free = sum(d), d[3] + d[4]       # idle, iowait
    return (total - free) / total * n_cpus if total > 0 else None


def free_cores(busy: float | None = None, n_cores: int | None = None) -> int:
    """The cores not taken by other work: this process's cores less the cores busy now (busy_cores,
    rounded), at least one. busy/n_cores: for tests (default: busy_cores(), cores())."""
    busy = busy_cores() if busy is None else busy
    n_cores = cores() if n_cores is None else n_cores
    return max(1, min(n_cores, n_cores - round(busy)))


def threads_from_free_cores() -> str:
    """torch's intra-op threads for a one-process CPU job (regen; the small target's build shards its
    steps instead, trainer/run/cpu_shards.py): the cores free now (free_cores), unless OMP_NUM_THREADS
    says; returns the line that says so."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return f"{torch.get_num_threads()} CPU thread(s) (OMP_NUM_THREADS)"
    busy = busy_cores()
    n = free_cores(busy)
    torch.set_num_threads(n)
    return f"{n} CPU thread(s): {cores()} cores, {busy:.1f} busy with other work"


def share_cpu(workers: int) -> int:
    """Give each of `workers` threads training on the CPU its own share of the cores, as torch's
    intra-op thread count (process-wide), and return it. By default every thread that calls into
    ATen leads an OpenMP team as wide as the machine, and idle OpenMP threads spin: K workers on
    C cores run K x C spinning threads (docs/decisions.md, the probe). An explicit
    OMP_NUM_THREADS is left alone."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    n = max(1, cores() // max(1, int(workers)))
    torch.set_num_threads(n)
    return n


def training_threads(asked: int, cpu_workers: int) -> str | None:
    """Set torch's intra-op threads for a training run, and return the line to log where the rule, not
    the user, chose one thread. `asked` (--cpu-threads N, 0 for auto) wins wherever the run trains.
    Auto, with `cpu_workers` worker threads training on the CPU (0: on GPUs, torch's default stays):
    K > 1 share the cores (share_cpu); one worker gets one thread, since a second intra-op thread's
    spinning waits lose several-fold on a machine whose cores other work shares (docs/benchmarks.md,
    "CPU figures"), and more are only used when asked for."""
    import torch

    if asked:
        torch.set_num_threads(asked)
    elif cpu_workers > 1:
        share_cpu(cpu_workers)
    elif cpu_workers == 1:
        torch.set_num_threads(1)
        return ("torch threads 1 on the CPU (--cpu-threads 0, auto: a busy machine's cores are not this run's "
                "alone; --cpu-threads N asks for more)")
    return None
