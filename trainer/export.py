"""Export a run's checkpoint as the DFlash draft-model folder that serving engines load.

    python -m trainer.export --run OUT [--step N] -o DIR [--dtype bfloat16|float16|float32] [--force]
                             [--running-ok] [--target-changed-ok]

DIR is a Hugging Face folder in the format of the reference implementation (z-lab's `dflash`,
`DFlashDraftModel.from_pretrained`), which SGLang and vLLM also read (docs/export.md):

    config.json         a Qwen3 config of the draft layers, architectures ["DFlashDraftModel"],
                        block_size, num_target_layers (the TARGET's layer count) and
                        dflash_config {target_layer_ids, mask_token_id, mask_token}
    model.safetensors   fc, hidden_norm, layers.N.{...}, norm (the draft's own final norm)
    dflash_ops.json     where it came from: run, step, checkpoint, target and its identity, dtype

The layer ids and the mask token id are the ones the run trained with, as its checkpoint records
them (trainer/run/provenance.py), never re-derived from what sits at the target path now. Refused
(exit 2, one line): a target at that path that is not the one the run trained against (unless
--target-changed-ok, for a target of the same hidden size and vocab), a run still running (unless
--running-ok; the JSON line then says `"running": true` and which step it holds), an existing DIR,
empty or not (unless --force), a DIR that is not an earlier export even with --force (trainer/owned.py),
a run whose drafter reads the target's last layer (speculators, vLLM's format, cannot represent it;
docs/export.md). A checkpoint written before the record existed still exports, as
before, with one line on stderr saying so.

The target's embedding and lm_head are not in the folder: a server uses the target's own. The
folder is written beside DIR under a temporary name and renamed into place, so DIR is either
absent or complete. Prints one JSON line (the folder, its files, step). Bad input: one line, exit 2.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from trainer import faults, owned
from trainer.files import atomic_folder
from trainer.writer_lock import output_lock
from trainer.errors import TrainerError, UsageError

DTYPES = ("bfloat16", "float16", "float32")
ARCHITECTURE = "DFlashDraftModel"
PROVENANCE = owned.EXPORT_PROVENANCE
# The refusal of a run still running. The runs agent refuses with the same words by the run's state
# (it cannot import this; a test holds the two equal), which also catches a trainer older than the
# lock; this check is the one of `python -m trainer.export` run by hand.
# The refusal of a run that reads the target's last layer. Here that tap is the final norm's output
# (HF's hidden_states[L], as the reference reads it); speculators, vLLM's DFlash checkpoint format, keeps
# the last layer's output for the verifier only, never as drafter input: its converter drops the id and
# the fc weight no longer fits the remaining layers (docs/export.md, "Loading it in vLLM's speculators").
LAST_LAYER = ("the drafter reads the target's last layer ({last} of {n}), which speculators (vLLM's DFlash format) "
              "keeps for the verifier only; train with --target-layers below {last} (the default stops at L-3)")
STILL_RUNNING = "the run is still running (pass --running-ok to export its newest complete checkpoint)"


def draft_config(dcfg, *, target_config, target_num_layers: int, layer_ids, mask_token: str | None,
                 dtype: str) -> dict:
    """The folder's config.json: a Qwen3 config of the draft layers plus the DFlash keys.

    dcfg is the trained DrafterConfig; target_config the target's HF config (for the token ids and
    max_position_embeddings a server checks). RoPE is plain (theta only, no scaling): that is what
    the drafter was trained with (trainer/model/drafter.py rope_cos_sin).
    """
    n = dcfg.num_layers
    get = lambda k, d=None: getattr(target_config, k, d)  # noqa: E731
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": dcfg.hidden_size,
        "intermediate_size": dcfg.intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": dcfg.num_heads,
        "num_key_value_heads": dcfg.num_kv_heads,
        "head_dim": dcfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": dcfg.rms_eps,
        "rope_theta": dcfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": get("max_position_embeddings", 32768),
        "vocab_size": dcfg.vocab_size,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": n,
        "layer_types": ["full_attention"] * n,
        "initializer_range": dcfg.init_std,
        "use_cache": True,
        "bos_token_id": get("bos_token_id"),
        "eos_token_id": get("eos_token_id"),
        "pad_token_id": get("pad_token_id"),
        "torch_dtype": dtype,
        "block_size": dcfg.block_size,
        "num_target_layers": target_num_layers,
        "dflash_config": {"target_layer_ids": list(layer_ids), "mask_token_id": _mask_written(dcfg.mask_token_id),
                          **({"mask_token": mask_token} if mask_token else {})},
    }


def _mask_written(mask_token_id: int) -> int:
    """The mask token id as written; a test's fault writes the next id (a broken export the gate must catch)."""
    return mask_token_id + 1 if faults.value("export_mask_shift") else mask_token_id


def _corrupt_for_a_test(path: Path) -> None:
    """A test's fault cuts the weights file in half (an export damaged on its way: the gate must say so)."""
    if faults.value("export_corrupt"):
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)


def draft_weights(dcfg, weights: dict, target_norm=None) -> dict:
    """The checkpoint's weights under the reference's names (ours are the same), checked against
    the drafter's shapes. target_norm (H,) stands in for `norm.weight` when the checkpoint has none
    (--freeze-draft-norm, or a checkpoint from before the draft had its own norm)."""
    import torch

    from trainer.model.drafter import Drafter

    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in Drafter(dcfg).state_dict().items()
                if not k.startswith(("embed_tokens.", "lm_head."))}
    weights = dict(weights)
    if "norm.weight" not in weights and target_norm is not None:
        weights["norm.weight"] = target_norm
    got = {k: tuple(v.shape) for k, v in weights.items()}
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise ValueError(f"weights do not fit the run's drafter: missing {missing[:3]}, unexpected {extra[:3]}, "
                         f"wrong shape {wrong[:3]}")
    return dict(sorted(weights.items()))


# --------------------------------------------------------------------------- python -m trainer.export

def main(argv: list[str] | None = None) -> int:
    from trainer.run.flags import OneLineParser

    p = OneLineParser(prog="python -m trainer.export",
                      description="Write a run's checkpoint as a DFlash draft-model folder (Hugging Face format).")
    p.add_argument("--run", required=True, metavar="OUT", help="the training run's output folder")
    p.add_argument("--step", type=int, metavar="N", help="the checkpoint of step N (default: the latest)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the folder to write")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weight dtype (default: bfloat16)")
    p.add_argument("--force", action="store_true",
                   help="replace DIR if it is an earlier export (never a folder holding anything else)")
    p.add_argument("--running-ok", action="store_true",
                   help="export a run that is still running (its newest complete checkpoint)")
    p.add_argument("--target-changed-ok", action="store_true",
                   help="export although the target at the run's --target path is not the one it trained against "
                        "(same hidden size and vocab): the trained layer ids and mask token are written")
    a = p.parse_args(argv)
    doc = export(a.run, a.output, step=a.step, dtype=a.dtype, force=a.force, running_ok=a.running_ok,
                 target_changed_ok=a.target_changed_ok)
    print(json.dumps(doc), flush=True)
    return 0


def export(run: str, output: str, *, step: int | None = None, dtype: str = "bfloat16", force: bool = False,
           running_ok: bool = False, target_changed_ok: bool = False) -> dict:
    """Export run OUT's checkpoint (step, or the latest) to the folder `output`; returns a summary."""
    import torch
    from safetensors.torch import save_file

    from trainer.run import checkpoint, provenance
    from trainer.run.config import RUN_CONFIG, TrainConfig, layer_ids

    out, dest = Path(run), Path(output)
    try:
        cfg = TrainConfig(**json.loads((out / RUN_CONFIG).read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"--run {run}: not a training run folder ({e})") from None
    running = provenance.is_running(out)
    if running and not running_ok:
        raise UsageError(f"--run {run}: {STILL_RUNNING}")
    path = _checkpoint_path(out, run, step)
    if os.path.lexists(dest) and not force:
        raise UsageError(f"-o {output}: already exists (pass --force to replace an earlier export)")
    if why := owned.not_an_export(dest):    # --force replaces an earlier export, nothing else
        raise UsageError(f"-o {output}: {why}; nothing was replaced (remove it yourself, or name another folder)")

    try:
        ck = checkpoint.load(path)
    except (OSError, ValueError, KeyError) as e:   # a running trainer may have pruned it meanwhile
        raise TrainerError(f"{path}: cannot read the checkpoint ({e})") from None
    record = ck.meta.get("target")
    target = _shape_only_target(cfg.target, None if record else layer_ids(cfg))
    changed = {}
    if record:
        changed = provenance.changes(record, provenance.identity(target))
        provenance.check(record, changed, cfg.target, target.num_layers, target_changed_ok,
                         refused=f"--run {run}: the target at {cfg.target} is not the one the run trained against",
                         anyway=f"to export the trained layer ids {record['layer_ids']} for it anyway")
        target.layer_ids, mask = tuple(record["layer_ids"]), record["mask_token_id"]
    else:
        print(f"export: {path} records no target identity (an older trainer wrote it): layer ids and mask "
              "token come from the run's settings and the target as it is now", file=sys.stderr, flush=True)
        mask = None if cfg.mask_token_id < 0 else cfg.mask_token_id
    last = target.num_layers - 1
    if last in target.layer_ids:
        raise UsageError(f"--run {run}: {LAST_LAYER.format(last=last, n=target.num_layers)}")
    dcfg = target.drafter_config(num_layers=cfg.draft_layers, block_size=cfg.block_size, mask_token_id=mask,
                                 own_norm=not cfg.freeze_draft_norm)
    norm = _target_norm(cfg.target, dcfg.hidden_size) if "norm.weight" not in ck.model else None
    try:
        weights = draft_weights(dcfg, ck.model, norm)
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None
    torch_dtype = getattr(torch, dtype)

    with output_lock(dest, "-o"), atomic_folder(dest, replaces=owned.not_an_export) as tmp:   # one writer per folder
        config = draft_config(dcfg, target_config=target.config, target_num_layers=target.num_layers,
                              layer_ids=target.layer_ids, mask_token=_token_text(target.tokenizer, dcfg.mask_token_id),
                              dtype=dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file({k: v.detach().to("cpu", torch_dtype).contiguous() for k, v in weights.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _corrupt_for_a_test(tmp / "model.safetensors")
        provenance_doc = {"run": str(out.resolve()), "step": ck.step, "checkpoint": str(path.resolve()),
                          "running": running, "target": cfg.target, "target_identity": record,
                          "target_changed": list(changed.values()), "dtype": dtype, "drafter": asdict(dcfg),
                          "chat_template_kwargs": json.loads(cfg.chat_template_kwargs or "{}")}
        (tmp / PROVENANCE).write_text(json.dumps(provenance_doc, indent=1) + "\n")
    files = {f.name: f.stat().st_size for f in sorted(dest.iterdir())}
    return {"output": str(dest), "step": ck.step, "running": running, "checkpoint": str(path), "dtype": dtype,
            "files": files, "mask_token_id": dcfg.mask_token_id, "target_layer_ids": list(target.layer_ids),
            "target_changed": list(changed.values())}


def _checkpoint_path(out: Path, run: str, step: int | None) -> Path:
    """The complete checkpoint of `step`, or the newest complete one."""
    from trainer.run import checkpoint

    if step is None:
        path = checkpoint.find_latest(out)
        if path is None:
            raise UsageError(f"--run {run}: no complete checkpoint yet")
        return path
    path = checkpoint.path_for(out, step)
    if not checkpoint.verify(path):
        have = checkpoint.complete_steps(out)
        raise UsageError(f"--step {step}: no complete checkpoint of that step in {run} "
                         f"(complete: {', '.join(map(str, have)) or 'none'})")
    return path


def _shape_only_target(spec: str, layers):
    """The target as export needs it: config, tokenizer and layer choice, with its weights on the
    meta device (no memory, no disk reads of a multi-GB checkpoint). `tiny` is built for real."""
    import torch

    from trainer.run import target as tg

    if spec.startswith("tiny"):
        return tg.load_target(spec, device=torch.device("cpu"), dtype=torch.float32, layers=layers)
    tg.check_target_spec(spec)
    spec = tg.target_folder(spec)
    tg._quiet_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(spec, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--target {spec}: not a model: {tg._first_line(e)}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        tokenizer = None
    L = config.num_hidden_layers
    ids = tuple(layers) if layers else tg.default_layer_ids(L)
    return tg.Target(model, tokenizer, ids, spec, "")


def _target_norm(spec: str, hidden: int):
    """The target's final norm weight (H,) in fp32, read alone from its safetensors files."""
    if spec.startswith("tiny"):
        from trainer.run.target import build_tiny

        return build_tiny(int(spec[5:]) if ":" in spec else 0).model.norm.weight.detach().float()
    from safetensors import safe_open

    from trainer.run.target import target_folder

    spec = target_folder(spec)
    for f in sorted(Path(spec).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in ("model.norm.weight", "model.language_model.norm.weight", "norm.weight"):
                if key in st.keys():
                    w = st.get_tensor(key).float()
                    if tuple(w.shape) == (hidden,):
                        return w
    raise UsageError(f"--target {spec}: no final norm weight (model.norm.weight) in its safetensors files")


def _token_text(tokenizer, token_id: int) -> str | None:
    """The mask token's text when the tokenizer has one for that id (a server can then add it)."""
    if tokenizer is None:
        return None
    if getattr(tokenizer, "mask_token_id", None) == token_id and getattr(tokenizer, "mask_token", None):
        return str(tokenizer.mask_token)
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is None or token_id >= len(tokenizer):
        return None
    text = convert(token_id)
    return text if isinstance(text, str) else None


if __name__ == "__main__":
    from trainer.exits import exit_process, run
    exit_process(run(main))
