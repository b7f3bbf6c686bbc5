"""`logs --follow` latency: from a line written on the target to the same line printed by the
CLI, over the loopback sshd + pct stand-in; and the reconnect time after a dropped connection.

    .venv/bin/python benchmarks/logs_latency.py [--lines 200] [--rate 10] [--drops 5]

Starts its own sshd on 127.0.0.1 (tests/fixtures/sshd.py) and pct stand-in (tests/fakepct/pct)
with CT 200, and fakes a running run in CT 200's WORKDIR/runs/ (its "trainer" is this process,
which appends timestamped lines to the run's train.log). `dflash-ops logs ct200 RUN` runs as a
user would run it (a subprocess, stdout a pipe); each line's latency is its arrival time on
that pipe minus the time written into it (one machine, one clock).

Phase 1 (steady): --lines lines at --rate per second. Phase 2 (drops): lines keep coming at
20 per second while every sshd connection is killed --drops times, 2 s apart; reported per
drop: the CLI's own "reconnected after X s" (from noticing the drop to the new stream's first
byte) and the gap the user sees (from the kill to the first line printed after it).
Finally the run "ends" (an exit.json appears), the CLI exits, and its output is compared with
the log byte for byte. `--local` measures the same on the built-in `local` target (no SSH).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _harness import fixtures  # noqa: E402

MAIN = "from orchestrator.cli import main; main()"


def proc_start(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def fake_run(runs_dir: Path, run: str) -> Path:
    """A run whose trainer is this process: alive until exit.json says otherwise."""
    d = runs_dir / run
    d.mkdir(parents=True)
    me = os.getpid()
    (d / "run.json").write_text(json.dumps({"run": run, "started_ts": time.time(),
                                            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                            "pid": me, "pid_start": proc_start(me)}))
    (d / "train.log").write_bytes(b"")
    return d


class Follower:
    """`dflash-ops logs TARGET RUN` in a subprocess; records each stdout line's arrival time."""

    def __init__(self, inventory: str | None, target: str, run: str, env: dict):
        args = [sys.executable, "-c", MAIN] + (["-i", inventory] if inventory else []) + \
            ["logs", target, run]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.lines: list[tuple[float, bytes]] = []
        self.stderr: list[str] = []
        self.out = threading.Thread(target=self._read_out, daemon=True)
        self.err = threading.Thread(target=self._read_err, daemon=True)
        self.out.start()
        self.err.start()

    def _read_out(self) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            self.lines.append((time.time(), line))

    def _read_err(self) -> None:
        for line in iter(self.proc.stderr.readline, b""):
            self.stderr.append(line.decode(errors="replace").rstrip())

    def wait(self, timeout: float = 120) -> int:
        code = self.proc.wait(timeout=timeout)
        self.out.join(10)
        self.err.join(10)
        return code


def write_line(log_fd: int, i: int, phase: str) -> None:
    line = json.dumps({"t": time.time(), "i": i, "phase": phase, "pad": "x" * 60}) + "\n"
    os.write(log_fd, line.encode())


def latencies(lines, phase: str) -> list[float]:
    out = []
    for arrived, raw in lines:
        try:
            doc = json.loads(raw)
        except ValueError:
            continue
        if doc.get("phase") == phase:
            out.append(arrived - doc["t"])
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def run_case(name: str, rundir: Path, follower_args: tuple, env: dict, args, server=None) -> dict:
    log_fd = os.open(rundir / "train.log", os.O_WRONLY | os.O_APPEND)
    f = Follower(*follower_args, env=env)
    # wait for the stream to be up: a first line printed
    write_line(log_fd, -1, "warmup")
    deadline = time.monotonic() + 60
    while not f.lines and time.monotonic() < deadline:
        time.sleep(0.01)
    if not f.lines:
        raise SystemExit(f"{name}: the follower printed nothing in 60 s: {f.stderr[-5:]}")

    for i in range(args.lines):                                 # phase 1: steady
        write_line(log_fd, i, "steady")
        time.sleep(1.0 / args.rate)
    time.sleep(0.5)

    drops = []
    if server is not None and args.drops:                       # phase 2: drops
        stop = threading.Event()

        def writer():
            i = 0
            while not stop.is_set():
                write_line(log_fd, i, "drops")
                i += 1
                time.sleep(0.05)
        w = threading.Thread(target=writer, daemon=True)
        w.start()
        time.sleep(1.0)
        for _ in range(args.drops):
            n_before = len(f.lines)
            killed_at = time.time()
            if not server.kill_connections():
                continue
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                after = [t for t, _ in f.lines[n_before:] if t > killed_at]
                if after and any(t > killed_at + 0.001 for t in after):
                    break
                time.sleep(0.005)
            first_after = next((t for t, _ in f.lines[n_before:] if t > killed_at), None)
            drops.append({"gap_s": (first_after - killed_at) if first_after else None})
            time.sleep(2.0)
        stop.set()
        w.join()

    (rundir / "exit.json").write_text(json.dumps({"state": "succeeded", "exit_code": 0,
                                                  "ended_ts": time.time()}))
    code = f.wait()
    os.close(log_fd)
    same = b"".join(line for _, line in f.lines) == (rundir / "train.log").read_bytes()
    reconnects = [float(m.group(1)) for m in
                  (re.search(r"reconnected after ([\d.]+) s", s) for s in f.stderr) if m]
    steady = latencies(f.lines, "steady")
    return {"case": name, "exit": code, "byte_exact": same, "n": len(steady),
            "median_ms": 1000 * statistics.median(steady), "p90_ms": 1000 * pct(steady, 0.9),
            "max_ms": 1000 * max(steady), "drops": len(drops), "reconnect_s": reconnects,
            "gap_s": [d["gap_s"] for d in drops], "stderr_tail": f.stderr[-3:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=200)
    ap.add_argument("--rate", type=float, default=10.0, help="lines per second in the steady phase")
    ap.add_argument("--drops", type=int, default=5)
    ap.add_argument("--local", action="store_true", help="also measure the built-in local target")
    args = ap.parse_args()

    sshd_mod, conftest = fixtures()
    scratch = Path(tempfile.mkdtemp(prefix="dflash-logs-bench-"))
    server = sshd_mod.SshServer.start(scratch / "sshd")
    results = []
    try:
        pctx = conftest.install_fakepct(scratch / "pct")
        pctx.create(200)
        inv = scratch / "hosts.yaml"
        inv.write_text(json.dumps({
            "hosts": {"node": {"address": server.host, "port": server.port, "user": server.user,
                               "identity_file": str(server.identity_file),
                               "known_hosts": str(server.known_hosts), "pct": str(pctx.path)}},
            "targets": {"ct200": {"host": "node", "vmid": 200, "python": sys.executable,
                                  "workdir": "/srv/ct/dflash"}}}))
        env = dict(os.environ, DFLASH_OPS_HOME=str(scratch / "home"))
        rundir = fake_run(pctx.private(200) / "dflash" / "runs", "20260101-000000-bench1")
        results.append(run_case("ssh + pct exec (loopback)", rundir,
                                (str(inv), "ct200", rundir.name), env, args, server))
        if args.local:
            lrun = fake_run(scratch / "home" / "local" / "runs", "20260101-000000-bench2")
            results.append(run_case("local (no ssh)", lrun, (None, "local", lrun.name),
                                    dict(env, DFLASH_OPS_INVENTORY=""), args))
        pctx.stop(200)
    finally:
        server.stop()

    print(f"lines: {args.lines} at {args.rate:g}/s; drops: {args.drops}\n")
    print("| case | lines | median ms | p90 ms | max ms | byte-exact | exit |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['case']} | {r['n']} | {r['median_ms']:.0f} | {r['p90_ms']:.0f} | "
              f"{r['max_ms']:.0f} | {'yes' if r['byte_exact'] else 'NO'} | {r['exit']} |")
    for r in results:
        if r["drops"]:
            rec = r["reconnect_s"]
            gaps = [g for g in r["gap_s"] if g is not None]
            print(f"\n{r['case']}: {r['drops']} drops; reconnect (CLI, drop noticed -> stream back) "
                  f"s: {', '.join(f'{x:.2f}' for x in rec)} (median {statistics.median(rec):.2f}); "
                  f"gap seen by the user (kill -> next line printed) s: "
                  f"{', '.join(f'{x:.2f}' for x in gaps)} (median {statistics.median(gaps):.2f})")
        if r["exit"] != 0 or not r["byte_exact"]:
            print(f"\n{r['case']}: stderr tail: {r['stderr_tail']}")


if __name__ == "__main__":
    main()
