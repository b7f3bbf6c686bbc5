"""What the tool made, and so may replace: the one rule behind every `--force` and every `--out` folder.

A command that writes a folder the user named (`export -o DIR`, `python -m trainer.export -o DIR`,
`python -m trainer.small_lm --out DIR`) replaces an existing DIR only when DIR is the same kind of
thing it writes: an export holds exactly an export's files with its provenance record, a built
target holds its build report. Anything else (a home folder, a checkout, a symbolic link, a folder
with one file more) is refused with one line naming what was found, whatever the flags; an empty
folder holds nothing to lose and may be replaced. `--force` only says "yes, replace my previous
export", never "delete a folder of mine".

Stdlib only: the controller checks an `-o` before anything travels with the same functions the
trainer uses on the target (trainer/controller_view.py).
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

# An exported draft folder (trainer/export.py writes it): the weights, their config, and this
# provenance record, which names the run and step it came from and marks the folder as ours.
EXPORT_PROVENANCE = "dflash_ops.json"
EXPORT_FILES = frozenset({"config.json", "model.safetensors", EXPORT_PROVENANCE})
# A built small target (trainer/run/small_target.py): an HF folder with its build report.
SMALL_LM_REPORT = "small_lm.json"
SMALL_LM_FILES = frozenset({SMALL_LM_REPORT, "config.json", "model.safetensors", "generation_config.json",
                            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                            "added_tokens.json", "vocab.json", "merges.txt"})
# the record is a few hundred bytes; more is not ours
RECORD_MAX = 1 << 20

def _listing(path: Path) -> tuple[str | None, list[str]]:
    """(why `path` is not a plain folder of plain files, its names)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, []
    if stat.S_ISLNK(st.st_mode):
        return f"is a symbolic link (to {os.readlink(path)}), not a folder this tool wrote", []
    if not stat.S_ISDIR(st.st_mode):
        return "is a file, not a folder this tool wrote", []
    try:
        return None, sorted(os.listdir(path))
    except OSError as e:
        return f"cannot be read ({e.strerror})", []


def _foreign(path: Path, names: list[str], allowed: frozenset[str], what: str) -> str | None:
    """What in `path` the writer of `what` does not write: other names, or its names as other than files."""
    alien = [n for n in names if n not in allowed]
    if alien:
        return f"holds {_shown(alien)}, which {what} does not write: it is not {what} made earlier"
    for name in names:
        if not stat.S_ISREG(os.lstat(path / name).st_mode):
            return f"holds {name!r}, which is not a plain file: it is not {what} made earlier"
    return None


def _record(path: Path, name: str) -> dict | None:
    try:
        if os.path.getsize(path / name) > RECORD_MAX:
            return None
        doc = json.loads((path / name).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _shown(names: list[str], limit: int = 3) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


def not_an_export(path: Path) -> str | None:
    """None when `path` is absent, an empty folder, or a folder this tool exported (nothing but an
    export's files, with its provenance record naming a run and a step); else what was found."""
    why, names = _listing(path)
    if why or not names:
        return why
    if why := _foreign(path, names, EXPORT_FILES, "an export"):
        return why
    rec = _record(path, EXPORT_PROVENANCE)
    if rec is None or not {"run", "step"} <= rec.keys():
        return f"has no readable {EXPORT_PROVENANCE} (the record every export writes): it is not an export made earlier"
    return None


def not_a_small_lm(path: Path) -> str | None:
    """None when `path` is absent, an empty folder, or a small target this tool built (its files only,
    with its build report); else what was found."""
    why, names = _listing(path)
    if why or not names:
        return why
    if why := _foreign(path, names, SMALL_LM_FILES, "a build"):
        return why
    if _record(path, SMALL_LM_REPORT) is None:
        return f"has no readable {SMALL_LM_REPORT} (the report every build writes): it is not a build made earlier"
    return None


# What marks a folder as the tool's output, never as source to ship: the file each writer leaves in it
OUTPUT_MARKERS = {EXPORT_PROVENANCE: "an export", SMALL_LM_REPORT: "a built target",
                  "trainer-config.json": "a training run's output"}


def output_kind(folder: Path) -> str | None:
    """What tool output `folder` holds, by its marker file ("an export", ...), or None."""
    for marker, kind in OUTPUT_MARKERS.items():
        if (folder / marker).is_file():
            return kind
    return None


def ours(_path: Path) -> str | None:
    """For a folder inside one the tool made (a checkpoint in a run's folder): always replaceable."""
    return None


__all__ = ["EXPORT_PROVENANCE", "EXPORT_FILES", "SMALL_LM_REPORT", "SMALL_LM_FILES", "not_an_export",
           "not_a_small_lm", "ours", "OUTPUT_MARKERS", "output_kind"]
