"""Trainer flags and YAML: defaults < --config FILE < flags; unknown keys and bad values are one-line errors."""
from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from trainer.run.config import TrainConfig
from trainer.run.flags import add_trainer_options, build_parser, parse
from trainer.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


def test_yaml_sets_any_flag_and_flags_win(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("steps: 7\ncompile_policy: inductor\nbatch-size: 4\nlr: 1\nresume: true\nout: from-yaml\n")
    c = parse(["--config", str(cfg), "--steps", "9"])
    assert (c.steps, c.compile_policy, c.batch_size, c.lr, c.resume, c.out) == (
        9, "inductor", 4, 1.0, True, "from-yaml")
    assert parse([]) == TrainConfig(workdir=c.workdir)


@pytest.mark.parametrize("text, needle", [
    ("stepz: 3\n", "unknown key 'stepz'"),
    ("steps: 2.5\n", "key 'steps': expected int"),
    ("resume: yes please\n", "key 'resume': expected bool"),
    ("- steps\n", "expected a mapping"),
    ("steps: [1,\n", "not valid YAML"),
    ("gpus: 2\nworkers: 3\n", "one worker per GPU"),
    ("block_size: 16\nseq_len: 8\n", "shorter than one block"),
    ("compile_policy: turbo\n", "--compile-policy 'turbo'"),
    ("target: tiny:x\n", "expected tiny or tiny:SEED"),
    ("keep_checkpoints: 1\n", "--keep-checkpoints must be >= 2"),
    ("epochs: -1\n", "--epochs must be >= 0 (0 = use --steps), got -1"),
    ("anchors: -1\n", "--anchors must be >= 1 (or 0: auto), got -1"),
])
def test_bad_config_names_the_file_and_key(tmp_path, text, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(UsageError) as e:
        parse(["--config", str(cfg)])
    assert needle in str(e.value) and "\n" not in str(e.value)
    if "key" in needle or "YAML" in needle or "mapping" in needle:
        assert str(cfg) in str(e.value)


def test_missing_config_file_and_bad_flags():
    with pytest.raises(UsageError, match="no such file"):
        parse(["--config", "/nonexistent/c.yaml"])
    with pytest.raises(UsageError, match="invalid int value"):
        parse(["--steps", "many"])
    with pytest.raises(UsageError, match="does not split over 2 workers"):
        parse(["--workers", "2", "--batch-size", "3"])


def test_bad_flex_tiles_are_a_usage_error():
    with pytest.raises(UsageError, match="--flex-tiles: .* M1-N1-M2-N2-STAGES-WARPS"):
        parse(["--steps", "3", "--flex-tiles", "64-64"])
    for good in ("default", "32-64-64-32-3-4"):
        assert parse(["--steps", "3", "--flex-tiles", good]).flex_tiles == good


def test_bad_ce_rows_and_gpu_switches_are_a_usage_error():
    with pytest.raises(UsageError, match="--ce-rows: .*positive number of rows"):
        parse(["--steps", "3", "--ce-rows", "-5"])
    with pytest.raises(UsageError, match="--ce-rows"):
        parse(["--steps", "3", "--ce-rows", "lots"])
    for flag in ("--fp32-wgrad", "--ce-kernel"):
        with pytest.raises(UsageError, match=f"{flag} 'yes': expected one of on, off"):
            parse(["--steps", "3", flag, "yes"])
    with pytest.raises(UsageError, match="--topology 'rings': expected one of threads, processes"):
        parse(["--steps", "3", "--topology", "rings"])
    assert parse(["--steps", "3", "--ce-rows", "2048"]).ce_rows == 2048


def test_config_and_package_do_not_import_torch():
    code = ("import sys, trainer, trainer.run.flags, trainer.exits; "
            "trainer.run.flags.parse(['--steps', '3']); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_the_controllers_view_of_the_trainer_and_the_cli_do_not_import_torch():
    """trainer/controller_view.py is all the controller imports of the trainer (tests/test_layout.py):
    it, the CLI with every command registered, and what the view's functions import when called, no torch."""
    code = ("import sys, trainer.controller_view as v, orchestrator.cli; v.build_parser(); v.load_catalog(); "
            "v.check_before_launch(['--steps', '3'], None, 'config'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_help_lists_the_documented_flags():
    p = subprocess.run([sys.executable, "-m", "trainer", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0
    for flag in ("--target", "--data", "--steps", "--seed", "--out", "--resume", "--gpus", "--workers",
                 "--topology", "--compile-policy", "--config"):
        assert flag in p.stdout


def test_every_field_carries_its_help_and_its_choices_are_the_values_validate_takes():
    assert all(f.metadata["help"] for f in fields(TrainConfig))
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        for value in f.metadata["choices"] or ():
            fp8 = ["--fp8-emulate"] if f.name == "precision" and value != "bf16" else []
            assert getattr(parse(["--steps", "3", flag, value, *fp8]), f.name) == value
        if f.metadata["choices"]:
            with pytest.raises(UsageError, match=flag):
                parse(["--steps", "3", flag, "bogus"])


def test_another_parser_takes_the_trainers_options_as_they_are():
    """add_trainer_options (the benchmarks' parsers): the trainer's flags, help and metavar, its defaults, and the
    values validate takes as choices."""
    names = ("fp32_wgrad", "flex_tiles", "ce_rows", "ce_kernel", "precision", "fp8_emulate")
    ap = argparse.ArgumentParser()
    add_trainer_options(ap, names)
    assert vars(ap.parse_args([])) == {n: getattr(TrainConfig(), n) for n in names}
    theirs = {a.dest: a for a in build_parser()._actions}
    for a in ap._actions[1:]:       # [0] is --help
        assert (a.option_strings, a.help, a.metavar) == (theirs[a.dest].option_strings, theirs[a.dest].help,
                                                         theirs[a.dest].metavar)
    got = ap.parse_args(["--precision", "fp8", "--ce-rows", "64", "--fp8-emulate", "--fp32-wgrad", "off"])
    assert (got.precision, got.ce_rows, got.fp8_emulate, got.fp32_wgrad) == ("fp8", 64, True, "off")
    with pytest.raises(SystemExit):
        ap.parse_args(["--ce-kernel", "yes"])
    with pytest.raises(ValueError, match="nope: not a TrainConfig field"):
        add_trainer_options(argparse.ArgumentParser(), ["nope"])


@pytest.mark.parametrize("bench", ["train_step_bench.py", "drafter_bench.py"])
def test_the_benchmarks_show_the_trainers_help_for_its_options(bench):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / bench), "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    shown = "".join(p.stdout.split())     # argparse rewraps (at spaces and after hyphens)
    for a in build_parser()._actions:
        if a.dest in ("fp32_wgrad", "flex_tiles", "ce_rows", "ce_kernel", "precision", "fp8_emulate"):
            assert "".join(a.help.split()) in shown, a.dest


def test_the_demo_config_parses():
    c = parse(["--config", str(ROOT / "trainer" / "demo.yaml")])
    assert c.target == "tiny" and c.steps == 200 and c.block_size == 8


def test_help_says_synthetic_data_is_for_tests_only():
    text = " ".join(build_parser().format_help().split())
    assert "or synthetic, for tests only" in text
    assert "--eval-overlap-ok" in text


def test_the_qwen3_8b_recipe_config_validates(tmp_path):
    """configs/qwen3-8b.yaml (the DFlash recipe) is a valid run config once its paths are the user's."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    c = parse(["--config", str(ROOT / "configs" / "qwen3-8b.yaml"), "--target", "tiny", "--data", str(data)])
    assert (c.draft_layers, c.block_size, c.anchors, c.seq_len) == (5, 16, 512, 3072)
    assert (c.lr, c.warmup, c.grad_clip, c.gamma, c.steps, c.batch_size) == (6e-4, 0.04, 1.0, 7.0, 10000, 32)
    assert (c.adam_beta1, c.adam_beta2, c.weight_decay, c.min_lr) == (0.9, 0.999, 0.0, 0.0)


def test_the_defaults_are_the_recipe_and_the_qwen3_8b_config_agrees_with_them():
    """docs/recipe.md lists these with their sources; configs/qwen3-8b.yaml only adds the Qwen3-8B run's
    paths, its 8-GPU global batch and its eval/checkpoint cadence."""
    d = TrainConfig()
    # anchors 0: auto, the recipe's 512 on a GPU (the demo's 16 on the CPU: trainer/run/sizing.py)
    assert (d.draft_layers, d.block_size, d.anchors, d.seq_len, d.steps) == (5, 16, 0, 3072, 10000)
    assert (d.lr, d.min_lr, d.warmup, d.grad_clip, d.gamma) == (6e-4, 0.0, 0.04, 1.0, 0.0)
    assert (d.adam_beta1, d.adam_beta2, d.weight_decay) == (0.9, 0.999, 0.0)
    # the levers beside the recipe (docs/recipe.md) are off unless asked for
    assert (d.objective, d.position_weights, d.optimizer) == ("ce", "exp", "adamw")
    import yaml

    from trainer.run.sizing import auto_anchors

    recipe = yaml.safe_load((ROOT / "configs" / "qwen3-8b.yaml").read_text())
    own = {"target", "data", "batch_size", "gamma", "chat_template_kwargs", "eval_prompts", "eval_new_tokens",
           "eval_every", "checkpoint_every", "log_every", "anchors"}
    assert recipe["anchors"] == 512 == auto_anchors("cuda")      # the default's choice on a GPU, set in the file
    assert {k: v for k, v in recipe.items() if k not in own} == {k: getattr(d, k) for k in recipe if k not in own}
    from trainer.model.masks import default_gamma

    assert recipe["gamma"] == default_gamma(16) == 7.0 and (default_gamma(10), default_gamma(8)) == (5.0, 4.0)
