"""`exec` and a playbook `exec` step with large output: the controller's peak memory (max RSS of the
CLI process), wall time and what it printed, over the loopback sshd + pct stand-in.

    .venv/bin/python benchmarks/exec_output.py [--mb 300] [--each-mb 100] [--play-mb 80] [--code DIR]

Starts its own sshd on 127.0.0.1 (tests/fixtures/sshd.py) and pct stand-in (tests/fakepct/pct)
with CT 200 and CT 201, then runs the CLI as a user would (a subprocess; stdout into a file, whose
size is what was printed), each command printing NUL bytes without a newline (`head -c N
/dev/zero`, the worst case for a line-prefixing writer and for JSON, which writes a NUL as \\u0000):

    json        exec ct200 --json -- sh -c 'head -c MB000000 /dev/zero'
    one         exec ct200 -- sh -c 'head -c EACH000000 /dev/zero'            (raw bytes)
    two         exec ct200 ct201 -- sh -c 'head -c EACH000000 /dev/zero'      (`[target] ` lines)
    play        play P.yaml ct200, one step `exec: {shell: "head -c PLAY000000 /dev/zero"}`
                (and the size of the record it leaves in DFLASH_OPS_HOME/plays/)

--code DIR runs another version (DIR holds its `orchestrator/` and `trainer/`, e.g. `git archive REV
orchestrator trainer | tar -x -C DIR`), first on PYTHONPATH: the figures before a change.
--only NAME[,NAME]: those cases alone. --yes: `yes | head -c N` instead (lines of 2 bytes: the cost
per line rather than per byte).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from _harness import loopback_node

MAIN = "from orchestrator.cli import main; main()"


def measure(cmd: list[str], out: Path, env: dict, cwd: str | None) -> tuple[float, float, int, int]:
    """(wall s, peak RSS MB of the process, bytes on stdout, exit status)."""
    with open(out, "wb") as f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_maxrss / 1024, out.stat().st_size, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=300, help="MB for the --json case")
    ap.add_argument("--each-mb", type=int, default=100, help="MB per target for the one/two cases")
    ap.add_argument("--play-mb", type=int, default=80, help="MB for the play step")
    ap.add_argument("--code", help="another version's folder, first on PYTHONPATH")
    ap.add_argument("--only", default="json,one,two,play")
    ap.add_argument("--yes", action="store_true", help="`yes | head -c N`: short lines instead of one long one")
    a = ap.parse_args()
    env = dict(os.environ)
    cwd = None
    if a.code:
        env["PYTHONPATH"] = str(Path(a.code).resolve())
        cwd = "/"
    only = set(a.only.split(","))

    def src(mb: int) -> str:
        return f"yes | head -c {mb}000000" if a.yes else f"head -c {mb}000000 /dev/zero"
    with loopback_node({"ct200": 200, "ct201": 201}, prefix="dflash-exec-bench-") as node:
        env["DFLASH_OPS_HOME"] = str(node.scratch / "home")
        base = [sys.executable, "-c", MAIN, "-i", str(node.inventory)]
        out = node.scratch / "stdout"
        rows = []
        if "json" in only:
            rows.append((f"exec ct200 --json, {a.mb} MB",
                         measure(base + ["exec", "ct200", "--json", "--", "sh", "-c",
                                         src(a.mb)], out, env, cwd)))
        if "one" in only:
            rows.append((f"exec ct200, {a.each_mb} MB",
                         measure(base + ["exec", "ct200", "--", "sh", "-c",
                                         src(a.each_mb)], out, env, cwd)))
        if "two" in only:
            rows.append((f"exec ct200 ct201, {a.each_mb} MB each",
                         measure(base + ["exec", "ct200", "ct201", "--", "sh", "-c",
                                         src(a.each_mb)], out, env, cwd)))
        if "play" in only:
            book = node.scratch / "big.yaml"
            book.write_text(f'steps:\n  - name: big\n    exec: {{shell: "{src(a.play_mb)}"}}\n')
            row = measure(base + ["play", str(book), "ct200", "--json"], out, env, cwd)
            records = list((node.scratch / "home" / "plays").rglob("ct200.json"))
            rows.append((f"play, one exec step of {a.play_mb} MB (record {records[0].stat().st_size / 1e6:.1f} MB)"
                         if records else f"play, one exec step of {a.play_mb} MB (no record)", row))
        print("| case | wall s | peak RSS MB | stdout MB | exit |")
        print("| --- | --- | --- | --- | --- |")
        for name, (wall, rss, size, code) in rows:
            print(f"| {name} | {wall:.1f} | {rss:.0f} | {size / 1e6:.1f} | {code} |")


if __name__ == "__main__":
    main()
