"""--optimizer muon (trainer/engine/muon.py): Muon over the drafter's matrices, AdamW over the rest, in
one optimizer. Its update is torch.optim.Muon's and torch.optim.AdamW's on identical inputs; its
Newton-Schulz iteration is the published one and nearly orthogonalises; its state survives a
checkpoint; the trainer runs it end to end (threads, two workers), resumes it, and refuses bad
settings and a resume with the other optimizer in one line.

Tolerances. Against torch.optim.Muon: the Newton-Schulz steps run in bf16, so the float32 noise of
the inputs shows in the output magnified. It is measured on the spot: torch's own update of the
same inputs with every gradient element moved by one float32 ulp (random sign), over a few draws; ours
must lie within NOISE_FACTOR times that of torch's (floor: one bf16 rounding of the largest weight
change, so that a noise of 0 cannot fail it). Measured here: ours bit-identical, the noise 5.3e-5
over 5 steps, the tolerance 2.7e-4; Nesterov off or 4 Newton-Schulz steps instead of 5 move the
weights by 2.2e-3 to 2.6e-3, ~40 times the noise (test_the_tolerance_catches_a_different_muon).
AdamW's part: the bound of tests/tolerance.py. Newton-Schulz in float64, against the published
iteration and against the scalar polynomial it applies to each singular value: 5 steps of 3
length-n reductions in eps64, times the largest slope of that polynomial over the singular values
seen (it magnifies an early rounding).
"""
from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trainer.engine import muon  # noqa: E402
from trainer.engine.muon import MuonAdamW, MuonSettings, newton_schulz5, takes_muon  # noqa: E402
from trainer.errors import UsageError  # noqa: E402
from trainer.run import checkpoint  # noqa: E402
from trainer.run.flags import check_before_launch, parse  # noqa: E402
from tolerance import assert_close, eps  # noqa: E402
from trainer_quick import QUICK, ROOT, metrics, step_losses, subprocess_env, train  # noqa: E402

NOISE_FACTOR = 4.0
torch_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch >= 2.9's")
# The drafter's shapes at tiny scale: fc (H, 5H), q/o, k/v, MLP up/down; norms
MATRICES = [("fc.weight", (64, 320)), ("q_proj.weight", (64, 64)), ("k_proj.weight", (32, 64)),
            ("up_proj.weight", (128, 64)), ("down_proj.weight", (64, 128))]
VECTORS = [("norm.weight", (64,)), ("q_norm.weight", (16,))]


def _named(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, shape in MATRICES[:2] + VECTORS[:1] + MATRICES[2:] + VECTORS[1:]:   # mixed, as a drafter's are
        out.append((name, torch.nn.Parameter(torch.randn(shape, generator=g) * (0.05 if len(shape) == 2 else 1))))
    return out


def _grads(named, steps, seed=1, scale=None):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for _, p in named] for _ in range(steps)]


def _step_all(opts, params, grads):
    for step in grads:
        for p, gr in zip(params, step):
            p.grad = gr.clone()
        for o in opts:
            o.step()


def _torch_pair(named, *, lr, muon_lr, betas, wd, muon_wd, **muon_kw):
    mats = [p for n, p in named if takes_muon(n, p)]
    rest = [p for n, p in named if not takes_muon(n, p)]
    return [torch.optim.Muon(mats, lr=muon_lr, momentum=0.95, weight_decay=muon_wd, adjust_lr_fn="match_rms_adamw",
                             **muon_kw),
            torch.optim.AdamW(rest, lr=lr, betas=betas, weight_decay=wd, foreach=False)]


SETTINGS = dict(lr=1e-3, muon_lr=3e-3, betas=(0.9, 0.95), wd=0.01, muon_wd=0.1)


def _ours(named):
    s = SETTINGS
    return MuonAdamW(named, lr=s["lr"], betas=s["betas"], weight_decay=s["wd"],
                     muon=MuonSettings(lr=s["muon_lr"], weight_decay=s["muon_wd"]))


def _torch_result(named, grads, **muon_kw):
    ref = copy.deepcopy(named)
    _step_all(_torch_pair(ref, **SETTINGS, **muon_kw), [p for _, p in ref], grads)
    return [p.detach() for _, p in ref]


def _noise(named, grads, draws=3):
    """How far torch's own result moves when every gradient element moves by one float32 ulp."""
    base = _torch_result(named, grads)
    worst = 0.0
    for d in range(draws):
        g = torch.Generator().manual_seed(100 + d)
        moved = [[x * (1 + (torch.randint(0, 2, x.shape, generator=g) * 2 - 1) * eps(torch.float32) / 2)
                  for x in step] for step in grads]
        worst = max(worst, max(float((a - b).abs().max()) for a, b in zip(base, _torch_result(named, moved))))
    return base, worst


def _tolerance(named, base, noise):
    change = max(float((b - p.detach()).abs().max()) for b, (_, p) in zip(base, named))
    return NOISE_FACTOR * noise + eps(torch.bfloat16) * change


# ---- what goes where ---------------------------------------------------------------------------------

def test_matrices_take_muon_and_the_rest_adamw():
    named = _named()
    opt = _ours(named)
    kinds = {g["kind"]: [id(p) for p in g["params"]] for g in opt.param_groups}
    assert kinds["muon"] == [id(p) for n, p in named if p.ndim == 2]
    assert kinds["adamw"] == [id(p) for n, p in named if p.ndim == 1]
    assert opt.counts() == {"adamw": 2, "muon": 5}
    # as upstream: vocabulary tables and heads, and degenerate matrices, stay on AdamW
    for name, shape in (("embed_tokens.weight", (100, 8)), ("lm_head.weight", (100, 8)), ("gate.weight", (1, 64))):
        assert not takes_muon(name, torch.zeros(shape))
    assert takes_muon("layers.0.mlp.up_proj.weight", torch.zeros(128, 64))


def test_the_drafters_trainable_matrices_are_muons():
    from trainer.model.drafter import Drafter
    from trainer.run.target import load_target

    target = load_target("tiny", device=torch.device("cpu"), dtype=torch.float32)
    drafter = Drafter(target.drafter_config(num_layers=2, block_size=8, mask_token_id=None))
    named = drafter.trainable_parameters()
    on_muon = {n for n, p in named if takes_muon(n, p)}
    assert on_muon == {n for n, p in named if p.ndim == 2} and "fc.weight" in on_muon
    assert {n for n, p in named if p.ndim == 1} == {n for n, p in named} - on_muon   # the norms
    assert not any("embed" in n or "lm_head" in n for n, _ in named)              # borrowed, frozen


# ---- the update --------------------------------------------------------------------------------------

@torch_muon
def test_the_update_is_torch_muon_plus_adamw():
    named, grads = _named(), _grads(_named(), 5)
    base, noise = _noise(named, grads)
    tol = _tolerance(named, base, noise)
    ours = copy.deepcopy(named)
    opt = _ours(ours)
    _step_all([opt], [p for _, p in ours], grads)
    worst = 0.0
    for (name, p), want in zip(ours, base):
        if takes_muon(name, p):
            diff = float((p.detach() - want).abs().max())
            worst = max(worst, diff)
            assert diff <= tol, f"{name}: |ours - torch.optim.Muon| {diff:.3g} > {tol:.3g} (noise {noise:.3g})"
        else:   # AdamW's arithmetic, step by step as torch's single-tensor AdamW
            assert_close(p.detach(), want, n=4 * 5, msg=name)
    print(f"|ours - torch| {worst:.3g}, float32 noise through torch's Muon {noise:.3g}, tolerance {tol:.3g}")


@torch_muon
@pytest.mark.parametrize("variant", [dict(nesterov=False), dict(ns_steps=4)], ids=["no-nesterov", "ns4"])
def test_the_tolerance_catches_a_different_muon(variant):
    named, grads = _named(), _grads(_named(), 5)
    base, noise = _noise(named, grads)
    tol = _tolerance(named, base, noise)
    other = _torch_result(named, grads, **variant)
    worst = max(float((a - b).abs().max()) for (n, p), a, b in zip(named, base, other) if takes_muon(n, p))
    assert worst > 3 * tol, (worst, tol)


def _published_ns5(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's zeropower_via_newtonschulz5 as published (kellerjordan.github.io/posts/muon),
    in g's dtype: X = G / ||G||; A = X X^T; B = b A + c A A; X = a X + B X; on G^T for a tall G. The
    published one divides by ||G|| + 1e-7, torch.optim.Muon by max(||G||, 1e-7), as this trainer does: a
    relative 1e-7 / ||G|| apart, which the polynomial magnifies; the reference takes torch's."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.size(0) > g.size(1) else g
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        A = x @ x.T
        B = b * A + c * A @ A
        x = a * x + B @ x
    return x.T if g.size(0) > g.size(1) else x


def _ns_polynomial(x: np.ndarray, steps: int = 5) -> np.ndarray:
    a, b, c = muon.NS_COEFFICIENTS
    for _ in range(steps):
        x = a * x + b * x ** 3 + c * x ** 5
    return x


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 320)])
def test_newton_schulz_is_the_published_iteration_and_nearly_orthogonalises(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0]), dtype=torch.float64)
    n = max(shape)
    sv = torch.linalg.svdvals(g).numpy()
    x = sv / float(g.norm())
    grid = np.linspace(x.min(), x.max(), 200001)
    slope = max(1.0, float(np.abs(np.diff(_ns_polynomial(grid)) / np.diff(grid)).max()))
    ours = newton_schulz5(g, dtype=torch.float64)
    # the published algorithm, in float64 both
    assert_close(ours, _published_ns5(g), n=int(5 * 3 * n * slope), scale=1.0, msg="vs published")
    # NS acts on each singular value alone: sigma / ||G||_F -> the polynomial applied 5 times
    got = np.sort(torch.linalg.svdvals(ours).numpy())
    want = np.sort(_ns_polynomial(x))
    assert np.abs(got - want).max() <= 5 * 3 * n * eps(torch.float64) * slope
    # these matrices' normalised singular values all lie above 0.002, where 5 steps map [0.002, 1] into
    # [0.6818, 1.2024] (the polynomial on a fine grid): the known band of NS5, ~0.7 to 1.2
    assert x.min() >= 0.002
    band = _ns_polynomial(np.linspace(0.002, 1.0, 2000001))
    lo, hi = band.min(), band.max()
    assert (round(lo, 4), round(hi, 4)) == (0.6818, 1.2024)
    # in bf16, as the optimizer runs it: the same band, give or take bf16's rounding over 5 steps
    bf = torch.linalg.svdvals(newton_schulz5(g.float()).float()).numpy()
    slack = 5 * 4 * eps(torch.bfloat16)
    assert lo - slack <= bf.min() and bf.max() <= hi + slack, (bf.min(), bf.max())


def test_muon_steps_at_its_own_lr_and_decay():
    """One step from zero momentum: W' = W (1 - muon_lr wd) - muon_lr 0.2 sqrt(max(A, B)) NS5(U),
    U = (1 - mu) G + mu (1 - mu) G (Nesterov over the buffer (1 - mu) G)."""
    named = [("w", torch.nn.Parameter(torch.randn(32, 64) * 0.1))]
    w0 = named[0][1].detach().clone()
    opt = MuonAdamW(named, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, muon=MuonSettings(lr=4e-3, weight_decay=0.2))
    g = torch.randn(32, 64)
    named[0][1].grad = g.clone()
    opt.step()
    mu = 0.95
    # U in fp32 the way the buffer and Nesterov's lerp make it, checked against the formula: the same bits
    # must then go into the bf16 Newton-Schulz (a last-bit difference in U can flip one of its bf16
    # roundings, a difference of bf16's size, not fp32's, in the step)
    u = g.lerp(torch.zeros_like(g).lerp_(g, 1 - mu), mu)
    assert_close(u, (1 - mu) * g + mu * ((1 - mu) * g), n=4, scale=float(g.abs().max()))
    want = w0 * (1 - 4e-3 * 0.2) - 4e-3 * 0.2 * 64 ** 0.5 * newton_schulz5(u).float()
    assert_close(named[0][1].detach(), want, n=4, scale=float(w0.abs().max()))


# ---- state ----------------------------------------------------------------------------------------------

def test_the_state_survives_a_checkpoint_and_the_steps_continue_exactly(tmp_path):
    grads = _grads(_named(), 5)
    whole = _named()
    opt = _ours(whole)
    _step_all([opt], [p for _, p in whole], grads)

    first = _named()
    opt = _ours(first)
    _step_all([opt], [p for _, p in first], grads[:3])
    path = checkpoint.save(tmp_path, 3, model={n: p.detach() for n, p in first}, optimizer=opt.state_dict(),
                           meta={})
    ck = checkpoint.load(path)
    again = [(n, torch.nn.Parameter(ck.model[n].clone())) for n, _ in first]
    opt = _ours(again)
    opt.load_state_dict(ck.optimizer)
    assert {k for st in opt.state.values() for k in st} == {"step", "exp_avg", "exp_avg_sq", "momentum_buffer"}
    _step_all([opt], [p for _, p in again], grads[3:])
    for (name, a), (_, b) in zip(again, whole):
        assert torch.equal(a.detach(), b.detach()), name


def test_an_adamw_state_does_not_load_into_muon():
    named = _named()
    adamw = torch.optim.AdamW([p for _, p in named])
    _step_all([adamw], [p for _, p in named], _grads(named, 1))
    with pytest.raises(ValueError, match="groups"):
        _ours(named).load_state_dict(adamw.state_dict())


def test_a_loaded_state_keeps_this_runs_settings():
    named = _named()
    first = _ours(named)
    _step_all([first], [p for _, p in named], _grads(named, 2))
    later = MuonAdamW(named, lr=1e-3, betas=(0.8, 0.9), weight_decay=0.0,
                      muon=MuonSettings(lr=5e-3, momentum=0.9, weight_decay=0.0))
    later.load_state_dict(first.state_dict())
    adamw, mu = later.param_groups
    assert (adamw["betas"], adamw["weight_decay"]) == ((0.8, 0.9), 0.0)
    assert (mu["lr_scale"], mu["momentum"], mu["weight_decay"]) == (5.0, 0.9, 0.0)
    assert all(torch.equal(later.state[p]["momentum_buffer"], first.state[p]["momentum_buffer"])
               for p in mu["params"])


# ---- the trainer ----------------------------------------------------------------------------------------

def test_a_muon_run_trains_end_to_end_on_two_workers_and_its_loss_falls(tmp_path):
    """Two worker threads: each steps its own MuonAdamW on the summed gradients; the replicas' weights
    are compared bit for bit every 20 steps and at the end (a difference fails the run)."""
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "trainer", *QUICK, "--steps", "60", "--log-every", "5",
                        "--workers", "2", "--checksum-every", "20", "--optimizer", "muon", "--out", str(out)],
                       cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.strip() == "", p.stderr[-3000:]
    assert "optimizer muon: 8 weight matrices (peak lr 0.003, momentum 0.95, weight decay 0.1" in p.stdout
    losses = step_losses(out)
    assert sorted(losses) == list(range(5, 61, 5))
    first, last = (losses[5] + losses[10]) / 2, (losses[55] + losses[60]) / 2
    print(f"muon loss: steps 5-10 {first:.3f}, steps 55-60 {last:.3f}")
    assert last < 0.6 * first, losses
    assert [m["loss"] for m in metrics(out) if m.get("event") == "done"] == [losses[60]]


def test_torchrun_processes_step_muon_as_the_threads_do(tmp_path):
    """The ranks engine (2 gloo processes, DDP) calls the same update as the threads engine: the same
    shards, the same two-term gradient sum, the same MuonAdamW: the same weights bit for bit on the CPU."""
    steps = ["--steps", "4", "--checkpoint-every", "0", "--optimizer", "muon", "--workers", "2"]
    threads, procs = tmp_path / "threads", tmp_path / "procs"
    assert train(threads, *steps) == 0
    p = subprocess.run([sys.executable, "-m", "trainer", *QUICK, *steps, "--topology", "processes",
                        "--out", str(procs)], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    wa = checkpoint.load(checkpoint.find_latest(threads)).model
    wb = checkpoint.load(checkpoint.find_latest(procs)).model
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert step_losses(threads) == step_losses(procs)


def test_a_muon_run_resumes_and_refuses_the_other_optimizer(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "2", "--checkpoint-every", "1", "--optimizer", "muon", "--muon-lr", "1e-2") == 0
    capsys.readouterr()
    assert train(out, "--steps", "4", "--resume", "--optimizer", "adamw") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainer: error: --resume: ") and "\n" not in err
    assert err.endswith("holds muon's optimizer state, and this run asks for --optimizer adamw; resume with "
                        "--optimizer muon, or start a new --out")
    # the resumed run's Muon settings apply from there on, as its --lr does
    assert train(out, "--steps", "4", "--resume", "--optimizer", "muon", "--muon-lr", "2e-2") == 0
    assert sorted(step_losses(out)) == [1, 2, 3, 4]
    ck = checkpoint.load(checkpoint.find_latest(out))
    assert [g["kind"] for g in ck.optimizer["param_groups"]] == ["adamw", "muon"]
    assert ck.optimizer["param_groups"][1]["lr_scale"] == pytest.approx(2e-2 / 3e-3)
    # and an AdamW run's checkpoint refuses muon alike
    plain = tmp_path / "plain"
    assert train(plain, "--steps", "1", "--checkpoint-every", "1") == 0
    capsys.readouterr()
    assert train(plain, "--steps", "2", "--resume", "--optimizer", "muon") == 2
    assert "holds adamw's optimizer state" in capsys.readouterr().err


@pytest.mark.parametrize("flags, needle", [
    (["--optimizer", "sgd"], "--optimizer 'sgd': expected one of adamw, muon"),
    (["--optimizer", "muon", "--muon-momentum", "1"], "--muon-momentum must be in [0, 1), got 1.0"),
    (["--muon-lr", "-1"], "--muon-lr must be >= 0 (0 = --lr), got -1.0"),
    (["--muon-lr", "nan"], "--muon-lr must be >= 0"),
    (["--muon-weight-decay", "-0.1"], "--muon-weight-decay must be >= 0, got -0.1"),
    (["--optimizer", "muon", "--compile-update", "on"], "--compile-update on compiles the AdamW update; "
                                                        "--optimizer muon steps its own, uncompiled"),
])
def test_bad_optimizer_settings_are_one_line_usage_errors(flags, needle):
    for check in (lambda: parse(["--steps", "3", *flags]), lambda: check_before_launch(flags)):
        with pytest.raises(UsageError) as e:
            check()
        assert needle in str(e.value) and "\n" not in str(e.value)
