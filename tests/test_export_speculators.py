"""An exported drafter loads in vLLM's speculators 0.9.0 and drafts what the trainer drafts.

speculators loads a z-lab format folder the way its docs say, `DFlashDraftModel.from_pretrained(EXPORT,
verifier=TARGET)`: its DFlash converter turns the folder into a speculators checkpoint (layer ids + 1,
the verifier's embedding and lm_head) and the model loads that. Against the Hugging Face target folder
of tests/hf_target.py, a drafter trained for a few steps and exported in float32 is fed the same
inputs by both sides: blocks [anchor, MASK...] at four anchors of one sequence, with context features
read from the target's hidden states at the layer ids speculators' model holds (so a wrong id mapping
shows), against `Drafter.forward` with the trainer's own features. The draft logits must agree within
tests/tolerance.py's bound for float32 (measured: 3.8e-6 apart with logits up to 13, each side within
4e-6 of the trainer's float64 result; the bound is 2.2e-3) and, run again in float64, within float64's
bound (4e-12), which a change of one weight by a part in 1e8 exceeds. Negative controls: the
converter's ids without its +1, the target's final norm in place of the draft's, one o_proj off by a
part in 1e3.

speculators is not in the venv: `make test-speculators` installs it (--no-deps, with the two small
packages its import needs) into an ignored folder and runs this file with it on the PYTHONPATH;
elsewhere the file is skipped.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.machinery
import importlib.util
import io
import json
import shutil
import sys
import tempfile
import types
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("speculators") is None:
    pytest.skip("vLLM's speculators 0.9.0: run `make test-speculators`", allow_module_level=True)


def _stand_in(name: str) -> types.ModuleType:
    """An importable module whose every public name is a class that refuses to be used."""
    class Absent:
        def __init__(self, *args, **kwargs):
            raise RuntimeError(f"{name} is a stand-in here: speculators' DFlash path was not expected to use it")

    def attr(key: str):
        if key.startswith("__"):  # dynamo and inspect probe dunders on every module; say there are none
            raise AttributeError(key)
        return Absent

    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []
    module.__getattr__ = attr
    return module


# `import speculators` imports every model it has, and EAGLE-3's pulls in its training-data pipeline,
# which imports openai and datasets at module level (speculators/train/data.py,
# data_generation/vllm_client.py); neither runs for DFlash. Rather than install openai (and its HTTP
# stack) and datasets (pyarrow, pandas) for two import statements, stand-ins that raise if used.
_ABSENT = {top for top in ("openai", "datasets") if importlib.util.find_spec(top) is None}
for _name in ("openai", "openai.types", "openai.types.chat", "openai.types.completion", "datasets"):
    if _name.split(".")[0] in _ABSENT:
        sys.modules.setdefault(_name, _stand_in(_name))

# speculators' attention is flex_attention, uncompiled on a CPU (slower, the same values): its business.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")

import hf_target  # noqa: E402
from tolerance import assert_close, drafter_chain  # noqa: E402
from speculators.models.dflash import DFlashDraftModel  # noqa: E402

from trainer.exits import run  # noqa: E402
from trainer.model import masks  # noqa: E402
from trainer import export, specdec  # noqa: E402
from trainer.run.target import load_target  # noqa: E402

# A short run: logits are compared, not acceptance, so the drafter needs weights of its own (its own
# final norm moved off the target's), not skill.
TRAIN = ["--data", "synthetic", "--steps", "20", "--lr", "5e-3", "--batch-size", "8", "--block-size", "4",
         "--anchors", "16", "--synthetic-samples", "64", "--synthetic-prompt-len", "8",
         "--synthetic-new-tokens", "48", "--draft-layers", "2", "--cpu-threads", "1", "--eval-prompts", "0",
         "--checkpoint-every", "0", "--log-every", "50"]
SEQ, ANCHORS = 24, (3, 9, 15, 19)   # speculators takes no anchor in a sequence's last block_size positions


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from loguru import logger

    logger.disable("speculators")   # its converter logs every step at DEBUG to stderr
    root = tmp_path_factory.mktemp("speculators")
    model, out = hf_target.trained(root, *TRAIN)
    with contextlib.redirect_stdout(io.StringIO()):
        assert run(export.main, ["--run", str(out), "-o", str(root / "draft"), "--dtype", "float32"]) == 0
    # from_pretrained converts into tempfile.mkdtemp() and leaves it there: keep it in the test's folder
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tempfile, "tempdir", str(root))
        spec = DFlashDraftModel.from_pretrained(str(root / "draft"), verifier=str(model)).eval()
    cpu = torch.device("cpu")
    target = load_target(str(model), device=cpu, dtype=torch.float32)
    drafter = specdec.load_drafter(str(root / "draft"), target, cpu, torch.float32)
    ids = torch.randint(len(hf_target.SPECIALS), target.model.config.vocab_size, (1, SEQ),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = target.model.base_model(input_ids=ids, output_hidden_states=True).hidden_states
        feats = target.features(ids)
    return SimpleNamespace(root=root, model=model, spec=spec, target=target, drafter=drafter, ids=ids,
                           hidden=hidden, feats=feats)


@torch.no_grad()
def speculators_logits(p, spec, dtype=torch.float32) -> torch.Tensor:
    """speculators' draft logits (len(ANCHORS) * block_size, V) for blocks at ANCHORS, its context features
    read from the target's hidden states at the layer ids it holds (HF index 0 is the embedding)."""
    hidden = [h.to(dtype) for h in p.hidden]
    feats = torch.cat([hidden[i] for i in spec.target_layer_ids], dim=-1)
    loss_mask = torch.zeros(1, SEQ, dtype=torch.long)
    loss_mask[0, list(ANCHORS)] = 1   # with max_anchors = their number, every one is taken, in order
    _, logits, *_ = spec._backbone_forward(feats, p.ids, loss_mask, hidden[-1], torch.zeros_like(p.ids),
                                           max_anchors=len(ANCHORS))
    return logits[0]


@torch.no_grad()
def trainer_logits(p, drafter, dtype=torch.float32) -> torch.Tensor:
    """The trainer's draft logits for the same blocks: Drafter.forward under the training mask of one anchor."""
    bs, out = drafter.cfg.block_size, []
    for a in ANCHORS:
        block = torch.full((1, bs), drafter.cfg.mask_token_id)
        block[0, 0] = p.ids[0, a]
        hidden = drafter(block, torch.arange(a, a + bs)[None], p.feats[:, :a].to(dtype), torch.arange(a)[None],
                         masks.attention_mask(torch.tensor([[a]]), a, bs))
        out.append(drafter.logits(hidden)[0])
    return torch.cat(out)


def logits_chain(cfg) -> int:
    """The reductions a draft logit goes through: the drafter's over context and block keys, the final
    norm and the lm_head (both over the hidden size)."""
    return drafter_chain(cfg, SEQ + cfg.block_size) + 2 * cfg.hidden_size


def test_the_export_loads_with_the_trainers_layers_mask_and_weights(loaded):
    spec, config = loaded.spec, json.loads((loaded.root / "draft" / "config.json").read_text())
    # speculators counts HF hidden-state indices (layer id + 1); the drafter's own final norm, not the target's
    assert spec.target_layer_ids == [i + 1 for i in config["dflash_config"]["target_layer_ids"]] == [2, 3, 4, 5, 6]
    assert spec.mask_token_id == loaded.drafter.cfg.mask_token_id and spec.block_size == 4
    assert torch.equal(spec.norm.weight, loaded.drafter.norm.weight)
    assert not torch.equal(spec.norm.weight, spec.verifier_norm.weight)
    assert torch.equal(spec.fc.weight, loaded.drafter.fc.weight)
    assert torch.equal(spec.embed_tokens.weight, loaded.target.model.get_input_embeddings().weight)


def test_speculators_drafts_the_trainers_logits_in_float32(loaded):
    ours = trainer_logits(loaded, loaded.drafter)
    theirs = speculators_logits(loaded, loaded.spec)
    assert_close(theirs, ours, n=logits_chain(loaded.drafter.cfg), msg="speculators vs trainer, float32")
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


def test_and_in_float64_to_its_rounding(loaded):
    """float32's bound is the worst case over the whole chain; float64 pins the function itself."""
    ours = trainer_logits(loaded, copy.deepcopy(loaded.drafter).double(), torch.float64)
    theirs = speculators_logits(loaded, copy.deepcopy(loaded.spec).double(), torch.float64)
    assert theirs.dtype == torch.float64
    assert_close(theirs, ours, n=logits_chain(loaded.drafter.cfg), msg="speculators vs trainer, float64")


def _layer_ids_without_plus_one(spec):
    spec.config.aux_hidden_state_layer_ids = [i - 1 for i in spec.config.aux_hidden_state_layer_ids]


def _targets_norm(spec):
    spec.norm.weight.data.copy_(spec.verifier_norm.weight)


def _o_proj_off_by_1e3(spec):
    spec.layers[0].self_attn.o_proj.weight.data.mul_(1 + 1e-3)


@pytest.mark.parametrize("breakage", [_layer_ids_without_plus_one, _targets_norm, _o_proj_off_by_1e3],
                         ids=["layer-ids-without-plus-one", "target-final-norm", "o_proj-off-by-1e-3"])
def test_a_broken_model_fails_the_float32_comparison(loaded, breakage):
    spec = copy.deepcopy(loaded.spec)
    breakage(spec)
    with pytest.raises(AssertionError, match="float32"):
        assert_close(speculators_logits(loaded, spec), trainer_logits(loaded, loaded.drafter),
                     n=logits_chain(loaded.drafter.cfg), msg="float32")


def test_speculators_cannot_take_a_drafter_of_the_targets_last_layer(loaded, tmp_path):
    """Why export refuses such a run (test_export_provenance.py): the converter drops the last layer's
    id (it is the verifier's, in speculators) and the fc weight over all tapped layers then fits no model."""
    folder = tmp_path / "last"
    shutil.copytree(loaded.root / "draft", folder)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [1, 2, 3, 4, 7]   # same count: fc's shape is unchanged
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.MonkeyPatch.context() as mp, pytest.raises(RuntimeError, match="size mismatch for fc.weight"):
        mp.setattr(tempfile, "tempdir", str(tmp_path))
        DFlashDraftModel.from_pretrained(str(folder), verifier=str(loaded.model))
