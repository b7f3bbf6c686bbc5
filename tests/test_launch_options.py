"""LaunchOptions: a launch's options checked once, whoever builds them (CLI, playbook, several nodes)."""
from __future__ import annotations

import json

import click
import pytest

from orchestrator import inventory
from orchestrator.play import playbook as pb
from orchestrator.runs import launch as runs, nodes
from orchestrator.errors import EXIT_USAGE, FileError, UsageError
from orchestrator.runs.options import POLICIES, TOPOLOGIES, LaunchOptions
from trainer.policies import POLICY_NAMES

INV = inventory.parse("""
default: ct200
hosts: {pve1: {address: pve1.invalid}}
targets:
  ct200: {host: pve1, vmid: 200, gpus: 2, workdir: /root/dflash, train_address: 10.0.0.1}
  ct300: {host: pve1, vmid: 300, gpus: 2, train_address: 10.0.0.2}
""")


def test_the_policy_is_one_of_the_trainers_names_or_auto():
    assert POLICIES == ("auto", *POLICY_NAMES)
    from orchestrator.runs.run_commands import launch

    choices = {p.name: p.type.choices for p in launch.params if isinstance(p.type, click.Choice)}
    assert tuple(choices["topology"]) == TOPOLOGIES  # the CLI checks the same
    assert tuple(choices["compile_policy"]) == POLICIES   # Click's own refusal names the choices
    # one option, two spellings (--policy: the command table's older one); play's launch step is checked by build
    opt = next(p for p in launch.params if p.name == "compile_policy")
    assert opt.opts == ["--compile-policy", "--policy"] and opt.default == "auto"
    with pytest.raises(UsageError, match="--compile-policy bogus: not a policy") as e:
        LaunchOptions.build(compile_policy="bogus")
    assert e.value.exit_code == EXIT_USAGE == 2
    assert LaunchOptions.build().compile_policy == "auto"
    assert LaunchOptions.build(compile_policy="eager").compile_policy == "eager"


@pytest.mark.parametrize("kw, message", [
    ({"gpus": 1, "gpu_ids": "0,1"}, "disagree"),
    ({"gpu_ids": "0,0"}, "named twice"),
    ({"gpu_ids": "a"}, "expected GPU indexes"),
    ({"gpus": -1}, "--gpus must be >= 0"),
    ({"topology": "mesh"}, "--topology must be one of"),
    ({"name": "two\nlines"}, "--name"),
    ({"resume": "R", "extra": ["--steps", "1"]}, "--resume continues the run"),
    ({"resume": "--force"}, "is not a run id"),
    ({"config": "/nonexistent/x.yaml"}, "cannot read"),
    ({"config": "/dev/zero"}, r"--config /dev/zero: not a regular file \(a character device\)"),
    ({"gpu_ids": "9" * 5000}, "expected GPU indexes"),
])
def test_bad_options_are_usage_errors_before_anything_connects(kw, message):
    with pytest.raises(UsageError, match=message):
        LaunchOptions.build(**kw)


def test_a_config_is_a_bounded_regular_file_of_utf8(tmp_path):
    """--config is read as hosts.yaml is: a FIFO is refused, not waited on; over 256 KB or not
    UTF-8, one line naming it (exit 2), never an internal error."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big, latin = tmp_path / "big.yaml", tmp_path / "latin.yaml"
    big.write_text("# x\n" * 70_000)
    latin.write_bytes(b"steps: 3\n# caf\xe9\n")
    for path, needle in ((fifo, "not a regular file (a FIFO)"), (big, "larger than 256 KB"),
                         (latin, f"{latin}:2: not UTF-8 text (byte 0xe9)")):
        with pytest.raises(UsageError) as e:
            LaunchOptions.build(config=str(path))
        assert str(e.value).startswith("--config ") and needle in str(e.value) and e.value.exit_code == 2


def test_the_spec_is_one_document_with_the_target_checks(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("steps: 3\n")
    opts = LaunchOptions.build(gpu_ids="1", config=str(cfg), extra=["--steps", "2"], name="n",
                               env={"A": "1"})
    spec = runs.launch_spec(INV, INV.targets["ct200"], opts, run="R")
    json.dumps(spec.doc)
    assert spec.doc["run"] == "R" and spec.doc["gpus"] == 1 and spec.doc["gpu_ids"] == [1]
    assert spec.doc["config_text"] == "steps: 3\n" and spec.doc["config_name"] == "c.yaml"
    assert spec.doc["extra"] == ["--steps", "2"] and spec.env == {"A": "1"}
    with pytest.raises(UsageError, match="ct200 has GPUs 0..1"):
        runs.launch_spec(INV, INV.targets["ct200"], LaunchOptions.build(gpu_ids="2"))
    with pytest.raises(UsageError, match="--gpus 3 is more than"):     # impossible: bad input, exit 2
        runs.launch_spec(INV, INV.targets["ct200"], LaunchOptions.build(gpus=3))


def test_several_nodes_take_the_same_options():
    targets = [INV.targets["ct200"], INV.targets["ct300"]]
    assert nodes.check_targets(targets, LaunchOptions.build(topology="processes")).startswith("10.0.0.1:")
    with pytest.raises(UsageError, match="add --topology processes"):
        nodes.check_targets(targets, LaunchOptions.build())
    with pytest.raises(UsageError, match="--gpu-ids names GPUs of one target"):
        nodes.check_targets(targets, LaunchOptions.build(topology="processes", gpu_ids="0"))


def test_a_playbooks_policy_is_checked_as_the_cli_checks_it():
    with pytest.raises(FileError, match="bogus"):
        pb.parse("steps:\n  - name: l\n    launch: {compile_policy: bogus}\n", "p.yaml")
    with pytest.raises(FileError, match="compile_policy"):   # the key has the flag's name, and only that
        pb.parse("steps:\n  - name: l\n    launch: {policy: eager}\n", "p.yaml")
    book = pb.parse("steps:\n  - name: l\n    launch: {compile_policy: eager}\n", "p.yaml")
    assert book.steps[0].options["compile_policy"] == "eager"
