"""A follow agent killed by a signal mid-stream (the OOM killer, an admin's kill -9) while its run goes
on: the follow reconnects and resumes at its offset, on a plain-SSH target as on a pct one (both
report the death as 128+N). The run is a
stand-in, a log beside a live `sleep` as its trainer, through the real sshd on 127.0.0.1."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
from trainer_quick import wait_for

from orchestrator import inventory
from orchestrator.remote.runs.records import proc_start
from orchestrator.runs import follow as follow_mod


def agent_of(run: str) -> int | None:
    """The pid of the follow agent streaming `run`: `python -c SOURCE follow ... -- RUN` (not pct's exec
    of it, whose argv holds the same words)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[-3:] == [b"--", run.encode(), b""] and argv[1:2] == [b"-c"] and argv[3:4] == [b"follow"]:
            return int(pid)
    return None


@pytest.mark.parametrize("kind", ["ssh", "pct"])
def test_a_follow_agent_killed_mid_stream_reconnects_and_resumes(kind, sshd, fakepct, make_inventory, tmp_path):
    fakepct.create(200)
    wd_here = tmp_path / "wd" if kind == "ssh" else fakepct.private(200) / "dflash"
    entry = {"host": "node", "python": sys.executable, "gpus": 0,
             "workdir": str(wd_here) if kind == "ssh" else "/srv/ct/dflash", **({"vmid": 200} if kind == "pct" else {})}
    inv = inventory.load(str(make_inventory({"t": entry})))
    run = f"20261201-000000-{kind}"
    rundir = wd_here / "runs" / run
    rundir.mkdir(parents=True)
    trainer = subprocess.Popen(["sleep", "300"])
    try:
        rec = {"run": run, "pid": trainer.pid, "pid_start": proc_start(trainer.pid), "started_ts": 1.0}
        (rundir / "run.json").write_text(json.dumps(rec))
        log = rundir / "train.log"
        log.write_bytes(b"[trainer] line 1\n")
        events: list = []
        t = threading.Thread(target=lambda: events.extend(
            follow_mod.follow(inv, inv.target("t"), run, backoff=(0.2,), dead_s=30)), daemon=True)
        t.start()
        wait_for(lambda: any(isinstance(e, follow_mod.Line) for e in events), 60, "the first line")
        os.kill(wait_for(lambda: agent_of(run), 30, "the follow agent"), signal.SIGKILL)
        wait_for(lambda: any(isinstance(e, follow_mod.Resumed) for e in events), 60, "the stream to resume")
        with log.open("ab") as f:
            f.write(b"[trainer] line 2\n")
        wait_for(lambda: sum(isinstance(e, follow_mod.Line) for e in events) == 2, 60, "the line after it")
    finally:
        trainer.kill()
        trainer.wait()
    t.join(60)
    assert isinstance(events[-1], follow_mod.End), events
    again = [e for e in events if isinstance(e, follow_mod.Reconnecting)]
    assert again and "the log stream ended early (its agent was killed by signal 9)" in again[0].reason, again
    assert [e.data for e in events if isinstance(e, follow_mod.Line)] == [b"[trainer] line 1\n", b"[trainer] line 2\n"]
