"""The trainer's two GPU updates against clip_grad_norm_ + a plain fused AdamW step, on identical
inputs on a GPU (the CPU test is tests/test_update.py): the clip folded into the fused AdamW
(trainer.engine.step.apply_update: grad_scale / found_inf, the eager policy's update) and clip + AdamW
compiled as one function (trainer.engine.adamw.CompiledUpdate, the compiled policies'). 20 steps,
alternating gradients far above and far below the clip.

    PYTHONUNBUFFERED=1 python3 benchmarks/adamw_fold_check.py

Prints, per update, the largest relative difference of any weight tensor over the steps (folded:
2.4e-8 on an H200, docs/benchmarks.md); a skipped, unclipped or doubly clipped update differs by
~1e-3 or more.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from trainer.engine.adamw import CompiledUpdate  # noqa: E402
from trainer.engine.step import apply_update  # noqa: E402

SHAPES = [(4096, 4096), (12288, 4096), (4096,), (151, 4096)]


def params() -> list[torch.nn.Parameter]:
    g = torch.Generator(device="cuda").manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g) * 0.02) for s in SHAPES]


def main() -> int:
    if not torch.cuda.is_available():
        print("adamw_fold_check: needs a GPU (the fused AdamW under test is the CUDA one)", file=sys.stderr)
        return 2
    def adamw(ps):
        return torch.optim.AdamW(ps, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)

    a, c, b = params(), params(), params()
    folded = SimpleNamespace(params=a, index=0, optimizer=adamw(a), update=None)
    opt_c = adamw(c)
    compiled = SimpleNamespace(params=c, index=0, optimizer=opt_c, update=CompiledUpdate(opt_c, c))
    plain = adamw(b)
    worst = {"folded": 0.0, "compiled": 0.0}
    for step in range(20):
        g = torch.Generator(device="cuda").manual_seed(100 + step)
        for pa, pc, pb in zip(a, c, b):
            pa.grad = torch.randn(pa.shape, device="cuda", generator=g) * (10.0 if step % 2 else 0.01)
            pb.grad, pc.grad = pa.grad.clone(), pa.grad.clone()
        na = apply_update(folded, 6e-4, 1.0, step)
        nc = apply_update(compiled, 6e-4, 1.0, step)
        nb = float(torch.nn.utils.clip_grad_norm_(b, 1.0))
        plain.step()
        line = []
        for name, ps, n in (("folded", a, na), ("compiled", c, nc)):
            rel = max(float((p - pb).norm() / pb.norm()) for p, pb in zip(ps, b))
            worst[name] = max(worst[name], rel)
            line.append(f"{name}: norm {n:.6g} vs {nb:.6g}, max rel weight diff {rel:.3g}")
        print(f"step {step}: " + "; ".join(line))
    print("worst", worst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
