"""Optimizer micro-benchmark on the drafter's parameter shapes (58 tensors, 1.05 B fp32 at the
Qwen3-8B shape): torch's fused AdamW with the clip folded in (the eager policy's update), the fused
AdamW alone and over ONE flat tensor, the global norm alone, torch's AdamW compiled by inductor, and
a copy of the same bytes as the yardstick (docs/benchmarks.md 8; docs/decisions.md: why trainer/engine/adamw.py exists).

    PYTHONUNBUFFERED=1 python3 benchmarks/optimizer_bench.py OUT.json     # needs a GPU
"""
import json
import sys
import time

import torch

if not torch.cuda.is_available():
    print("optimizer_bench: needs a GPU", file=sys.stderr)
    sys.exit(2)
torch.manual_seed(0)
dev = "cuda"
shapes = []
for _ in range(5):
    shapes += [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (12288, 4096), (12288, 4096), (4096, 12288),
               (4096,), (4096,), (128,), (128,)]
shapes += [(4096, 20480), (4096,), (4096,)]
n = sum(torch.Size(s).numel() for s in shapes)
print(f"{len(shapes)} tensors, {n/1e9:.3f} B params", flush=True)
res = {}



def timeit(name, fn, steps=10, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(steps):
        fn()
    e1.record()
    torch.cuda.synchronize()
    ms = e0.elapsed_time(e1) / steps
    res[name] = round(ms, 3)
    print(f"{name}: {ms:.2f} ms/step, {28*n/ms/1e9:.2f} TB/s at 28 B/param", flush=True)


def params_list():
    ps = [torch.nn.Parameter(torch.randn(s, device=dev) * 0.02) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    return ps

def fused_cases() -> None:
    """The trainer's eager-policy update (fused AdamW, clip folded in), the fused AdamW alone, the norm alone."""
    ps = params_list()
    opt = torch.optim.AdamW(ps, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, fused=True)

    def fused_folded():
        total = torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0)
        opt.grad_scale = torch.clamp((total + 1e-6) / 1.0, min=1.0).float()
        opt.found_inf = (~torch.isfinite(total)).float()
        opt.step()
        opt.grad_scale = opt.found_inf = None

    timeit("fused_folded (trainer)", fused_folded)
    timeit("fused AdamW alone", opt.step)
    timeit("total norm alone", lambda: torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0))


def flat_case() -> None:
    flat = torch.nn.Parameter(torch.randn(n, device=dev) * 0.02)
    flat.grad = torch.randn_like(flat) * 1e-3
    opt = torch.optim.AdamW([flat], lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    timeit("fused AdamW, one flat tensor", opt.step)


def compiled_case() -> None:
    """torch's AdamW (foreach, lr a tensor) compiled by inductor."""
    ps = params_list()
    opt = torch.optim.AdamW(ps, lr=torch.tensor(1e-5, device=dev), betas=(0.9, 0.95), weight_decay=0.0,
                            foreach=True, capturable=True)

    @torch.compile(fullgraph=False)
    def step():
        opt.step()

    t = time.perf_counter()
    step()
    torch.cuda.synchronize()
    print(f"compiled first step {time.perf_counter() - t:.1f}s", flush=True)
    timeit("compiled AdamW (inductor)", step)


def yardstick() -> None:
    a = torch.empty(n * 7 // 2, device=dev)  # 14 bytes/param read + 14 written
    b = torch.empty_like(a)
    timeit("yardstick: copy 28 B/param", lambda: b.copy_(a))


for case in (fused_cases, flat_case, compiled_case, yardstick):
    case()
    torch.cuda.empty_cache()
with open(sys.argv[1], "w") as f:
    json.dump(res, f, indent=1)
