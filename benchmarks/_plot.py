"""What the plot scripts share: writing a figure as a PNG."""
from __future__ import annotations

from pathlib import Path


def save_png(fig, path) -> Path:
    """Write `fig` to `path` (folders made as needed) at the resolution every plot here uses; close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
