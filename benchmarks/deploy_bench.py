"""Deploy benchmark: dflash-ops deploy vs `rsync -a` over the same loopback sshd into the same
pct stand-in container, on a 1,000-file tree.

    .venv/bin/python benchmarks/deploy_bench.py [--files 1000] [--repeat 5] [--baseline DIR]

Starts its own sshd on 127.0.0.1 (tests/fixtures/sshd.py) and pct stand-in (tests/fakepct/pct).
Prints a Markdown table: median wall seconds of the whole CLI command (process start included)
for a first deploy, a no-change redeploy and a one-file-change redeploy, with the SSH
connections and round trips each makes. The no-change runs alternate with rsync's (and the
baseline's), so a machine whose load changes during the run weighs on all alike.

--baseline DIR times another version's no-change redeploy in the same run: DIR holds its
`orchestrator/` (e.g. `git archive REV orchestrator | tar -x -C DIR`), put first on PYTHONPATH.

--busy N: N busy loops (`yes > /dev/null`, as a laptop's build or browser) run beside everything the
bench times, both tools alike: the loaded figure. The controller is Python and rsync is C, so where
the cores are shared the controller's own CPU is what the ratio charges.

The timed commands run with Python's bytecode cache on (PYTHONDONTWRITEBYTECODE dropped from their
environment, as a user's shell has it): without it every deploy compiles its modules from source
again, ~60 ms of CPU that no installed dflash-ops spends.

--breakdown: where the no-change deploy's one round trip goes. Over one open connection, each
layer of what deploy runs, alone and then with the next one added (ssh session, the pct wrapper,
the agent's python, the agent's source, the manifest), median milliseconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _harness import REPO, loopback_node


def make_tree(root: Path, n: int) -> None:
    for i in range(n):
        p = root / f"pkg{i % 20}" / f"mod_{i}.py"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"# module {i}\n" + "x = 1\n" * 40)


def timed(cmd: list[str], code: Path | None = None) -> float:
    """Wall seconds of cmd; code: the folder whose orchestrator/ a `-m orchestrator.cli` runs
    (first on PYTHONPATH, and the working directory elsewhere, as -m puts that first)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if code is not None:
        env["PYTHONPATH"] = str(code)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                   cwd=None if code is None else "/")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--baseline", metavar="DIR", help="another version's orchestrator/ to time alongside")
    ap.add_argument("--breakdown", action="store_true", help="time each layer of the remote round trip")
    ap.add_argument("--busy", type=int, default=0, metavar="N", help="N busy loops beside the bench (loaded)")
    args = ap.parse_args()
    busy = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(args.busy)]
    try:
        run(args)
    finally:
        for p in busy:
            p.kill()
            p.wait()


def run(args) -> None:
    baseline = Path(args.baseline).resolve() if args.baseline else None
    load = os.getloadavg()[0]

    with loopback_node({"ct200": 200}) as node:
        server, pct, inv = node.server, node.pct, node.inventory
        src = node.scratch / "src"
        make_tree(src, args.files)
        ours = [sys.executable, "-m", "orchestrator.cli", "-i", str(inv), "deploy", "ct200", "--source", str(src)]
        ssh = (f"ssh -i {server.identity_file} -p {server.port} -o UserKnownHostsFile={server.known_hosts} "
               f"-o StrictHostKeyChecking=yes -o BatchMode=yes")
        rsync = ["rsync", "-a", "--delete", "-e", ssh, f"--rsync-path={pct.path} exec 200 -- rsync",
                 f"{src}/", "root@127.0.0.1:/srv/ct/rsync-copy/"]
        subprocess.run(["mkdir", "-p", str(pct.private(200) / "rsync-copy")], check=True)

        # Connections and round trips of ours, counted by the library's own session.
        from orchestrator import inventory
        from orchestrator.deploy import sync as deploy
        from orchestrator.ssh.session import Session

        def counted() -> tuple[int, int]:
            i = inventory.load(str(inv))
            with Session(i) as s:
                r = deploy.deploy(i, ["ct200"], source=str(src), session=s)["ct200"]
                assert r.ok, r.error
                return s.connections, s.round_trips

        rows = []
        first_ours = timed(ours, REPO)
        first_rsync = timed(rsync)
        rows.append(("first deploy", first_ours, first_rsync))
        noop_o, noop_r, noop_b = [], [], []
        for _ in range(args.repeat):      # alternating: a change of load weighs on each alike
            noop_o.append(timed(ours, REPO))
            noop_r.append(timed(rsync))
            if baseline:
                noop_b.append(timed(ours, baseline))
        rows.append(("no-change redeploy", statistics.median(noop_o), statistics.median(noop_r)))
        if baseline:
            rows.append((f"no-change redeploy, baseline {args.baseline}", statistics.median(noop_b),
                         statistics.median(noop_r)))
        one_o, one_r = [], []
        for k in range(args.repeat):
            (src / "pkg0" / "mod_0.py").write_text(f"changed {k}\n")
            one_o.append(timed(ours, REPO))
            one_r.append(timed(rsync))
        rows.append(("one-file-change redeploy", statistics.median(one_o), statistics.median(one_r)))
        (src / "pkg0" / "mod_0.py").write_text("changed again\n")
        conn_change = counted()
        conn_noop = counted()

        layers = breakdown(inv, src, pct.path, args.repeat) if args.breakdown else []

        print(f"{args.files} files, median of {args.repeat}, wall seconds of the whole command; "
              f"{args.busy} busy loop(s) beside; "
              f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end\n")
        print("| case | dflash-ops deploy | rsync -a over ssh + pct exec | ratio |")
        print("| --- | --- | --- | --- |")
        for name, o, r in rows:
            print(f"| {name} | {o:.3f} | {r:.3f} | {o / r:.2f}x |")
        print()
        print(f"dflash-ops: {conn_change[0]} SSH connection, {conn_change[1]} round trips for a change "
              f"(manifest with the pct status check, apply); {conn_noop[0]} connection, {conn_noop[1]} round trips "
              f"for no change. rsync: 1 SSH connection, 1 session (its protocol is pipelined).")
        if layers:
            print("\n| the round trip, layer by layer (one open connection) | median ms | this layer |")
            print("| --- | --- | --- |")
            before = 0.0
            for name, ms in layers:
                print(f"| {name} | {ms:.1f} | {ms - before:+.1f} |")
                before = ms


def breakdown(inv_path: Path, src: Path, pct: Path, repeat: int) -> list[tuple[str, float]]:
    """Median ms of each layer of a no-change deploy's round trip, each run alone over one open
    connection, the layers alternating so that a change of load weighs on each alike."""
    from orchestrator import inventory
    from orchestrator.ssh import agent_call
    from orchestrator.ssh.session import Session
    from orchestrator.ssh.pct import pct_checked_argv

    inv = inventory.load(str(inv_path))
    target = inv.targets["ct200"]
    deploy_argv = agent_call.argv(target, agent_call.RELEASE, ["manifest", target.workdir, "--tidy"])
    python, options = deploy_argv[0], deploy_argv[1:deploy_argv.index("-c")]
    in_ct = [
        ("ssh session: `true`", None),
        ("+ pct exec (its status wrapper): `true`", ["true"]),
        (f"+ the agent's python: `python {' '.join(options)} -c pass`", [python, *options, "-c", "pass"]),
        ("+ the agent's source: `manifest --no-files`", [*deploy_argv[:-1], "--no-files"]),
        ("+ the manifest of the live release (what deploy runs)", deploy_argv),
    ]
    times: dict[str, list[float]] = {name: [] for name, _ in in_ct}
    with Session(inv) as s:
        ssh = s.ssh(target.host)
        for _ in range(repeat):
            for name, argv in in_ct:
                cmd = ["true"] if argv is None else pct_checked_argv(str(pct), target.vmid, argv, sudo=False)
                t0 = time.perf_counter()
                r = ssh.run(cmd)
                times[name].append(time.perf_counter() - t0)
                assert r.exit_code == 0, (name, r.stderr[-300:])
    return [(name, statistics.median(t) * 1000) for name, t in times.items()]


if __name__ == "__main__":
    main()
