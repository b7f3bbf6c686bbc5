"""The kinds of run (orchestrator/remote/runs/kinds.py): the command each starts, built once for the
runs agent on the target and the controller's check of the trainer's flags (pure functions)."""
import pytest

from orchestrator import inventory
from orchestrator.errors import UsageError
from orchestrator.remote.runs.kinds import KINDS, kind_of, run_command, trainer_flags
from orchestrator.runs import launch, regen
from orchestrator.runs.options import LaunchOptions
from trainer.run.flags import check_before_launch

NODES = {"targets": ["a", "b"], "index": 0, "endpoint": "10.0.0.1:29400", "address": "10.0.0.1"}


def test_a_training_run_starts_the_trainer_with_the_flags_the_controller_checks():
    spec = {"run": "r1", "topology": "processes", "workers": 2, "nodes": NODES, "extra": ["--steps", "7"]}
    argv, output = run_command(spec, "/w/runs/r1", 0, "eager", "/w/runs/r1/c.yaml", True)
    assert output is None
    assert argv == ["-m", "trainer", "--out", "/w/runs/r1", "--gpus", "0", "--topology", "processes",
                    "--compile-policy", "eager", "--workers", "2", "--config", "/w/runs/r1/c.yaml", "--resume",
                    "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-id", "r1",
                    "--node-address", "10.0.0.1", "--rdzv-host", "--steps", "7"]
    # every flag the agent passes is one the trainer takes, by its own parser and rules
    cfg = check_before_launch(argv[2:])
    assert (cfg.nnodes, cfg.rdzv_host, cfg.steps, cfg.workers) == (2, True, 7, 2)
    assert "--rdzv-host" not in trainer_flags(dict(spec, nodes=dict(NODES, index=1)), 0, "eager")


def test_the_controller_checks_the_trainers_flags_as_the_agent_builds_them():
    inv = inventory.parse("targets:\n  a: {gpus: 0, train_address: 10.0.0.1}\n")
    ok = LaunchOptions.build(gpus=0, topology="processes", workers=2, extra=["--steps", "3"])
    launch.launch_spec(inv, inv.target("a"), ok, run="r1", nnodes=2)
    bad = LaunchOptions.build(gpus=0, topology="threads", extra=["--steps", "3"])
    with pytest.raises(UsageError, match="needs --topology processes.*nothing was launched"):
        launch.launch_spec(inv, inv.target("a"), bad, run="r1", nnodes=2)


def test_the_controller_has_no_copy_of_the_trainers_argv(monkeypatch):
    """What the controller checks is what trainer_flags builds, the agent's own builder: a flag it
    added would reach the check, not only the trainer."""
    inv = inventory.parse("targets:\n  a: {gpus: 0}\n")
    seen = []

    def flags(spec, gpus, policy, config=None, resume=False):
        seen.append(trainer_flags(spec, gpus, policy, config, resume))
        return seen[-1] + ["--no-such-flag"]
    monkeypatch.setattr(launch, "trainer_flags", flags)
    with pytest.raises(UsageError, match="no-such-flag"):
        launch.launch_spec(inv, inv.target("a"), LaunchOptions.build(gpus=0, compile_policy="eager"), run="r1")
    assert seen == [["--gpus", "0", "--topology", "threads", "--compile-policy", "eager"]]


def test_a_regen_run_takes_no_policy_no_rendezvous_and_writes_its_rows_in_its_folder():
    argv, output = run_command({"kind": "regen", "extra": ["--target", "m"]}, "/w/runs/r2", 1, None, None, True)
    assert argv == ["-m", "trainer.regen", "--prompts", "/w/runs/r2/prompts.jsonl", "--out", "/w/runs/r2/regen.jsonl",
                    "--gpus", "1", "--target", "m"]
    assert output == "/w/runs/r2/regen.jsonl"
    assert regen.PROMPTS in KINDS["regen"]["inputs"]       # uploaded under the name the agent reads
    kind = kind_of({"kind": "regen"})
    assert not (kind["policy"] or kind["nodes"] or kind["drafter"] or kind["pruned"])
    assert kind_of({})["module"] == "trainer" and kind_of({"kind": "newer"})["module"] is None


def test_regen_on_several_nodes_is_refused_before_anything_connects(tmp_path):
    inv = inventory.parse("targets:\n  a: {gpus: 0, train_address: 10.0.0.1}\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    opts, rows = regen.regen_options(prompts=str(prompts), model="m", gpus=0)
    assert rows == 1
    with pytest.raises(UsageError, match="^a regen run runs on one target; name one, not 2$"):
        launch.launch_spec(inv, inv.target("a"), opts, run="r1", nnodes=2)
    assert launch.launch_spec(inv, inv.target("a"), opts, run="r1").doc["kind"] == "regen"


def test_a_launch_uploads_exactly_its_kinds_inputs(tmp_path, capsys):
    """runs/upload.py takes the files KINDS names for the launch's kind, no other, before reading a byte."""
    import io
    import json

    from orchestrator.remote.runs.spec import normalize
    from orchestrator.remote.runs.upload import receive

    def received(spec):     # as cmd_launch calls it: on the spec normalized at the agent's door
        try:
            return receive(io.BytesIO(b""), str(tmp_path), normalize(dict(spec, run="r1")))
        except SystemExit:
            return json.loads(capsys.readouterr().out)

    empty = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"     # sha256 of b""
    one = [{"name": "prompts.jsonl", "size": 0, "sha256": empty}]
    assert received({}) is None
    for spec, sent in (({"files": one}, "prompts.jsonl"), ({"kind": "regen"}, "none"),
                       ({"kind": "regen", "files": one + [dict(one[0], name="x")]}, "prompts.jsonl, x")):
        doc = received(spec)
        assert doc["reason"] == "bad_upload" and doc["message"].endswith(f"this launch sent {sent}"), doc
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    folder = received({"kind": "regen", "files": one})
    assert [p.name for p in (tmp_path / folder).iterdir()] == ["prompts.jsonl"]
