"""Checkpoints that survive crashes: OUT/checkpoints/step-NNNNNNNN/ plus a `latest` pointer.

A checkpoint folder holds
  model.safetensors   the drafter's trainable weights (not the borrowed target parts)
  state.safetensors   optimizer tensors and RNG states
  meta.json           step, data position, optimizer scalars and param groups, file sizes (written last)
It is written under a temporary name, every file fsynced, then renamed into place (atomic on POSIX)
and the parent folder fsynced; only then is `latest` replaced (temp + fsync + rename). A crash at any
point leaves the previous checkpoint complete and `latest` pointing at a complete one; the newest
`keep` complete checkpoints are kept. Loading verifies a checkpoint and falls back to the newest
complete one if `latest` is damaged.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainer import faults
from trainer import owned
from trainer.files import atomic_file, atomic_folder

FORMAT = 1
FILES = ("model.safetensors", "state.safetensors", "meta.json")


@dataclass
class Checkpoint:
    path: Path
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict            # a torch optimizer state_dict
    rng: dict[str, torch.Tensor]
    meta: dict                 # everything else: data position, config, ...


def root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def _flatten_optimizer(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"optim.{idx}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{k}"] = v
    return tensors, {"scalars": scalars, "param_groups": sd["param_groups"]}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for name, t in tensors.items():
        if name.startswith("optim."):
            _, idx, k = name.split(".", 2)
            state.setdefault(int(idx), {})[k] = t
    for key, v in meta["scalars"].items():
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = v
    return {"state": state, "param_groups": meta["param_groups"]}


def rng_state() -> dict[str, torch.Tensor]:
    out = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = s
    return out


def restore_rng(rng: dict[str, torch.Tensor]) -> None:
    if "rng.torch" in rng:
        torch.set_rng_state(rng["rng.torch"])
    cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("rng.cuda."))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def save(out_dir: str | Path, step: int, *, model: dict[str, torch.Tensor], optimizer: dict, meta: dict,
         keep: int = 2) -> Path:
    """Write checkpoint `step` atomically and point `latest` at it; returns its folder."""
    ck = root(out_dir)
    ck.mkdir(parents=True, exist_ok=True)
    final = path_for(out_dir, step)
    if verify(final):
        _point_latest(ck, final.name)  # e.g. SIGTERM right after a periodic checkpoint of the same step
        return final
    with atomic_folder(final, replaces=owned.ours) as tmp:  # a killed writer leaves .tmp-step-*, which _prune removes
        model_cpu = {k: v.detach().cpu().contiguous() for k, v in model.items()}
        save_file(model_cpu, str(tmp / "model.safetensors"), metadata={"format": str(FORMAT)})
        faults.hit("pause_in_checkpoint", step=step)  # a test kills the writer here, mid-write
        tensors, opt_meta = _flatten_optimizer(optimizer)
        tensors.update(rng_state())
        save_file(tensors, str(tmp / "state.safetensors"))
        full_meta = dict(meta, format=FORMAT, step=step, optimizer=opt_meta, time=time.time(),
                         sizes={f: (tmp / f).stat().st_size for f in FILES[:2]})
        (tmp / "meta.json").write_text(json.dumps(full_meta, indent=1, default=_json_default))
    _point_latest(ck, final.name)
    _prune(ck, keep)
    return final


def _json_default(v):
    if torch.is_tensor(v):
        return v.item() if v.numel() == 1 else v.tolist()
    raise TypeError(f"cannot store {type(v).__name__} in meta.json")


def _point_latest(ck: Path, name: str) -> None:
    with atomic_file(ck / "latest") as f:
        f.write(name + "\n")


def path_for(out_dir: str | Path, step: int) -> Path:
    """The folder of checkpoint `step` (which may not exist)."""
    return root(out_dir) / f"step-{step:08d}"


def step_of(path: Path) -> int:
    return int(path.name[len("step-"):])


def _complete(ck: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    return sorted(p for p in ck.glob("step-*") if p.is_dir() and verify(p))


def complete_steps(out_dir: str | Path) -> list[int]:
    """The steps of the run's complete checkpoints, oldest first."""
    ck = root(out_dir)
    return [step_of(p) for p in _complete(ck)] if ck.is_dir() else []


def _prune(ck: Path, keep: int) -> None:
    for p in _complete(ck)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    for p in ck.glob(".tmp-*"):  # leftovers of writes that were killed
        shutil.rmtree(p, ignore_errors=True)


def verify(path: Path) -> bool:
    """A checkpoint is complete when meta.json parses and the files have the sizes it records."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        return meta.get("format") == FORMAT and all(
            (path / f).stat().st_size == size for f, size in meta["sizes"].items())
    except (OSError, ValueError, KeyError, AttributeError):
        return False


def find_latest(out_dir: str | Path) -> Path | None:
    """The checkpoint `latest` names if complete, else the newest complete one, else None."""
    ck = root(out_dir)
    try:
        named = ck / (ck / "latest").read_text().strip()
        if named.name.startswith("step-") and verify(named):
            return named
    except OSError:
        pass
    done = _complete(ck) if ck.is_dir() else []
    return done[-1] if done else None


def any_checkpoint(out_dir: str | Path) -> bool:
    ck = root(out_dir)
    return ck.is_dir() and any(ck.glob("step-*"))


def add_optimizer_params(optimizer: dict, total: int) -> None:
    """Widen a loaded optimizer state_dict (one param group) to `total` parameters, in place.

    For a checkpoint written before the drafter gained parameters at the END of its trainable list
    (its own final norm): the new ones get no saved state, so the optimizer starts theirs fresh.
    """
    groups = optimizer["param_groups"]
    have = sum(len(g["params"]) for g in groups)
    if len(groups) != 1 or have > total:
        raise ValueError(f"cannot widen an optimizer state of {have} params in {len(groups)} groups to {total}")
    groups[0]["params"] = list(groups[0]["params"]) + list(range(have, total))


def load(path: Path, map_location: str | torch.device = "cpu") -> Checkpoint:
    meta = json.loads((path / "meta.json").read_text())
    model = load_file(str(path / "model.safetensors"), device=str(map_location))
    state = load_file(str(path / "state.safetensors"))
    rng = {k: v for k, v in state.items() if k.startswith("rng.")}
    optimizer = _unflatten_optimizer(state, meta.pop("optimizer"))
    return Checkpoint(path, int(meta["step"]), model, optimizer, rng, meta)
