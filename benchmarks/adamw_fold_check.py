"""The clip folded into the fused AdamW (trainer.step.apply_update: grad_scale / found_inf) against
clip_grad_norm_ + a plain fused step, on identical inputs on a GPU (the CPU test is
tests/test_update.py). 20 steps, alternating gradients far above and far below the clip.

    PYTHONUNBUFFERED=1 python3 benchmarks/adamw_fold_check.py

Prints the largest relative difference of any weight tensor over the steps (2.4e-8 on an H200,
docs/benchmarks.md); a skipped, unclipped or doubly clipped update differs by ~1e-3 or more.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainer.step import apply_update  # noqa: E402

SHAPES = [(4096, 4096), (12288, 4096), (4096,), (151, 4096)]


def params() -> list[torch.nn.Parameter]:
    g = torch.Generator(device="cuda").manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g) * 0.02) for s in SHAPES]


def main() -> int:
    if not torch.cuda.is_available():
        print("adamw_fold_check: needs a GPU (the fused AdamW under test is the CUDA one)", file=sys.stderr)
        return 2
    a, b = params(), params()
    folded = SimpleNamespace(params=a, index=0, optimizer=torch.optim.AdamW(
        a, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True))
    plain = torch.optim.AdamW(b, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    worst = 0.0
    for step in range(20):
        g = torch.Generator(device="cuda").manual_seed(100 + step)
        for pa, pb in zip(a, b):
            pa.grad = torch.randn(pa.shape, device="cuda", generator=g) * (10.0 if step % 2 else 0.01)
            pb.grad = pa.grad.clone()
        na = apply_update(folded, 6e-4, 1.0, step)
        nb = float(torch.nn.utils.clip_grad_norm_(b, 1.0))
        plain.step()
        rel = max(float((pa - pb).norm() / pb.norm()) for pa, pb in zip(a, b))
        worst = max(worst, rel)
        print(f"step {step}: norm {na:.6g} vs {nb:.6g}, max rel weight diff {rel:.3g}")
    print("worst", worst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
