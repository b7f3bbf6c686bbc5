"""The drafter's own final norm: trained from the target's, and old checkpoints (without it) resume."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from trainer.run import checkpoint  # noqa: E402
from trainer.run.target import load_target  # noqa: E402
from trainer_quick import train  # noqa: E402


def test_norm_is_trained_and_an_old_checkpoint_without_it_resumes(tmp_path):
    target_norm = load_target("tiny", device=torch.device("cpu"), dtype=torch.float32).head_weights()[1]
    new = tmp_path / "new"
    assert train(new, "--steps", "3", "--eval-prompts", "0") == 0
    w = checkpoint.load(checkpoint.find_latest(new)).model["norm.weight"]
    assert w.shape == target_norm.shape and not torch.equal(w, target_norm)  # started there, then trained

    old = tmp_path / "old"   # what the trainer wrote before the drafter had its own norm
    assert train(old, "--steps", "2", "--eval-prompts", "0", "--freeze-draft-norm") == 0
    ck = checkpoint.load(checkpoint.find_latest(old))
    assert "norm.weight" not in ck.model
    run_cfg = json.loads((old / "trainer-config.json").read_text())
    del run_cfg["freeze_draft_norm"], run_cfg["chat_template_kwargs"], run_cfg["train_thinking"]
    (old / "trainer-config.json").write_text(json.dumps(run_cfg))
    assert train(old, "--steps", "4", "--eval-prompts", "0", "--resume") == 0
    resumed = checkpoint.load(checkpoint.find_latest(old))
    assert resumed.step == 4 and "norm.weight" in resumed.model
    assert not torch.equal(resumed.model["norm.weight"], target_norm)
    log = (old / "metrics.jsonl").read_text()
    assert '"event": "resume"' in log


def test_widening_an_optimizer_state():
    sd = {"state": {0: {}, 1: {}}, "param_groups": [{"params": [0, 1], "lr": 1.0}]}
    checkpoint.add_optimizer_params(sd, 3)
    assert sd["param_groups"][0]["params"] == [0, 1, 2]
    with pytest.raises(ValueError):
        checkpoint.add_optimizer_params(sd, 2)
