"""What export must know about a run: the target it trained against, and whether it is still running.

Every checkpoint's meta.json records `target`, the target's identity as the run saw it (recorded()):

    target            the --target spec
    config_sha256     sha256 of the target's config.json, parsed with its keys sorted, less
                      `transformers_version` and `_name_or_path` (bookkeeping a re-save changes);
                      for `tiny`, of its built-in settings and seed
    num_layers, hidden_size, vocab_size
                      the target's shape (vocab: its embedding rows)
    weights_sha256    sha256 over the embedding and lm_head tensors AS STORED in the target's
                      safetensors files (`*embed_tokens.weight`, `*lm_head.weight`): each tensor's
                      name, dtype and shape and the bytes of SAMPLE_ROWS rows evenly spaced from its
                      first row to its last (a few MB read, whatever the model's size); for `tiny`,
                      the same over its fp32 tensors; null for a folder without safetensors files
                      or without such tensors in them
    layers_sha256     the same over every OTHER tensor of those files (the decoder layers, norms,
                      biases): name, dtype, shape and LAYER_SAMPLE_ROWS rows evenly spaced, so that a
                      target whose layers changed and whose embedding and lm_head did not (a merged
                      LoRA, a fine-tune with a frozen head) is a changed target; ~40 MB read for an
                      8B model. A change that touches none of the sampled rows of any tensor goes
                      unnoticed; a merged low-rank delta touches every row. Absent from records
                      written before it: those compare the embedding and lm_head only
    layer_ids         the target layers whose outputs fed the drafter
    mask_token_id     the id whose embedding marked the positions to draft

`changes(recorded, now)` names what differs between a record and the target as it is now (and the
layers read and mask token, where `now` is a `recorded` too).

A trainer holds a shared flock on OUT/trainer.lock while it runs (`running`); `is_running(out)` is
whether any process holds it now. The kernel drops the lock when the process ends, however it ends.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
from contextlib import contextmanager
from pathlib import Path

SAMPLE_ROWS = 256
LAYER_SAMPLE_ROWS = 16
LOCK = "trainer.lock"
BOOKKEEPING = ("transformers_version", "_name_or_path")
SHAPE = (("num_layers", "layers"), ("hidden_size", "hidden size"), ("vocab_size", "vocab"))
SERVES = ("hidden_size", "vocab_size")   # a drafter can serve another target only if these agree


def identity(target) -> dict:
    """The target's own facts (a trainer.run.target.Target, its weights loaded or on the meta device)."""
    weights_hash: str | None        # None: a folder without safetensors files
    layers_hash: str | None
    if target.name.startswith("tiny"):
        config_hash, weights_hash, layers_hash = _tiny_hashes(target.name)
    else:
        from trainer.run.target import target_folder

        folder = Path(target_folder(target.name))
        text = json.loads((folder / "config.json").read_text())
        config_hash = _sha256_json({k: v for k, v in text.items() if k not in BOOKKEEPING})
        weights_hash, layers_hash = _folder_weights_hashes(folder)
    return {"target": target.name, "config_sha256": config_hash, "num_layers": target.num_layers,
            "hidden_size": target.config.hidden_size,
            "vocab_size": int(target.model.get_input_embeddings().weight.shape[0]),
            "weights_sha256": weights_hash, "weights_sample_rows": SAMPLE_ROWS,
            "layers_sha256": layers_hash, "layers_sample_rows": LAYER_SAMPLE_ROWS}


def recorded(target, mask_token_id: int) -> dict:
    """What a checkpoint records: the target's identity, the layers read and the mask token used."""
    return {**identity(target), "layer_ids": list(target.layer_ids), "mask_token_id": int(mask_token_id)}


def changes(then: dict, now: dict) -> dict[str, str]:
    """What differs between a recorded identity and the target now: {key: words}, in a fixed order.
    The layers read and the mask token are compared where `now` has them (a resume's `recorded`; an
    export or eval takes the recorded ones, so compares the `identity` only)."""
    out = {k: f"{label} {then.get(k)} -> {now.get(k)}" for k, label in SHAPE if then.get(k) != now.get(k)}
    if then.get("config_sha256") != now.get("config_sha256"):
        out["config_sha256"] = "config.json"
    w0, w1 = then.get("weights_sha256"), now.get("weights_sha256")
    if w0 and w1 and (w0 != w1 or then.get("weights_sample_rows") != now.get("weights_sample_rows")):
        out["weights_sha256"] = "embedding/lm_head weights"
    l0, l1 = then.get("layers_sha256"), now.get("layers_sha256")    # None in a record older than it
    if l0 and l1 and (l0 != l1 or then.get("layers_sample_rows") != now.get("layers_sample_rows")):
        out["layers_sha256"] = "decoder-layer weights"
    out.update({k: f"{k} {then.get(k)} -> {now[k]}" for k in ("layer_ids", "mask_token_id")
                if k in now and then.get(k) != now[k]})
    return out


def check(record: dict, changed: dict, spec: str, num_layers: int, ok: bool, *, refused: str, anyway: str) -> None:
    """Refuse a target that is not the one a checkpoint records (`changed`, from `changes`):
    `refused (what changed); pass --target-changed-ok ANYWAY` unless `ok`; and even with `ok`, one
    of another shape (hidden size, vocab) or without the layers the drafter read. UsageError."""
    from trainer.errors import UsageError

    if not changed:
        return
    what, ids = ", ".join(changed.values()), record["layer_ids"]
    if not ok:
        raise UsageError(f"{refused} ({what}); pass --target-changed-ok {anyway}")
    if any(k in changed for k in SERVES):
        raise UsageError(f"--target-changed-ok: the target at {spec} has another shape ({what}); "
                         "the drafter cannot serve it")
    if max(ids) >= num_layers:
        raise UsageError(f"--target-changed-ok: the run read target layers {ids}; the target at {spec} "
                         f"has layers 0..{num_layers - 1}")


# ---- running: a shared flock while a trainer runs -------------------------------------------------

@contextmanager
def running(out: Path):
    """Held while a trainer runs in OUT. Shared, so that several holders of one folder (the first
    ranks of several nodes on a shared filesystem) never wait for each other."""
    with open(Path(out) / LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        yield


def is_running(out: Path) -> bool:
    """Whether a trainer holds OUT's lock now (a run from a trainer older than the lock: never)."""
    try:
        f = open(Path(out) / LOCK, "rb")
    except OSError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


# ---- hashes -------------------------------------------------------------------------------------

def _sha256_json(doc) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _rows(n: int, k: int) -> list[int]:
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _hash_tensors(tensors, k: int) -> str:
    """tensors: (name, dtype text, shape, slice) sorted by name; slice(i) is row i as a torch tensor
    (a 0-d tensor's one value for a scalar); k rows of each, evenly spaced."""
    import torch

    h = hashlib.sha256()
    for name, dtype, shape, row in tensors:
        h.update(json.dumps([name, dtype, list(shape)]).encode())
        for i in _rows(shape[0], k) if shape else [0]:
            h.update(row(i).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _is_head(key: str) -> bool:
    return key.endswith(("embed_tokens.weight", "lm_head.weight"))


def _hashes(tensors) -> tuple[str | None, str | None]:
    """(the embedding's and lm_head's hash, every other tensor's) of (name, dtype, shape, slice) rows."""
    tensors = sorted(tensors, key=lambda t: t[0])
    heads, rest = [t for t in tensors if _is_head(t[0])], [t for t in tensors if not _is_head(t[0])]
    return (_hash_tensors(heads, SAMPLE_ROWS) if heads else None,
            _hash_tensors(rest, LAYER_SAMPLE_ROWS) if rest else None)


def _folder_weights_hashes(folder: Path) -> tuple[str | None, str | None]:
    from contextlib import ExitStack

    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None, None
    with ExitStack() as stack:
        tensors = []
        for f in files:
            st = stack.enter_context(safe_open(str(f), framework="pt"))
            for key in st.keys():
                sl = st.get_slice(key)
                shape = sl.get_shape()
                tensors.append((key, sl.get_dtype(), shape, _row_of(st, key, sl, shape)))
        return _hashes(tensors)


def _row_of(st, key: str, sl, shape):
    """Row i of a safetensors tensor (a scalar: its one value)."""
    def row(i: int):
        return sl[i:i + 1] if shape else st.get_tensor(key)
    return row


def _tiny_hashes(spec: str) -> tuple[str, str | None, str | None]:
    from trainer.run.tiny import TINY, TINY_LM_HEAD_STD, build_tiny

    seed = int(spec[5:]) if ":" in spec else 0
    model = build_tiny(seed)
    rows = [(k, str(v.dtype), tuple(v.shape), lambda i, v=v: v[i:i + 1] if v.dim() else v)
            for k, v in model.state_dict().items()]
    return (_sha256_json({"tiny": TINY, "lm_head_std": TINY_LM_HEAD_STD, "seed": seed}), *_hashes(rows))
