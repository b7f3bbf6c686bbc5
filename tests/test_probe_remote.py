"""`dflash-ops probe` for real: CPU torch on this machine, through the sshd + pct stand-in."""
import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

WORKDIR = "/srv/ct/dflash"
REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


def cli(*args):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=900, cwd=REPO)


def test_probe_through_ssh_and_pct_matches_the_documented_shape(sshd, fakepct, make_inventory):
    fakepct.create(200)
    inv = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable,
                                    "workdir": WORKDIR, "gpus": 0, "expect": {"torch": ">=99"}}})
    r = cli("-i", inv, "probe", "ct200")
    assert r.returncode == 1 and "no release deployed" in r.stdout + r.stderr

    assert cli("-i", inv, "deploy", "ct200").returncode == 0
    # inductor's compile is covered by tests/test_probe_program.py; here the path through sshd + pct
    r = cli("-i", inv, "probe", "ct200", "--policies", "eager,reduce-overhead", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[ct200]" in r.stderr            # live progress lines, one per case
    doc = json.loads(r.stdout)["targets"]["ct200"]
    assert doc["ok"] is True
    assert doc["torch"]["version"].startswith("2.") and doc["torch"]["gpus"] == []
    assert "default" in doc["modes"] or "reduce-overhead" in doc["modes"]
    cases = {(c["policy"], c["topology"]): c for c in doc["cases"]}
    for key in ("policy", "topology", "threads", "outcome", "signature", "step_ms"):
        assert all(key in c for c in doc["cases"])
    assert cases[("eager", "threads")]["outcome"] == "ok"
    assert cases[("eager", "threads")]["threads"] >= 2
    assert cases[("eager", "processes")]["outcome"] == "ok"       # 2 gloo ranks under torchrun, in the container
    assert cases[("reduce-overhead", "threads")]["outcome"] == "skipped"   # CUDA only
    assert doc["policy"] == "eager"
    assert any("torch" in m for m in doc["expect"]["mismatches"])
    # The choice is saved on the target, where `launch --policy auto` reads it.
    saved = json.loads((fakepct.private(200) / "dflash" / "probe.json").read_text())
    assert saved["policy"] == doc["policy"]
