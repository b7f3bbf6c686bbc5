"""A rank of a job over several nodes whose peers never connect: it gives up after the mesh timeout
(not gloo's 30 minutes, nor the first step's warm-up timeout), and a SIGTERM while it waits ends it at
once (trainer/train/distributed.py). One real rank of a world of two, the other never started."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
RANK = """
import sys
from trainer.run import flags
from trainer.train import distributed
distributed.MESH_TIMEOUT_S = float(sys.argv[2])
cfg = flags.parse(["--out", sys.argv[1], "--gpus", "0", "--workers", "2", "--topology", "processes",
                    "--compile-policy", "eager", "--warmup-timeout", "900"])
sys.exit(distributed.rank_main(cfg))
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank0(tmp_path, mesh_timeout):
    port = _free_port()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "out"), str(mesh_timeout)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, port


def _listening(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_a_rank_whose_peer_never_connects_gives_up_after_the_mesh_timeout(tmp_path):
    proc, _ = _rank0(tmp_path, 3)
    try:
        out, _ = proc.communicate(timeout=120)      # before: the warm-up timeout, 900 s
    finally:
        proc.kill()
    assert proc.returncode not in (0, None), out.decode()[-2000:]
    # the project's own line (torch's timeout, a margin later, would name no cause)
    assert b"the process group's mesh did not form within 3 s" in out, out.decode()[-2000:]


def test_a_rank_waiting_for_its_peers_ends_on_sigterm(tmp_path):
    proc, port = _rank0(tmp_path, 600)
    try:
        deadline = time.monotonic() + 90
        while not _listening(port):                  # rank 0 serves the store: it is in init_process_group
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-2000:]
            time.sleep(0.2)
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)                        # before: it waited on, its handler only set a flag
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM


EXITS_0 = """
import sys
from types import SimpleNamespace
from trainer.exits import exit_process
from trainer.train import distributed

def leave(*args, **kwargs):
    raise SystemExit(0)

distributed._prefix_output = leave      # rank_main's first step: the rank ends with SystemExit(0) there
code = distributed.main(SimpleNamespace(nnodes=1))
print("status", repr(code), flush=True)
exit_process(code)
"""


def test_a_rank_that_exits_0_ends_with_status_0(tmp_path):
    """torchelastic's @record on rank_main returns None for a SystemExit(0). distributed.main passes
    it on as 0: in a rank exit_process ends with os._exit, which takes no None (a TypeError, exit 1,
    before; found by mypy)."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", EXITS_0], env=env, cwd=tmp_path, capture_output=True, timeout=120)
    out = (r.stdout + r.stderr).decode()
    assert "status 0" in out and r.returncode == 0, out[-2000:]
