"""The clip folded into the fused AdamW (trainer.step.apply_update: grad_scale / found_inf) against
clip_grad_norm_ + a plain fused step, on identical inputs on a GPU (the CPU test is
tests/test_update.py). 20 steps, alternating gradients far above and far below the clip.

    PYTHONUNBUFFERED=1 python3 benchmarks/adamw_fold_check.py
"""
import sys, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
from types import SimpleNamespace
from trainer.step import apply_update
torch.manual_seed(0)
shapes = [(4096, 4096), (12288, 4096), (4096,), (151, 4096)]
def make():
    g = torch.Generator(device="cuda").manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g) * 0.02) for s in shapes]
    return ps
a, b = make(), make()
oa = torch.optim.AdamW(a, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
ob = torch.optim.AdamW(b, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
ra = SimpleNamespace(params=a, optimizer=oa, index=0)
worst = 0.0
for step in range(20):
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    for pa, pb in zip(a, b):
        pa.grad = torch.randn(pa.shape, device="cuda", generator=g) * (10.0 if step % 2 else 0.01)
        pb.grad = pa.grad.clone()
    na = apply_update(ra, 6e-4, 1.0, step)
    nb = float(torch.nn.utils.clip_grad_norm_(b, 1.0)); ob.step()
    rel = max(float((pa - pb).norm() / pb.norm()) for pa, pb in zip(a, b))
    worst = max(worst, rel)
    print(f"step {step}: norm {na:.6g} vs {nb:.6g}, max rel weight diff {rel:.3g}")
print("worst", worst)
