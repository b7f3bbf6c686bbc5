"""trainer/procs.py against real processes: a child that started a grandchild, and a zombie."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from trainer import procs

SLEEPER = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); " \
          "print('up', flush=True); time.sleep(30)"


def test_children_and_descendants():
    child = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert child.stdout.readline() == b"up\n"
        while procs.table().get(ended.pid, (0, ""))[1] != "Z":   # ended, not yet reaped: a zombie
            time.sleep(0.02)
        under = procs.descendants(child.pid)
        assert len(under) == 1 and procs.table()[under[0]][0] == child.pid    # the grandchild
        mine = procs.children(os.getpid())
        assert child.pid in mine and under[0] not in mine
        assert ended.pid not in mine and ended.pid in procs.descendants(os.getpid())
        assert set(procs.descendants(os.getpid())) >= {child.pid, under[0]}
    finally:
        for p in procs.descendants(child.pid):
            os.kill(p, 9)
        child.kill()
        child.wait()
        ended.wait()
