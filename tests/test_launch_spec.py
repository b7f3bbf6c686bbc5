"""The launch spec declared once (orchestrator/remote/runs/spec.py): normalize fills every default and
refuses what is not a launch's, the controller's launch options write through it, and the names both
sides spell (auto, the topology, the probe's file) agree with the trainer's."""
from __future__ import annotations

import pytest

from orchestrator.remote.runs import spec
from orchestrator.runs.options import LaunchOptions


def test_every_key_gets_its_default_and_lists_are_not_shared():
    a, b = spec.normalize({"run": "r1"}), spec.normalize({"run": "r2"})
    assert set(a) == set(spec.FIELDS)
    assert (a["kind"], a["topology"], a["compile_policy"], a["extra"], a["gpus"]) == (
        "train", "threads", "auto", [], None)
    a["extra"].append("--steps")
    assert b["extra"] == [] and spec.FIELDS["extra"][1] == []


@pytest.mark.parametrize("doc, says", [
    ([], "a JSON object"),
    ({}, "no 'run'"),
    ({"run": "r", "topolgy": "threads"}, "unknown key(s) in the launch spec: topolgy"),
    ({"run": "r", "gpus": "2"}, "'gpus': expected int or null, got str"),
    ({"run": "r", "gpus": True}, "'gpus': expected int or null, got bool"),
    ({"run": "r", "extra": None}, "'extra': expected list, got NoneType"),
    ({"run": "r", "cpu_by_default": 1}, "'cpu_by_default': expected bool, got int"),
])
def test_what_is_not_a_launch_spec_is_refused_naming_the_key(doc, says):
    with pytest.raises(spec.SpecError) as e:
        spec.normalize(doc)
    assert says in str(e.value)


def test_the_controllers_options_are_a_launch_spec():
    opts = LaunchOptions.build(gpus=2, topology="processes", compile_policy="eager", extra=["--steps", "5"],
                               name="first try")
    doc = spec.normalize({**opts.doc(), "run": "r"})
    assert (doc["gpus"], doc["topology"], doc["compile_policy"], doc["extra"], doc["name"]) == (
        2, "processes", "eager", ["--steps", "5"], "first try")


def test_the_names_both_sides_spell_agree_with_the_trainers():
    from trainer import policies
    from trainer.run.config import TOPOLOGIES

    assert spec.AUTO_POLICY == policies.AUTO
    assert spec.PROBE_FILE == policies.PROBE_FILE
    assert spec.DEFAULT_TOPOLOGY == TOPOLOGIES[0]
    assert spec.FIELDS["compile_policy"][1] == LaunchOptions().compile_policy


def _launch_reply_keys() -> set[str]:
    """The keys of the runs agent's launch reply, read from its source (_launch's emit({...}))."""
    import ast
    import inspect

    from orchestrator.remote.runs import runs_agent as agent
    tree = ast.parse(inspect.getsource(agent._launch))
    emits = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "emit"
             and c.args and isinstance(c.args[0], ast.Dict)]
    keys = {k.value for c in emits for k in c.args[0].keys if isinstance(k, ast.Constant)}
    assert "pid" in keys, keys
    return keys


def test_the_launch_reply_is_read_once_into_the_result_and_every_key_it_sends_is_a_field():
    from dataclasses import fields

    from orchestrator.errors import OpsError
    from orchestrator.runs.launch import LaunchResult
    names = {f.name for f in fields(LaunchResult)}
    assert _launch_reply_keys() - names == {"ok", "rundir"}     # what the result does not keep
    r = LaunchResult.from_reply("ct200", {"ok": True, "run": "r1", "pid": 7, "gpu_ids": None, "kind": "regen",
                                          "attempt": 2, "rundir": "/x"}, seconds=1.5)
    assert (r.target, r.run, r.pid, r.gpu_ids, r.kind, r.attempt, r.seconds, r.slots) == (
        "ct200", "r1", 7, [], "regen", 2, 1.5, [])
    with pytest.raises(OpsError, match="launch reply has no pid"):
        LaunchResult.from_reply("ct200", {"run": "r1"})
