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


def test_probe_through_ssh_and_pct_matches_the_documented_shape_and_its_verdict_is_reused_only_with_the_same_key(
        sshd, fakepct, make_inventory, tmp_path):
    """Three containers point DFLASH_PROBE_CACHE at one folder of the node (a bind mount, in real life);
    the third one's torch reports another build (a sitecustomize on its PYTHONPATH). The first one's
    probe is also the documented shape's (one test: it is the one probe here that runs its case cold,
    and a second probe of its own would run the same eager case again)."""
    shared = tmp_path / "verdicts"
    other = tmp_path / "other-torch"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import torch\ntorch.__version__ = torch.__version__ + '.other'\n")
    for vmid in (201, 202, 203):
        fakepct.create(vmid)
    env = {"DFLASH_PROBE_CACHE": str(shared)}
    inv = make_inventory({f"ct{v}": {"host": "node", "vmid": v, "python": sys.executable, "workdir": WORKDIR,
                                     "gpus": 0, "env": dict(env, **({"PYTHONPATH": str(other)} if v == 203 else {})),
                                     **({"expect": {"torch": ">=99"}} if v == 201 else {})}
                          for v in (201, 202, 203)})
    r = cli("-i", inv, "probe", "ct201")
    assert r.returncode == 1 and "no release deployed" in r.stdout + r.stderr
    assert cli("-i", inv, "deploy", "ct201", "ct202", "ct203").returncode == 0

    def probe(name, *extra, policies="eager"):
        r = cli("-i", inv, "probe", name, "--policies", policies, "--json", *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout)["targets"][name], r.stderr

    # the documented shape, through sshd + pct (inductor's compile is covered by tests/test_probe_program.py)
    first, err = probe("ct201", policies="eager,reduce-overhead")
    assert "[ct201]" in err            # live progress lines, one per case
    assert first["ok"] is True
    assert first["torch"]["version"].startswith("2.") and first["torch"]["gpus"] == []
    assert "default" in first["modes"] or "reduce-overhead" in first["modes"]
    cases = {(c["policy"], c["topology"]): c for c in first["cases"]}
    for key in ("policy", "topology", "threads", "outcome", "signature", "step_ms"):
        assert all(key in c for c in first["cases"])
    assert cases[("eager", "threads")]["outcome"] == "ok"
    assert cases[("eager", "threads")]["threads"] >= 2
    assert ("eager", "processes") not in cases    # a CPU-only target probes threads unless asked for DDP
    assert cases[("reduce-overhead", "threads")]["outcome"] == "skipped"   # CUDA only
    assert first["policy"] == "eager"
    assert any("torch" in m for m in first["expect"]["mismatches"])
    # The choice is saved on the target, where `launch --policy auto` reads it.
    saved = json.loads((fakepct.private(201) / "dflash" / "probe.json").read_text())
    assert saved["policy"] == first["policy"]

    # the verdicts: kept in the shared folder (a skipped case keeps none), reused by a container with the same key
    assert first["reused_cases"] == [] and first["cases"][0]["outcome"] == "ok"
    assert len(list(shared.glob("*.json"))) == 1
    second, err = probe("ct202")
    assert second["reused_cases"] == ["eager threads"] and "reused: the verdict of" in err
    assert second["cases"][0]["step_ms"] == cases[("eager", "threads")]["step_ms"]    # the saved verdict, not run again
    assert second["policy"] == "eager"
    fresh, err = probe("ct202", "--fresh")
    assert fresh["reused_cases"] == [] and "reused" not in err
    third, _ = probe("ct203")
    assert third["torch"]["version"].endswith(".other") and third["reused_cases"] == []
    assert len(list(shared.glob("*.json"))) == 2
