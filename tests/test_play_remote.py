"""`dflash-ops play` for real: the shipped playbooks through a real sshd into the pct stand-in.

One container (module-scoped, so torch is installed once): bootstrap.yaml turns it from python only
into one the probe passes on, with torch from a wheel file given as a variable; a second run changes
nothing and says so; train.yaml then trains on it, on the CPU, after the pipeline gate passed, and
brings the drafter home.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import install_fakepct
from trainer_quick import CLI_MAIN, copy_trainer, tiny_run_config

REPO = Path(__file__).resolve().parent.parent
BOOTSTRAP = REPO / "playbooks" / "bootstrap.yaml"
TRAIN = REPO / "playbooks" / "train.yaml"
VMID = 210


def play(inventory: Path, home: Path, *args, timeout: float = 400) -> subprocess.CompletedProcess:
    env = dict(os.environ, DFLASH_OPS_HOME=str(home))
    return subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", str(inventory), "play", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=home, env=env)


def statuses(doc: dict, target: str) -> dict[str, str]:
    return {s["name"]: s["status"] for s in doc["targets"][target]["steps"]}


@pytest.fixture(scope="module")
def ct(sshd, tmp_path_factory):
    """CT 210, python only, after one bootstrap run: (inventory, home, the run, variables)."""
    tmp = tmp_path_factory.mktemp("play")
    pct = install_fakepct(tmp / "fakepct")
    pct.create(VMID)
    inventory = tmp / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({
        "hosts": {"node": {"address": sshd.host, "port": sshd.port, "user": sshd.user,
                           "identity_file": str(sshd.identity_file), "known_hosts": str(sshd.known_hosts),
                           "pct": str(pct.path)}},
        "targets": {"ct210": {"host": "node", "vmid": VMID, "python": "/srv/ct/venv/bin/python",
                              "workdir": "/srv/ct/dflash", "gpus": 0,
                              # pip reads PIP_NO_COMPILE as its `compile` setting: false skips
                              # byte-compiling torch and transformers, most of the time installing them takes
                              "env": {"PIP_NO_COMPILE": "false"}}}}))
    # The torch wheel of this interpreter, from where pip finds it (a local wheel here, no network).
    wheels = tmp / "wheels"
    version = importlib.metadata.version("torch").split("+")[0]
    got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                          f"torch=={version}", "-d", str(wheels)], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr[-2000:]
    wheel, = wheels.glob("torch-*.whl")
    home = tmp / "home"
    home.mkdir()
    # eager in threads only: the probe's cheapest case still checks the build (its other cases: test_probe_*)
    variables = ["--var", f"source={copy_trainer(tmp / 'src')}", "--var", "probe_policies=eager",
                 "--var", "probe_topologies=threads"]
    # This interpreter's base python (the wheel's python version): with --system-site-packages the
    # venv sees what it has (pip, numpy, sympy; no torch, no transformers), so the venv needs no pip
    # of its own and pip writes less.
    has_pip = subprocess.run([sys._base_executable, "-c", "import pip"], capture_output=True).returncode == 0
    base = ["--var", f"base_python={sys._base_executable}",
            "--var", "venv_options=--system-site-packages" + (" --without-pip" if has_pip else "")]
    first = play(inventory, home, BOOTSTRAP, "ct210", "--var", f"torch={wheel}", *variables, *base, "--json")
    try:
        yield type("CT", (), dict(inventory=inventory, home=home, first=first, wheel=wheel, tmp=tmp,
                                  private=pct.private(VMID), variables=variables, base=base))
    finally:
        try:
            pct.stop(VMID)
        finally:
            # the container's venv (about a GB) was written moments ago: deleting it waits on the disk,
            # so a detached rm does it while the suite goes on.
            subprocess.Popen(["rm", "-rf", str(tmp)], start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)


def test_bootstrap_turns_a_python_only_container_into_one_the_probe_passes(ct):
    assert ct.first.returncode == 0, ct.first.stderr[-3000:]
    doc = json.loads(ct.first.stdout)
    assert statuses(doc, "ct210") == {"find-python": "ok", "venv": "changed", "torch": "changed",
                                      "deploy": "changed", "probe": "ok"}
    steps = {s["name"]: s for s in doc["targets"]["ct210"]["steps"]}
    assert steps["torch"]["result"]["watch"]["after"].strip() == importlib.metadata.version("torch")
    probe = steps["probe"]["result"]
    assert probe["ok"] and probe["policy"] == "eager" and not probe.get("reused")
    assert [(c["policy"], c["topology"], c["outcome"]) for c in probe["cases"]] == [("eager", "threads", "ok")]
    # the venv is in the container, at the target's python: path, with what the trainer needs
    site = next((ct.private / "venv" / "lib").glob("python3*/site-packages"))
    assert (site / "torch").is_dir() and (site / "transformers").is_dir() and (site / "safetensors").is_dir()
    # live lines on stderr, led by the target
    assert "[ct210] step 3/5 torch (exec)" in ct.first.stderr
    assert "[ct210] probe: [1/1] eager threads x2: ok" in ct.first.stderr


def test_bootstrap_again_changes_nothing_and_says_so(ct):
    r = play(ct.inventory, ct.home, BOOTSTRAP, "ct210", "--var", f"torch={ct.wheel}", *ct.variables, *ct.base)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.rstrip().endswith("ct210: ok, nothing changed"), r.stdout
    rows = [line.split()[:4] for line in r.stdout.splitlines()[1:6]]
    assert [row[3] for row in rows] == ["ok"] * 5, r.stdout
    assert r.stdout.count("not needed (`unless` succeeded)") == 2      # the venv is there, so is the wheel's torch
    assert "requirements already installed" in r.stdout                 # pip changed nothing
    assert "the saved result of" in r.stdout                             # the probe stands


def test_train_playbook_runs_to_an_exported_drafter(ct):
    config = ct.tmp / "tiny.yaml"
    config.write_text(tiny_run_config(block_size=4, eval_new_tokens=8))
    out = ct.tmp / "drafter"
    r = play(ct.inventory, ct.home, TRAIN, "ct210", "--var", f"config={config}", "--var", "trainer_args=--steps 4",
             "--var", f"output={out}", *ct.variables, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert statuses(doc, "ct210") == {"deploy": "ok", "probe": "ok", "launch": "changed", "follow": "ok",
                                      "tau": "ok", "export": "changed"}
    steps = {s["name"]: s["result"] for s in doc["targets"]["ct210"]["steps"]}
    run = steps["launch"]["run"]
    assert steps["follow"]["run"] == run and steps["follow"]["state"] == "succeeded" and steps["follow"]["step"] == 4
    assert steps["export"]["run"] == run and steps["export"]["output"] == str(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dflash_ops.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert steps["probe"]["reused"] and steps["launch"]["compile_policy"] == "auto"
    # the pipeline gate ran first, with the run's config, and passed: every draft on its row accepted
    gate = steps["launch"]["gate"]
    assert gate["passed"] and gate["run"] < run and gate["result"]["decode"]["block_size"] == 4
    assert "[gate] PASSED: every round accepted the whole block of 4" in r.stderr   # live, from the target
    assert "[ct210] follow: ok" in r.stderr      # the log was followed live
