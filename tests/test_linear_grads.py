"""trainer/model/linear.py Linear: the drafter's matmuls with the weight gradient written in fp32 by cuBLAS.

Under CUDA bf16 autocast, Linear must compute autocast's forward and input gradient to the bit, and a
weight gradient that is the same fp32 accumulation without the bf16 rounding: checked against
float64 on identical inputs, with autocast's own weight gradient (nn.Linear) as the yardstick of
rounding. The fast path needs CUDA (aten.mm.dtype has no CPU kernel); the CPU part checks that
Linear is nn.Linear everywhere else.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from trainer.model import linear as model
from trainer.model.linear import Linear

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and model.FP32_WGRAD),
                          reason="the fp32 weight gradient needs CUDA and aten.mm.dtype")


def _pair(n_in: int, n_out: int, device: str, seed: int = 0):
    torch.manual_seed(seed)
    ref = nn.Linear(n_in, n_out, bias=False).to(device)
    new = Linear(n_in, n_out, bias=False).to(device)
    new.load_state_dict(ref.state_dict())
    return ref, new


def _grads(layer, x, dy, amp: bool, call=None):
    """y, dx, dw of `call` (default: the layer itself) on x, backward from dy; dw is the layer's."""
    x = x.clone().requires_grad_()
    layer.weight.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16) if amp else contextlib.nullcontext():
        y = (call or layer)(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad


def test_linear_is_nn_linear_off_the_fast_path():
    ref, new = _pair(16, 8, "cpu")
    assert set(new.state_dict()) == set(ref.state_dict())
    x, dy = torch.randn(3, 5, 16), torch.randn(3, 5, 8)
    for a, b in zip(_grads(ref, x, dy, False), _grads(new, x, dy, False)):
        assert torch.equal(a, b)


@cuda
@pytest.mark.parametrize("shape", [(2, 384, 512, 256), (1, 1000, 256, 768)])
def test_forward_and_input_gradient_are_autocasts_and_the_weight_gradient_loses_no_bits(shape):
    B, T, n_in, n_out = shape
    ref, new = _pair(n_in, n_out, "cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(B, T, n_in, device="cuda", generator=g)
    dy = torch.randn(B, T, n_out, device="cuda", generator=g).to(torch.bfloat16)
    y0, dx0, dw0 = _grads(ref, x, dy, True)
    y1, dx1, dw1 = _grads(new, x, dy, True)
    assert y1.dtype == torch.bfloat16 and dx1.dtype == torch.float32 and dw1.dtype == torch.float32
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)
    # float64 of the same bf16 operands: what both weight gradients approximate
    want = dy.double().reshape(-1, n_out).t() @ x.to(torch.bfloat16).double().reshape(-1, n_in)
    scale = want.abs().max()
    err_new = float((dw1.double() - want).abs().max() / scale)
    err_old = float((dw0.double() - want).abs().max() / scale)
    assert err_new < 1e-5, err_new           # fp32 accumulation noise
    assert err_old > 10 * err_new, (err_old, err_new)   # autocast's bf16 rounding is far larger
    # and autocast's gradient is this one rounded to bf16 (up to the accumulation order)
    close = (dw1.to(torch.bfloat16) == dw0.to(torch.bfloat16)).float().mean()
    assert close > 0.99, float(close)


@cuda
def test_compiled_linear_gives_eagers_weight_gradient():
    torch._dynamo.reset()
    _, new = _pair(512, 256, "cuda")
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(2, 256, 512, device="cuda", generator=g)
    dy = torch.randn(2, 256, 256, device="cuda", generator=g).to(torch.bfloat16)
    y0, dx0, dw0 = _grads(new, x, dy, True)
    compiled = torch.compile(new)
    y1, dx1, dw1 = _grads(compiled, x, dy, True)
    assert dw1.dtype == torch.float32
    for a, b, tol in ((y1, y0, 1e-2), (dx1, dx0, 1e-2), (dw1, dw0, 1e-5)):  # bf16 ulp / fp32 noise
        assert float((a.float() - b.float()).abs().max() / b.float().abs().max()) < tol


@cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_block_rows_linear_matches_linear_on_the_full_stream(compiled):
    """The drafter's first layer on its distinct rows (model.block_rows_linear) under bf16 autocast:
    the expanded output is Linear's on the full stream (bf16 products summed in fp32: equal up to the
    accumulation order), and its weight gradient is at least as close to float64 as Linear's. The
    repeated row's gradient sum stays in fp32: rounding it to bf16 would be ~1e-3 off."""
    from trainer.model.linear import block_rows_linear, expand_blocks

    torch._dynamo.reset()
    lead, n, bs, n_in, n_out = 96, 64, 16, 512, 384
    _, layer = _pair(n_in, n_out, "cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    xc = torch.randn(2, lead + n + 1, n_in, device="cuda", generator=g)
    dy = torch.randn(2, lead + n * bs, n_out, device="cuda", generator=g).to(torch.bfloat16)

    def fn(x):
        return block_rows_linear(layer, x, lead, n, bs)

    y1, dx1, dw1 = _grads(layer, xc, dy, True, call=torch.compile(fn) if compiled else fn)
    y0, dx0, dw0 = _grads(layer, expand_blocks(xc, lead, n, bs), dy, True)
    assert y1.dtype == torch.bfloat16 and dw1.dtype == torch.float32
    assert float((y1.float() - y0.float()).abs().max() / y0.float().abs().max()) < 1e-2  # bf16 ulp at most
    xb = expand_blocks(xc, lead, n, bs).to(torch.bfloat16).double().reshape(-1, n_in)
    want = dy.double().reshape(-1, n_out).t() @ xb
    scale = want.abs().max()
    err_rows = float((dw1.double() - want).abs().max() / scale)
    err_full = float((dw0.double() - want).abs().max() / scale)
    assert err_rows < max(2 * err_full, 1e-6), (err_rows, err_full)
    # the compact rows' input gradient: each repeated row's copies summed
    want_dx = (dy.double() @ layer.weight.to(torch.bfloat16).double())  # (B, lead + n*bs, n_in)
    blocks = want_dx[:, lead:].view(2, n, bs, n_in)
    want_c = torch.cat([want_dx[:, :lead], blocks[:, :, 0], blocks[:, :, 1:].sum((1, 2))[:, None]], 1)
    err_dx = float((dx1.double() - want_c).abs().max() / want_c.abs().max())
    assert err_dx < 1e-2, err_dx   # the distinct rows: a bf16 matmul output each, as Linear's
    # the repeated row's: its copies' gradients summed and applied in fp32 on the forward's bf16
    # weight, so no bf16 rounding (~2e-3) of either the sum or the weight
    err_shared = float((dx1[:, -1].double() - want_c[:, -1]).abs().max() / want_c[:, -1].abs().max())
    assert err_shared < 1e-4, err_shared
