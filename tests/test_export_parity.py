"""An exported drafter is correct when the reference implementation loads it and gets the same result.

Against a Hugging Face target folder built here (the `tiny` Qwen3 saved with save_pretrained, a
word-level tokenizer with a chat template and a mask token): train a drafter for a few seconds,
export it, load the folder with the reference package (z-lab's `dflash` 0.1.0,
`DFlashDraftModel.from_pretrained`), run its `dflash_generate` greedily against the same target
on the run's eval prompts, and require its acceptance length of every round of every prompt to
equal the trainer's own eval (`python -m trainer.eval`). Any difference in attention inputs,
norms, RoPE positions or layer selection changes some round; the negative controls show that a
deliberately broken export does.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import hf_target  # noqa: E402
from trainer.run import acceptance as trainer_eval  # noqa: E402
from trainer import export  # noqa: E402
from trainer.exits import run  # noqa: E402
from trainer.run.target import load_target  # noqa: E402

# The reference, installed by `make venv` (pip --no-deps: its model code needs torch and
# transformers only). Its timing helper calls torch.cuda.synchronize(), which a CPU-only torch
# refuses: only the clock is replaced, nothing that decides a token.
dflash_model = pytest.importorskip("dflash.model", reason="the reference package: run `make venv`")
dflash_model._cuda_time = time.perf_counter

# dflash_generate passes `past_key_values`, which transformers 5 deprecates (its business, not ours).
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
NEW_TOKENS = 32
TRAIN = ["--data", "synthetic", "--steps", "200", "--lr", "5e-3", "--batch-size", "8", "--block-size", "4",
         "--anchors", "16", "--synthetic-samples", "256", "--synthetic-prompt-len", "8",
         "--synthetic-new-tokens", "48", "--draft-layers", "2", "--cpu-threads", "1", "--eval-prompts", "4",
         "--eval-new-tokens", str(NEW_TOKENS), "--checkpoint-every", "0", "--log-every", "50",
         "--adam-beta2", "0.95"]


def quiet(fn, argv) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert run(fn, argv) == 0
    return buf.getvalue()


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    model, out = hf_target.trained(root, *TRAIN)
    quiet(export.main, ["--run", str(out), "-o", str(root / "draft"), "--dtype", "float32"])
    ours = json.loads(quiet(trainer_eval.main, ["--out", str(out)]).splitlines()[-1])
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    eos = sorted(load_target(str(model), device=torch.device("cpu"), dtype=torch.float32).eos_ids())
    prompts = json.loads((out / "eval_prompts.json").read_text())
    return SimpleNamespace(root=root, model=model, out=out, ours=ours, target=target, eos=eos, prompts=prompts)


def reference_rounds(p, folder: Path) -> list[list[int]]:
    draft = dflash_model.DFlashDraftModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    return [dflash_model.dflash_generate(draft, p.target, torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                         stop_token_ids=p.eos, return_stats=True).acceptance_lengths
            for prompt in p.prompts]


def test_reference_accepts_round_for_round_what_our_eval_accepts(parity):
    ref = reference_rounds(parity, parity.root / "draft")
    ours = parity.ours["acceptance_lengths"]
    assert len(ref) == len(parity.prompts) == 4
    assert ref == ours
    # Not a vacuous match: the drafter gets drafts accepted in several rounds.
    assert sum(r > 1 for rounds in ref for r in rounds) >= 3 and max(map(max, ref)) >= 3, ref


def test_the_folder_is_the_reference_format(parity):
    folder = parity.root / "draft"
    draft, info = dflash_model.DFlashDraftModel.from_pretrained(str(folder), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_target_layers"] == 8 and config["block_size"] == 4 and config["num_hidden_layers"] == 2
    tok = hf_target.tokenizer()
    assert config["dflash_config"] == {"target_layer_ids": [1, 2, 3, 4, 5], "mask_token_id": tok.mask_token_id,
                                       "mask_token": "<|mask|>"}
    assert draft.mask_token_id == tok.mask_token_id and draft.target_layer_ids == [1, 2, 3, 4, 5]
    from safetensors.torch import load_file

    from trainer.run import checkpoint

    weights = load_file(str(folder / "model.safetensors"))
    trained = checkpoint.load(checkpoint.find_latest(parity.out)).model
    assert set(weights) == set(trained) and "norm.weight" in weights
    assert all(torch.equal(weights[k], trained[k]) for k in weights)
    # The default dtype is bf16, and the reference loads that too
    quiet(export.main, ["--run", str(parity.out), "-o", str(parity.root / "bf16")])
    bf16 = load_file(str(parity.root / "bf16" / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in bf16.values())
    assert json.loads((parity.root / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    dflash_model.DFlashDraftModel.from_pretrained(str(parity.root / "bf16"))


def _reverse_layers(config, weights, target):
    config["dflash_config"]["target_layer_ids"].reverse()


def _targets_norm(config, weights, target):
    weights["norm.weight"] = target.model.norm.weight.detach().clone()


def _roll_fc(config, weights, target):
    weights["fc.weight"] = weights["fc.weight"].roll(weights["fc.weight"].shape[0], dims=1)  # layer order


@pytest.mark.parametrize("breakage", [_reverse_layers, _targets_norm, _roll_fc],
                         ids=["wrong-layer-order", "target-final-norm", "fc-columns-rolled"])
def test_a_broken_export_fails_the_comparison(parity, breakage, tmp_path):
    """Negative controls: the comparison above catches a wrong layer selection, the frozen target
    norm the trainer used to serve with, and fc weights that meet the wrong layers."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(parity.root / "draft", folder)
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    breakage(config, weights, parity.target)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))
    assert reference_rounds(parity, folder) != parity.ours["acceptance_lengths"]


def test_specdec_decodes_round_for_round_as_the_reference(parity):
    """`python -m trainer.specdec`'s loop (KV caches on both sides, the exported folder loaded back)
    against the reference's own speculative generate on the same target and prompts: the same tokens
    and the same tokens per round, every round. A drafter that drops or misplaces a cached
    context position changes some round here (the KV cache's own test compares it to the full
    forward)."""
    from trainer import specdec

    target = load_target(str(parity.model), device=torch.device("cpu"), dtype=torch.float32)
    drafter = specdec.load_drafter(str(parity.root / "draft"), target, torch.device("cpu"), torch.float32)
    draft = dflash_model.DFlashDraftModel.from_pretrained(str(parity.root / "draft"), dtype=torch.float32).eval()
    eos = target.eos_ids()
    rounds = []
    for prompt in parity.prompts:
        ref = dflash_model.dflash_generate(draft, parity.target, torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                           stop_token_ids=parity.eos, return_stats=True)
        out, produced, _ = trainer_eval.speculative_generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS,
                                                             eos=eos, cached=True)
        assert produced == ref.acceptance_lengths
        assert out == ref.output_ids[0, len(prompt):].tolist()
        rounds += produced
    assert sum(r > 1 for r in rounds) >= 3  # not a vacuous match: drafts were accepted


def test_the_graphs_engine_decodes_round_for_round_as_the_reference(parity):
    """`trainer.specdec --engine graphs` (static caches, a mask in place of every crop; uncaptured on a
    CPU) against the reference's own speculative generate: the same tokens and tokens per round."""
    from trainer import specdec
    from trainer.run.decode_graphs import GraphDecoder

    target = load_target(str(parity.model), device=torch.device("cpu"), dtype=torch.float32)
    drafter = specdec.load_drafter(str(parity.root / "draft"), target, torch.device("cpu"), torch.float32)
    draft = dflash_model.DFlashDraftModel.from_pretrained(str(parity.root / "draft"), dtype=torch.float32).eval()
    dec = GraphDecoder(target, drafter, max(map(len, parity.prompts)) + NEW_TOKENS)
    rounds = []
    for prompt in parity.prompts:
        ref = dflash_model.dflash_generate(draft, parity.target, torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                           stop_token_ids=parity.eos, return_stats=True)
        got = dec.speculative(prompt, NEW_TOKENS)
        assert got.produced == ref.acceptance_lengths
        assert got.tokens == ref.output_ids[0, len(prompt):].tolist()
        rounds += got.produced
    assert sum(r > 1 for r in rounds) >= 3  # not a vacuous match: drafts were accepted
