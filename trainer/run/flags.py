"""A run's settings read: the trainer's flags (python -m trainer's parser, built from TrainConfig's
fields) over a YAML --config over the defaults, each a one-line UsageError when wrong (validate, in
config.py, has the rules). Another program's parser takes the trainer's own options from here
(add_trainer_options), and the controller checks a launch's flags and config text before it starts
anything (check_before_launch). No torch here.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
from collections.abc import Iterable
from dataclasses import Field, fields
from pathlib import Path
from typing import Any

from trainer.errors import UsageError
from trainer.run.config import TrainConfig, validate


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit; we want one line, exit 2
        if message.startswith("unrecognized arguments:"):
            flags = [o for o in self._option_string_actions if o.startswith("--")]
            for word in message.split()[2:]:
                near = difflib.get_close_matches(word, flags, n=1) if word.startswith("--") else []
                if near:
                    message += f" (did you mean {near[0]}?)"
                    break
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m trainer",
                      description="Train a DFlash block-diffusion drafter for a frozen target.",
                      argument_default=argparse.SUPPRESS)
    p.add_argument("--config", metavar="FILE", help="YAML file; keys spelled like these flags")
    for f in fields(TrainConfig):
        _add_option(p, f)
    return p


def add_trainer_options(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """The trainer's options `names` (TrainConfig fields) on another program's parser (a benchmark that
    runs the trainer's step): the trainer's flag, type, metavar, help and default, and its allowed values
    as choices, so the two cannot drift apart."""
    known = {f.name: f for f in fields(TrainConfig)}
    for name in names:
        if name not in known:
            raise ValueError(f"{name}: not a TrainConfig field")
        _add_option(parser, known[name], default=True)


def _add_option(p: argparse.ArgumentParser, f: Field, default: bool = False) -> None:
    """One field's flag. The trainer's own parser takes no defaults (argument_default=SUPPRESS: the
    flags override YAML, which overrides the dataclass) and no choices (validate says what is wrong, in
    its words); another program's gets both (default)."""
    flag, help = "--" + f.name.replace("_", "-"), f.metadata["help"]
    extra: dict[str, Any] = {"default": f.default} if default else {}
    if f.type in ("bool", bool):    # on by default: --no-NAME turns it off
        action = argparse.BooleanOptionalAction if f.default is True else "store_true"
        p.add_argument(flag, dest=f.name, action=action, help=help, **extra)
        return
    conv = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
    if default and f.metadata["choices"]:
        extra["choices"] = f.metadata["choices"]
    p.add_argument(flag, dest=f.name, type=conv, metavar=f.metadata["metavar"] or {int: "N", float: "X"}.get(conv, "S"),
                   help=f"{help} (default: {f.default!r})", **extra)


def parse(argv: list[str] | None = None) -> TrainConfig:
    """Flags and optional YAML -> a validated TrainConfig; any problem is a one-line UsageError."""
    ns = vars(build_parser().parse_args(argv))
    values = load_yaml(ns.pop("config")) if "config" in ns else {}
    return _settle(values, ns, here=True)


def check_before_launch(argv: list[str], config_text: str | None = None,
                        config_name: str = "config.yaml") -> TrainConfig:
    """What `dflash-ops launch` checks on the controller before anything starts: the flags the
    trainer will get (argv) and the YAML config's text, by the same rules as parse, less what only
    the target can check (its files and folders, --flex-tiles, which needs torch). A `--config` in
    argv names a file on the target: it replaces config_text and is left to the trainer."""
    ns = vars(build_parser().parse_args(argv))
    values = yaml_settings(config_text, config_name) if config_text is not None and "config" not in ns else {}
    ns.pop("config", None)
    return _settle(values, ns, here=False)


def _settle(values: dict, flags: dict, here: bool) -> TrainConfig:
    """YAML values under the flags -> a validated TrainConfig (here: also the files it names)."""
    values = {**values, **flags}
    if not values.get("workdir"):
        values["workdir"] = os.environ.get("DFLASH_OPS_WORKDIR", "")
    cfg = TrainConfig(**values)
    validate(cfg, here=here)
    return cfg


def load_yaml(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--config {path}: no such file")
    return yaml_settings(p.read_text(), path)


def yaml_settings(text: str, path: str) -> dict:
    """A YAML config's text (path: its name in messages) -> {field: value}, each key and type checked."""
    import yaml

    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise UsageError(f"{where}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: expected a mapping of settings, got {type(raw).__name__}")
    types = {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in fields(TrainConfig)}
    out = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in types:
            near = difflib.get_close_matches(name, types, n=1)
            hint = f"did you mean '{near[0]}'?" if near else "keys are the flags of python -m trainer without dashes"
            raise UsageError(f"{path}:{_line_of(yaml, text, key)}: unknown key '{key}' ({hint})")
        if name == "chat_template_kwargs" and isinstance(value, dict):
            value = json.dumps(value)  # a YAML mapping, kept as the flag's JSON text
        out[name] = _coerce(path, key, value, types[name])
    return out


def _line_of(yaml, text: str, key) -> int:
    """The line of a top-level key in the YAML text (1-based)."""
    root = yaml.compose(text)
    return next((k.start_mark.line + 1 for k, _ in root.value if k.value == str(key)), 1)


def _coerce(path: str, key, value, typ: str):
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, (str, int)) and not isinstance(value, bool),
    }[typ]
    if not ok:
        raise UsageError(f"{path}: key '{key}': expected {typ}, got {value!r}")
    return {"float": float, "str": str}.get(typ, lambda v: v)(value)
