"""Probe wall time: one target vs four targets at once, through the loopback sshd + pct stand-in.

    .venv/bin/python benchmarks/probe_bench.py [--policies eager] [--targets 4]

Every target is its own container (private filesystem) of the pct stand-in on this machine,
so the four probes share this machine's cores: the figure separates what the controller adds
(connections, fan-out) from what the probe programs themselves cost when they compete for CPU.
"""
from __future__ import annotations

import argparse
import time

from _harness import REPO, loopback_node


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", default="eager")
    ap.add_argument("--targets", type=int, default=4)
    args = ap.parse_args()
    from orchestrator import inventory
    from orchestrator.deploy import sync as deploy
    from orchestrator.probe import prober as probe

    names = [f"ct{200 + i}" for i in range(args.targets)]
    with loopback_node({n: 200 + i for i, n in enumerate(names)}, prefix="dflash-probe-bench-") as node:
        inv = inventory.load(str(node.inventory))
        res = deploy.deploy(inv, names, source=str(REPO))
        assert all(r.ok for r in res.values()), {n: r.error for n, r in res.items()}
        matrix = probe.Matrix(policies=tuple(args.policies.split(",")))
        probe.probe(inv, names[:1], matrix)          # warm caches (inductor, page cache)

        t0 = time.perf_counter()
        one = probe.probe(inv, names[:1], matrix)
        t_one = time.perf_counter() - t0
        t0 = time.perf_counter()
        many = probe.probe(inv, names, matrix)
        t_many = time.perf_counter() - t0
        assert one["targets"][names[0]]["ok"] and all(d["ok"] for d in many["targets"].values())
        inner_one = one["targets"][names[0]]["seconds"]
        inner_many = max(d["seconds"] for d in many["targets"].values())
        print(f"policies {args.policies}; machine: {len(__import__('os').sched_getaffinity(0))} cores\n")
        print("| case | wall s | slowest target's probe program s |")
        print("| --- | --- | --- |")
        print(f"| 1 target | {t_one:.1f} | {inner_one:.1f} |")
        print(f"| {args.targets} targets at once | {t_many:.1f} | {inner_many:.1f} |")
        print(f"\nratio {t_many / t_one:.2f}x; controller overhead (wall - program) "
              f"{t_one - inner_one:.2f} s for 1, {t_many - inner_many:.2f} s for {args.targets}")



if __name__ == "__main__":
    main()
