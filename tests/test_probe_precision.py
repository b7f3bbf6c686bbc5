"""`dflash-ops probe --precision`: what the command refuses before anything connects. The fp8 probe
itself, through the sshd and the pct stand-in, is in tests/test_fp8.py (it needs torchao)."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def cli(*args):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.fixture
def inv(tmp_path):
    path = tmp_path / "hosts.yaml"   # an address that resolves nowhere: a command that connected would say so
    path.write_text("hosts: {pve1: {address: pve1.invalid}}\ntargets: {ct200: {host: pve1, vmid: 200}}\n")
    return path


@pytest.mark.parametrize("args, message", [
    (["--precision", "fp8", "--reuse"], "--reuse keeps the saved result, which is bf16's"),
    (["--fp8-emulate"], "--fp8-emulate goes with --precision fp8|fp8-rowwise|fp8-lmhead"),
    (["--precision", "fp9"], "'fp9' is not one of 'bf16', 'fp8', 'fp8-rowwise', 'fp8-lmhead'"),
])
def test_probe_refuses_what_cannot_work_before_it_connects(inv, args, message):
    r = cli("-i", inv, "probe", "ct200", *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr and "pve1.invalid" not in r.stderr
