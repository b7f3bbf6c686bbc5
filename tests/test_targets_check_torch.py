"""`targets --check` flags a target whose python has no torch, through the sshd + pct stand-in."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NO_TORCH = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if Path(p).exists() and subprocess.run(
    [p, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"]).returncode == 0), None)


@pytest.mark.skipif(NO_TORCH is None, reason="no python without torch on this machine")
def test_a_target_python_without_torch_fails_the_check_with_the_command_that_fixes_it(sshd, fakepct,
                                                                                        make_inventory):
    fakepct.create(210)
    fakepct.create(211)
    work = "/srv/ct/dflash"
    inv = make_inventory({"ct210": {"host": "node", "vmid": 210, "python": NO_TORCH, "workdir": work},
                          "ct211": {"host": "node", "vmid": 211, "python": sys.executable, "workdir": work}})
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "-i", str(inv), "targets", "--check", "--json",
                        "ct210", "ct211"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)["targets"]
    assert doc["ct211"]["ok"] and doc["ct211"]["torch"]
    bad = doc["ct210"]
    assert not bad["ok"] and bad["torch"] is None and bad["python"]
    assert f"{NO_TORCH} has no torch" in bad["error"] and "play playbooks/bootstrap.yaml ct210" in bad["error"]
