"""`launch` refuses what cannot work before anything starts, through a real sshd into the pct
stand-in, driven by the `dflash-ops` CLI: a config or flag typo (the trainer's own rules, checked
on the controller), a target python without torch, a container with GPUs that hosts.yaml gives
none. Each refusal is one line, and no run is created."""
import os
import subprocess
import sys

import pytest
from trainer_quick import CLI_MAIN, copy_trainer, tiny_run_config

from orchestrator import inventory
from orchestrator.deploy import sync as deploy

WORKDIR = "/srv/ct/dflash"
NO_TORCH_PYTHON = "/usr/bin/python3"     # Debian's python: the agent's stdlib, no torch


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return copy_trainer(tmp_path_factory.mktemp("src"))


def cli(path, *args, timeout=180):
    return subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", str(path), *map(str, args)],
                          capture_output=True, timeout=timeout)


def one_line(r) -> str:
    err = r.stderr.decode()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def runs_in(fakepct) -> list[str]:
    folder = fakepct.private(200) / "dflash" / "runs"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def deployed(make_inventory, fakepct, source, **target):
    fakepct.create(200)
    path = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable,
                                     "workdir": WORKDIR, **target}})
    res = deploy.deploy(inventory.load(str(path)), ["ct200"], source=str(source))["ct200"]
    assert res.ok, res.error
    return path


def test_a_config_or_flag_typo_is_exit_2_with_did_you_mean_and_no_run(sshd, fakepct, make_inventory, source,
                                                                        tmp_path):
    path = deployed(make_inventory, fakepct, source)
    cfg = tmp_path / "train.yaml"
    cfg.write_text(tiny_run_config() + "stpes: 200\n")
    line = len(tiny_run_config().splitlines()) + 1
    r = cli(path, "launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", cfg)
    assert r.returncode == 2
    assert f"train.yaml:{line}: unknown key 'stpes' (did you mean 'steps'?)" in one_line(r)
    r = cli(path, "launch", "ct200", "--gpus", "0", "--policy", "eager", "--", "--stpes", "3")
    assert r.returncode == 2 and "--stpes 3 (did you mean --steps?)" in one_line(r)
    # a rule across settings: 3 sequences do not split over 2 workers
    r = cli(path, "launch", "ct200", "--gpus", "0", "--workers", "2", "--policy", "eager",
            "--", "--batch-size", "3")
    assert r.returncode == 2 and "--batch-size 3 does not split over 2 workers" in one_line(r)
    assert runs_in(fakepct) == []


def test_a_flag_typed_before_the_dashes_is_refused_with_the_line_that_has_it_after(tmp_path):
    path = tmp_path / "hosts.yaml"      # nothing connects: click's parse refuses it
    path.write_text("targets:\n  ct200: {}\n")
    r = cli(path, "launch", "ct200", "--gpus", "2", "--steps", "5", "--follow")
    assert r.returncode == 2 and one_line(r) == (
        "dflash-ops: --steps is not an option of `dflash-ops launch`; trainer flags go after `--`: "
        "`dflash-ops launch ct200 --gpus 2 --follow -- --steps 5`\n")
    r = cli(path, "launch", "ct200", "--gpu", "0")     # launch's own near name, and no trainer flag: not moved
    assert r.returncode == 2 and one_line(r) == (
        "dflash-ops: --gpu is not an option of `dflash-ops launch` (did you mean --gpu-ids or --gpus?), nor one of "
        "the trainer flags (`dflash-ops launch --help`; `python -m trainer --help`)\n")
    r = cli(path, "launch", "--foll")    # a typo of launch's own: its near name too
    assert r.returncode == 2
    assert "--foll is not an option of `dflash-ops launch` (did you mean --follow?)" in one_line(r)
    r = cli(path, "regen", "ct200", "--prompts", "p.jsonl", "--model", "m", "--max-new", "5", "--", "--seed", "1")
    assert r.returncode == 2 and one_line(r).endswith(
        "regen flags go after `--`: `dflash-ops regen ct200 --prompts p.jsonl --model m -- --max-new 5 --seed 1`\n")


def test_a_target_python_without_torch_is_refused_with_the_bootstrap_line(sshd, fakepct, make_inventory,
                                                                          source, tmp_path):
    path = deployed(make_inventory, fakepct, source, python=NO_TORCH_PYTHON)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_run_config())
    r = cli(path, "launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", cfg)
    assert r.returncode == 1
    err = one_line(r)
    assert f"ct200: {NO_TORCH_PYTHON} (hosts.yaml `python:`) has no torch" in err
    assert "`dflash-ops play playbooks/bootstrap.yaml ct200 --var torch=" in err
    assert runs_in(fakepct) == []


def test_a_container_with_gpus_but_no_gpus_key_is_refused_not_trained_on_the_cpu(sshd, fakepct, make_inventory,
                                                                                 source, tmp_path):
    bin_dir = tmp_path / "bin"          # the container's nvidia-smi: two GPUs
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-1)'\n")
    smi.chmod(0o755)
    path = deployed(make_inventory, fakepct, source, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_run_config(steps=1, eval_prompts=0))
    r = cli(path, "launch", "ct200", "--policy", "eager", "--config", cfg)
    assert r.returncode == 1
    err = one_line(r)
    assert "ct200: the container has 2 GPU(s) but hosts.yaml gives ct200 none" in err
    assert "set `gpus: 2` under targets.ct200 in hosts.yaml, or pass --gpus 0" in err
    assert runs_in(fakepct) == []
    # said out loud, the CPU is fine
    r = cli(path, "launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", cfg)
    assert r.returncode == 0, r.stderr.decode()
    assert runs_in(fakepct) == [r.stdout.decode().strip()]
    assert cli(path, "logs", "ct200", "--follow").returncode == 0
