"""apply_update: the clip folded into the fused AdamW (grad_scale / found_inf), and the clip +
AdamW compiled as one function (trainer/engine/adamw.py), each against clip_grad_norm_ + a plain step;
a non-finite gradient leaving everything untouched.

The fused AdamW is what the trainer uses on CUDA under the eager policy; torch's CPU build has the
same fused kernel interface (grad_scale, found_inf), so the folded path runs here on identical
inputs. The compiled update (CUDA under a compiled policy) runs here uncompiled (the same
function) and once compiled by inductor's CPU backend."""
import copy
from types import SimpleNamespace

import pytest
import torch

from trainer.engine.adamw import CompiledUpdate
from trainer.errors import TrainerError
from trainer.engine.step import apply_update

from tolerance import bound

# The gradient norm sums the squares of every element (3 tensors); the clip scales each gradient by
# it, so that is the update's relative rounding. Each step also rounds each weight a few times
# (decay, the step, fused vs foreach order): a few ulp per step.
N = 1000 + 37 + 4096
NORM = bound(torch.float32, N)


def _same_weights(a, b, steps: int) -> bool:
    return bool(torch.allclose(a, b, rtol=bound(torch.float32, 4 * steps), atol=steps * 1e-3 * NORM))  # lr 1e-3


def _replica(fused, seed: int = 0, scale: float = 1.0):
    """fused: True (torch's fused AdamW, the clip folded in), False (clip_grad_norm_ + foreach AdamW),
    "function" (trainer.engine.adamw's update, uncompiled) or "compiled" (the same, compiled by inductor)."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g, dtype=torch.float32)) for n in (1000, 37, 4096)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=fused is True)
    update = CompiledUpdate(opt, params, compiled=fused == "compiled") if isinstance(fused, str) else None
    return SimpleNamespace(params=params, optimizer=opt, index=0, update=update)


def _snapshot(r):
    return [p.detach().clone() for p in r.params], copy.deepcopy(r.optimizer.state_dict())


@pytest.mark.parametrize("kind", [True, "function"])
@pytest.mark.parametrize("scale", [0.001, 1.0, 50.0])  # norm below, near and far above the clip
def test_folded_clip_equals_clip_then_step(scale, kind):
    folded, plain = _replica(kind, scale=scale), _replica(False, scale=scale)
    assert plain.optimizer.defaults.get("fused") in (None, False)
    for step in range(3):
        n1 = apply_update(folded, 1e-3, 1.0, step)
        n2 = apply_update(plain, 1e-3, 1.0, step)
        assert n1 == pytest.approx(n2, rel=NORM)
        for a, b in zip(folded.params, plain.params):
            # Dividing by 1/c instead of multiplying by c, and fused vs foreach arithmetic: a few ulp.
            # A skipped or unclipped update would be off by ~lr (1e-3) relative, far beyond this.
            assert _same_weights(a, b, step + 1), (scale, step, (a - b).abs().max())
        for a, b in zip(folded.params, plain.params):  # the next step's gradients, the same for both
            a.grad = torch.randn_like(a) * scale
            b.grad = a.grad.clone()
    # The clip matters: Adam's first step ignores the gradient's scale, so take a clipped step,
    # then a small one; without the clip the first step's huge second moment damps the second.
    # The optimizer's state is torch's own (checkpoints and resume see no difference).
    sa, sb = folded.optimizer.state_dict(), plain.optimizer.state_dict()
    for k, v in sb["state"].items():
        assert float(sa["state"][k]["step"]) == float(v["step"]) == 3.0
        for name in ("exp_avg", "exp_avg_sq"):
            a = sa["state"][k][name]
            assert float((a - v[name]).norm() / v[name].norm()) <= 3 * NORM, (k, name)
    if scale > 1:
        fresh, unclipped = _replica(kind, scale=scale), _replica(False, scale=scale)
        apply_update(fresh, 1e-3, 1.0, 0)
        unclipped.optimizer.step()
        for a, b in zip(fresh.params, unclipped.params):
            a.grad = torch.randn_like(a) * 1e-3
            b.grad = a.grad.clone()
        apply_update(fresh, 1e-3, 1.0, 1)
        unclipped.optimizer.step()
        assert not _same_weights(fresh.params[0], unclipped.params[0], 2)


def test_the_compiled_update_equals_clip_then_step():
    """The function as the trainer runs it on a GPU: compiled by inductor (here its CPU backend)."""
    compiled, plain = _replica("compiled", scale=50.0), _replica(False, scale=50.0)
    for step in range(2):
        n1 = apply_update(compiled, 1e-3, 1.0, step)
        n2 = apply_update(plain, 1e-3, 1.0, step)
        assert n1 == pytest.approx(n2, rel=NORM)
        for a, b in zip(compiled.params, plain.params):
            assert _same_weights(a, b, step + 1), (step, (a - b).abs().max())
            a.grad = torch.randn_like(a) * 0.001
            b.grad = a.grad.clone()


@pytest.mark.parametrize("fused", [True, False, "function"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_raises_and_changes_nothing(fused, bad):
    r = _replica(fused)
    apply_update(r, 1e-3, 1.0, 0)  # a real step first: moments and step counts exist
    for p in r.params:
        p.grad = torch.randn_like(p)
    r.params[1].grad[3] = bad
    weights, state = _snapshot(r)
    with pytest.raises(TrainerError, match="gradient norm is (nan|inf) at step 1"):
        apply_update(r, 1e-3, 1.0, 1)
    for p, w in zip(r.params, weights):
        assert torch.equal(p.detach(), w)
    after = r.optimizer.state_dict()["state"]
    for k, v in state["state"].items():
        for name, t in v.items():
            assert torch.equal(after[k][name], t), (k, name)
    assert getattr(r.optimizer, "grad_scale", None) is None and getattr(r.optimizer, "found_inf", None) is None


def test_an_update_that_fails_to_compile_falls_back_to_torchs_adamw():
    """A torch whose dynamo/inductor cannot compile the update: torch's AdamW does the same step,
    with a warning, and the compiled update is not tried again."""
    def broken(gm, example_inputs):
        raise RuntimeError("this backend cannot compile anything")

    r, plain = _replica(False, scale=50.0), _replica(False, scale=50.0)
    r.update = CompiledUpdate(r.optimizer, r.params, backend=broken)
    with pytest.warns(RuntimeWarning, match="failed to compile .*BackendCompilerFailed"):
        n1 = apply_update(r, 1e-3, 1.0, 0)
    assert r.update is None
    n2 = apply_update(plain, 1e-3, 1.0, 0)
    assert n1 == pytest.approx(n2, rel=NORM)
    assert all(torch.equal(a, b) for a, b in zip(r.params, plain.params))


def test_a_runtime_error_in_the_update_is_not_taken_for_a_compile_failure():
    r = _replica("function")
    p = r.params[0]  # a broken state on the FIRST call (the one that may compile): the math itself fails
    r.optimizer.state[p] = {"step": torch.zeros(()), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros_like(p)}
    with pytest.raises(RuntimeError) as e:
        apply_update(r, 1e-3, 1.0, 0)
    assert type(e.value) is RuntimeError and r.update is not None
