"""`targets --check` flags a target whose python has no torch, through the sshd + pct stand-in; the
built-in `local` without torch only when it is judged (named, or the default)."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import pytest

from orchestrator import inventory
from orchestrator.targets import check as targets_check

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


@pytest.mark.skipif(NO_TORCH is None, reason="no python without torch on this machine")
def test_local_without_torch_is_a_fact_unless_named_and_a_stopped_container_is_said_once(sshd, fakepct,
                                                                                          make_inventory):
    fakepct.create(211)
    fakepct.create(212, running=False)
    work = "/srv/ct/dflash"
    path = make_inventory({"ct211": {"host": "node", "vmid": 211, "python": sys.executable, "workdir": work},
                           "ct212": {"host": "node", "vmid": 212, "python": sys.executable, "workdir": work}})
    inv = inventory.load(str(path))
    local = dataclasses.replace(inv.targets["local"], python=NO_TORCH)     # this laptop, without torch
    inv = dataclasses.replace(inv, targets=MappingProxyType({**inv.targets, "local": local}))
    checks = {c.target: c for c in targets_check.check(inv, [])}
    assert checks["ct211"].ok and checks["local"].ok and checks["local"].torch is None
    assert checks["local"].error is None and "has no torch (not judged" in checks["local"].note
    stopped = checks["ct212"]
    assert not stopped.ok and stopped.container == "stopped" and "is stopped, not running" in stopped.error
    named = targets_check.check(inv, ["local"])[0]
    assert not named.ok and "has no torch; install it with" in named.error
    assert targets_check.judged(dataclasses.replace(inv, default="local"), local, [])
    assert targets_check.judged(inventory.parse(""), inventory.parse("").targets["local"], [])

    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "-i", str(path), "targets", "--check", "ct212"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1 and (r.stdout + r.stderr).count("not running") == 1, r.stdout + r.stderr
