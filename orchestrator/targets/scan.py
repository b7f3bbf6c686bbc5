"""`dflash-ops scan FILE...`: find failure signatures in saved logs, offline.

A library function: returns data, never prints. The catalog is the trainer's own
(`trainer/signatures.yaml` via `trainer.signatures`, pure Python, no torch), so a log scanned here
is named exactly as the probe and the trainer name it on the target.
"""
from __future__ import annotations

import os
from collections.abc import Iterable

from orchestrator.errors import NotFound, UsageError
from trainer.controller_view import Catalog, CatalogError, load_catalog

# A matched line is kept whole up to this many characters (some tracebacks hold megabyte lines).
_TEXT_MAX = 2000


def scan_files(paths: Iterable[str], catalog: Catalog | None = None) -> dict:
    """Scan each file line by line (streaming: logs can be large) and report every match.

    Returns the shape docs/runs.md documents for `scan --json`:
        {"files": {PATH: [{"line": int, "signature": str, "severity": "fatal"|"warning",
                           "meaning": str, "remedy": str, "text": str}]},
         "fatal": int, "warnings": int, "signatures": {ID: count}}
    Raises NotFound for a missing file, UsageError for one that cannot be read as text
    or a broken catalog. Every path is checked before any is scanned.
    """
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise UsageError("scan: no files given")
    for p in paths:
        if not os.path.exists(p):
            raise NotFound(f"{p}: no such file")
        if os.path.isdir(p):
            raise UsageError(f"{p}: is a directory, not a log file")
    try:
        catalog = catalog or load_catalog()
    except CatalogError as e:
        raise UsageError(str(e)) from None

    files: dict[str, list[dict]] = {}
    counts: dict[str, int] = {}
    fatal = warnings = 0
    for p in paths:
        found: list[dict] = []
        matcher = catalog.matcher()
        try:
            # errors="replace": a log with stray bytes (a killed process's half-written line,
            # terminal escapes) is still a log
            # newline="\n": line numbers count "\n" only, as grep -n and editors do
            with open(p, encoding="utf-8", errors="replace", newline="\n") as f:
                for raw in f:
                    for line_no, sig in matcher.feed(raw):
                        found.append(_entry(line_no, sig, raw))
        except OSError as e:
            raise UsageError(f"{p}: cannot read: {e.strerror or e}") from None
        for item in found:
            counts[item["signature"]] = counts.get(item["signature"], 0) + 1
            if item["severity"] == "fatal":
                fatal += 1
            else:
                warnings += 1
        files[p] = found
    return {"files": files, "fatal": fatal, "warnings": warnings, "signatures": counts}


def _entry(line_no: int, sig, raw: str) -> dict:
    text = raw.rstrip("\r\n")
    if len(text) > _TEXT_MAX:
        text = text[:_TEXT_MAX] + "..."
    return {"line": line_no, "signature": sig.id, "severity": sig.severity,
            "meaning": sig.meaning, "remedy": sig.remedy, "text": text}
