"""Export writes what the run trained with, and refuses what would miswire it.

A short CPU run against a Hugging Face target folder (tests/hf_target.py); each test exports a copy
of it whose recorded --target path holds a variant of that target. The four refusals (a changed
target, the same hidden size with another layer count, a running run, an existing output folder,
empty or not) are exit 2 with one line; their overrides export the TRAINED layer ids and mask token.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import hf_target  # noqa: E402
from trainer_quick import QUICK, ROOT, subprocess_env, wait_for  # noqa: E402

from trainer.exits import run  # noqa: E402
from trainer.run import checkpoint, provenance  # noqa: E402
from trainer import export  # noqa: E402
from trainer.run.config import RUN_CONFIG  # noqa: E402

TRAINED_IDS = [1, 2, 3, 4, 5]   # default_layer_ids(8), the HF target's 8 layers


def call(argv) -> tuple[int, dict | None, str]:
    """`python -m trainer.export ARGV` in this process: (exit status, its JSON line, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = run(export.main, [str(a) for a in argv])
    return rc, json.loads(out.getvalue()) if rc == 0 else None, err.getvalue()


def refused(argv, needle: str) -> str:
    rc, _, err = call(argv)
    assert rc == 2 and needle in err, (rc, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return hf_target.trained(tmp_path_factory.mktemp("prov"), *QUICK[2:], "--steps", "3")[1]  # QUICK less --target


def variant(path: Path, *, seed: int = 3, layers: int = 8, hidden: int = 64) -> Path:
    """A target folder like hf_target.build's, with another seed, layer count or hidden size."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.run.tiny import TINY

    torch.manual_seed(seed)
    tok = hf_target.tokenizer()
    cfg = Qwen3Config(**{**TINY, "num_hidden_layers": layers, "hidden_size": hidden}, eos_token_id=tok.eos_token_id)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def retargeted(trained: Path, tmp: Path, make=None) -> Path:
    """A copy of the run whose --target path holds make(path) (default: the same target, copied)."""
    out = tmp / "run"
    shutil.copytree(trained, out)
    cfg = json.loads((out / RUN_CONFIG).read_text())
    target = tmp / "target"
    shutil.copytree(cfg["target"], target) if make is None else make(target)
    (out / RUN_CONFIG).write_text(json.dumps({**cfg, "target": str(target)}))
    return out


def test_every_checkpoint_records_the_target_and_an_unchanged_one_exports(trained, tmp_path):
    ck = checkpoint.load(checkpoint.find_latest(trained))
    rec = ck.meta["target"]
    mask = hf_target.tokenizer().mask_token_id
    assert rec["layer_ids"] == TRAINED_IDS and rec["mask_token_id"] == mask
    assert (rec["num_layers"], rec["hidden_size"], rec["weights_sample_rows"]) == (8, 64, 256)
    assert len(rec["config_sha256"]) == 64 and len(rec["weights_sha256"]) == 64
    assert len(rec["layers_sha256"]) == 64 and rec["layers_sample_rows"] == provenance.LAYER_SAMPLE_ROWS
    out = retargeted(trained, tmp_path)   # moved, byte for byte the same: not a change
    rc, doc, err = call(["--run", out, "-o", tmp_path / "d"])
    assert rc == 0 and err == "", err
    assert doc["target_layer_ids"] == TRAINED_IDS and doc["mask_token_id"] == mask and doc["running"] is False
    assert doc["target_changed"] == []
    prov = json.loads((tmp_path / "d" / export.PROVENANCE).read_text())
    assert prov["target_identity"] == rec and prov["step"] == 3


def test_an_existing_output_folder_needs_force_and_force_replaces_only_an_earlier_export(trained, tmp_path):
    dest = tmp_path / "d"
    dest.mkdir()
    refused(["--run", trained, "-o", dest], "already exists (pass --force")
    rc, doc, _ = call(["--run", trained, "-o", dest, "--force"])       # empty: nothing to lose
    assert rc == 0 and (dest / "config.json").is_file()
    rc, doc, _ = call(["--run", trained, "-o", dest, "--force", "--dtype", "float32"])   # an earlier export
    assert rc == 0 and json.loads((dest / export.PROVENANCE).read_text())["dtype"] == "float32"
    (dest / "notes.txt").write_text("mine")          # no longer only an export: never replaced, whatever the flags
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    refused(["--run", trained, "-o", dest, "--force"], "holds 'notes.txt', which an export does not write")
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]      # no temporary left beside it


def test_a_changed_target_is_refused_and_target_changed_ok_exports_the_trained_ids(trained, tmp_path):
    out = retargeted(trained, tmp_path, lambda p: variant(p, seed=11))
    refused(["--run", out, "-o", tmp_path / "d"], "is not the one the run trained against "
            "(config.json, embedding/lm_head weights, decoder-layer weights); pass --target-changed-ok")
    assert not (tmp_path / "d").exists()
    rc, doc, _ = call(["--run", out, "-o", tmp_path / "d", "--target-changed-ok"])
    assert rc == 0 and doc["target_layer_ids"] == TRAINED_IDS
    assert doc["target_changed"] == ["config.json", "embedding/lm_head weights", "decoder-layer weights"]


def merged_lora(trained: Path, path: Path) -> Path:
    """The run's own target with a rank-2 delta merged into one decoder layer's MLP (what a merged LoRA
    does): the same config.json, embedding and lm_head, byte for byte."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(json.loads((trained / RUN_CONFIG).read_text())["target"], path)
    (f,) = path.glob("*.safetensors")
    tensors = load_file(f)
    w = tensors["model.layers.3.mlp.down_proj.weight"]
    g = torch.Generator().manual_seed(0)
    b, a = torch.randn(w.shape[0], 2, generator=g), torch.randn(2, w.shape[1], generator=g)
    tensors["model.layers.3.mlp.down_proj.weight"] = (w.float() + 1e-3 * b @ a).to(w.dtype)
    save_file(tensors, f, metadata={"format": "pt"})
    return path


def test_a_target_whose_decoder_layers_changed_is_a_changed_target(trained, tmp_path):
    out = retargeted(trained, tmp_path, lambda p: merged_lora(trained, p))
    refused(["--run", out, "-o", tmp_path / "d"], "is not the one the run trained against "
            "(decoder-layer weights); pass --target-changed-ok")
    rc, doc, _ = call(["--run", out, "-o", tmp_path / "d", "--target-changed-ok"])
    assert rc == 0 and doc["target_changed"] == ["decoder-layer weights"]


def test_same_hidden_size_other_layer_count_no_longer_exports_other_layer_ids(trained, tmp_path):
    """The miswire: a 12-layer target of the same hidden size used to export layer ids [1,3,5,7,9]."""
    out = retargeted(trained, tmp_path, lambda p: variant(p, layers=12))
    refused(["--run", out, "-o", tmp_path / "d"],
            "(layers 8 -> 12, config.json, embedding/lm_head weights, decoder-layer weights)")
    rc, doc, _ = call(["--run", out, "-o", tmp_path / "d", "--target-changed-ok"])
    assert rc == 0 and doc["target_layer_ids"] == TRAINED_IDS
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == TRAINED_IDS and config["num_target_layers"] == 12
    assert config["dflash_config"]["mask_token_id"] == hf_target.tokenizer().mask_token_id


def test_another_shape_or_too_few_layers_is_refused_even_with_target_changed_ok(trained, tmp_path):
    out = retargeted(trained, tmp_path, lambda p: variant(p, hidden=128))
    refused(["--run", out, "-o", tmp_path / "d", "--target-changed-ok"], "hidden size 64 -> 128")
    out = retargeted(trained, tmp_path / "b", lambda p: variant(p, layers=4))
    refused(["--run", out, "-o", tmp_path / "d", "--target-changed-ok"],
            "the run read target layers [1, 2, 3, 4, 5]; the target at")
    assert not (tmp_path / "d").exists()


def test_a_checkpoint_without_the_record_still_exports_with_one_line(trained, tmp_path):
    out = retargeted(trained, tmp_path)
    meta_path = checkpoint.find_latest(out) / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["target"]
    meta_path.write_text(json.dumps(meta))
    rc, doc, err = call(["--run", out, "-o", tmp_path / "d"])
    assert rc == 0 and doc["target_layer_ids"] == TRAINED_IDS
    assert len(err.strip().splitlines()) == 1 and "records no target identity" in err, err


def test_a_running_run_needs_running_ok_and_says_which_step(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *QUICK, "--steps", "100000", "--checkpoint-every", "2",
                             "--out", str(out)], cwd=ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait_for(lambda: checkpoint.find_latest(out), timeout=120, what="a checkpoint")
        assert provenance.is_running(out)
        refused(["--run", out, "-o", tmp_path / "d"], "still running (pass --running-ok")
        rc, doc, _ = call(["--run", out, "-o", tmp_path / "d", "--running-ok"])
        assert rc == 0 and doc["running"] is True and doc["step"] >= 2 and doc["step"] % 2 == 0
        assert json.loads((tmp_path / "d" / export.PROVENANCE).read_text())["running"] is True
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143, proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert not provenance.is_running(out)
    rc, doc, _ = call(["--run", out, "-o", tmp_path / "e"])
    assert rc == 0 and doc["running"] is False


def test_changes_names_the_layers_read_and_the_mask_token_where_both_sides_record_them():
    then = {"target": "t", "config_sha256": "c", "num_layers": 8, "hidden_size": 64, "vocab_size": 300,
            "weights_sha256": "w", "weights_sample_rows": 256, "layer_ids": [1, 3, 5], "mask_token_id": 7}
    now = {**then, "layer_ids": [1, 3, 6], "mask_token_id": 8}        # a resume: the target recorded as now
    assert provenance.changes(then, now) == {"layer_ids": "layer_ids [1, 3, 5] -> [1, 3, 6]",
                                             "mask_token_id": "mask_token_id 7 -> 8"}
    identity = {k: v for k, v in now.items() if k not in ("layer_ids", "mask_token_id")}   # export, eval
    assert provenance.changes(then, identity) == {}
    # the decoder layers' hash: compared where both sides have it; a record older than it has none
    layered = {**identity, "layers_sha256": "l", "layers_sample_rows": 16}
    assert provenance.changes(then, layered) == {}
    assert provenance.changes({**then, "layers_sha256": "k", "layers_sample_rows": 16}, layered) == {
        "layers_sha256": "decoder-layer weights"}


def test_a_resume_against_a_changed_target_is_refused_unless_target_changed_ok(trained, tmp_path):
    from trainer.train import train_entry

    out = retargeted(trained, tmp_path, lambda p: variant(p, seed=11))
    argv = ["--target", str(tmp_path / "target"), *QUICK[2:], "--steps", "4", "--out", str(out), "--resume"]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert run(train_entry, argv) == 2
    line = err.getvalue().strip()
    assert len(line.splitlines()) == 1 and "is not the one" in line and "--target-changed-ok" in line, line
    assert "embedding/lm_head weights" in line and checkpoint.find_latest(out).name.endswith("3")
    with contextlib.redirect_stdout(io.StringIO()):
        assert run(train_entry, argv + ["--target-changed-ok"]) == 0
    assert checkpoint.load(checkpoint.find_latest(out)).step == 4
    # another shape is refused even with the flag, in one line, before its weights meet the drafter
    out = retargeted(trained, tmp_path / "b", lambda p: variant(p, hidden=128))
    argv = ["--target", str(tmp_path / "b" / "target"), *QUICK[2:], "--steps", "4", "--out", str(out), "--resume",
            "--target-changed-ok"]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert run(train_entry, argv) == 2
    assert err.getvalue().strip().splitlines() == [
        f"trainer: error: --target-changed-ok: the target at {tmp_path / 'b' / 'target'} has another shape "
        "(hidden size 64 -> 128, config.json, embedding/lm_head weights, decoder-layer weights); "
        "the drafter cannot serve it"], err.getvalue()


def test_eval_measures_with_the_trained_layers_and_refuses_a_changed_target(trained, tmp_path, monkeypatch):
    from trainer.run import acceptance as trainer_eval
    from trainer.run import target as target_mod

    asked = []
    real = target_mod.load_target
    monkeypatch.setattr(target_mod, "load_target", lambda *a, **k: asked.append(k.get("layers")) or real(*a, **k))
    out = retargeted(trained, tmp_path, lambda p: variant(p, layers=12))
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert run(trainer_eval.main, ["--out", str(out), "--prompts", "1", "--new-tokens", "4"]) == 2
    assert "(layers 8 -> 12" in err.getvalue() and "--target-changed-ok" in err.getvalue(), err.getvalue()
    with contextlib.redirect_stdout(io.StringIO()):
        assert run(trainer_eval.main, ["--out", str(out), "--prompts", "1", "--new-tokens", "4",
                                       "--target-changed-ok"]) == 0
    assert list(asked[-1]) == TRAINED_IDS    # a 12-layer target's default would be [1, 3, 5, 7, 9]


def test_the_runs_agent_refuses_a_running_run_in_the_trainers_words():
    """Two checks, each where it must be: the runs agent judges by the run's state (a trainer older
    than the lock included) before it starts trainer.export, which checks the lock for a run by hand.
    The agent cannot import the trainer: its copy of the words must stay the trainer's."""
    from orchestrator.remote.runs import export as agent_side

    assert agent_side.STILL_RUNNING == export.STILL_RUNNING


def test_a_run_that_reads_the_targets_last_layer_is_refused(tmp_path):
    """Layer 7 of the 8: the reference would read it (the final norm's output), but speculators' converter
    keeps the last layer for the verifier only and cannot load the folder (tests/test_export_speculators.py)."""
    out = hf_target.trained(tmp_path, *QUICK[2:], "--steps", "1", "--target-layers", "1,4,7")[1]
    refused(["--run", out, "-o", tmp_path / "d"], "the drafter reads the target's last layer (7 of 8), which "
            "speculators (vLLM's DFlash format) keeps for the verifier only; train with --target-layers below 7")
    assert not (tmp_path / "d").exists()
