"""The tool's cache folder where the trainer runs: $DFLASH_OPS_CACHE, else ~/.cache/dflash-ops/.

What is kept there is keyed by everything that makes it, written atomically (trainer/files.py) and made
again when missing, so any of it may be deleted: the small real target (small_target.py) and synthetic
data (data.py, under synthetic/).
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_OPS_CACHE") or Path.home() / ".cache" / "dflash-ops")
