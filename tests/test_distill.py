"""Distillation from the target (--objective kd | ce+kd, trainer/model/objective.py): the chunked loss
equals the dense reference, the reference is the KL it claims to be, the target's logits are read at
the right positions, and the trainer runs it end to end, refusing bad settings in one line.

Tolerances: the chunked loss is held to the accuracy of the dense reference itself. Both run in
float32; the same dense loss in float64 is the exact value (to float32's eyes), and how far the dense
float32 result lies from it is the float32 noise of this computation, measured on the spot. The
chunked result must lie within NOISE_FACTOR times that noise of the exact value (plus one rounding of
the largest element, so that a lucky noise of 0 cannot fail it). Measured here, the chunked loss lay
at most 1.9 times as far from the exact value as the dense one did (its sums run in another order),
over every case below, loss and every gradient; a gradient missing its factor T lies 1.3e6 times as
far (test_the_tolerance_catches_a_gradient_without_its_temperature).
"""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from trainer.errors import UsageError  # noqa: E402
from trainer.model import fused_ce, masks  # noqa: E402
from trainer.model.draft_loss import DraftLoss  # noqa: E402
from trainer.model.drafter import Drafter, RMSNorm  # noqa: E402
from trainer.model.linear import predicted_rows  # noqa: E402
from trainer.model.objective import Objective  # noqa: E402
from trainer.run.flags import check_before_launch, parse  # noqa: E402
from trainer.run.target import load_target  # noqa: E402
from trainer.train.setup import RESUME_FIXED  # noqa: E402
from tolerance import eps  # noqa: E402
from trainer_quick import QUICK, ROOT, metrics, step_losses, subprocess_env, train  # noqa: E402

NOISE_FACTOR = 8.0


def _within_noise(got: torch.Tensor, exact: torch.Tensor, ref32: torch.Tensor, what: str) -> float:
    """Assert got (fp32) is within NOISE_FACTOR x the dense fp32 reference's distance from the exact
    (fp64) value; returns the ratio of the two distances."""
    err = float((got.detach().double() - exact.detach()).abs().max())
    noise = float((ref32.detach().double() - exact.detach()).abs().max())
    floor = eps(torch.float32) * float(exact.detach().abs().max())
    assert err <= NOISE_FACTOR * noise + floor, (f"{what}: |chunked - exact| {err:.3g} > {NOISE_FACTOR} x "
                                                 f"float32 noise {noise:.3g} + {floor:.3g}")
    return err / max(noise, floor)


def _case(seed: int, B=2, Tq=24, H=32, V=100, block=6):
    """A head (norm with a trainable weight, frozen W), hidden and teacher rows, labels and weights
    with dead rows (block position 0, one invalid block)."""
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(H, 1e-6)
    norm.weight = torch.nn.Parameter(torch.rand(H, generator=g) + 0.5)
    W = torch.randn(V, H, generator=g) * 0.3
    h = torch.randn(B, Tq, H, generator=g)
    teacher = torch.randn(B, Tq, H, generator=g) * 1.5
    labels = torch.randint(0, V, (B, Tq), generator=g)
    w = torch.rand(B, Tq, generator=g)
    w[:, ::block] = 0
    w[1, block:2 * block] = 0
    return norm, W, h, teacher, labels, w, block


def _dense(norm, W, h, teacher, labels, w, block, objective, dtype):
    """masks' reference in `dtype`: (loss, d loss / d h, d loss / d norm weight, counts)."""
    norm = copy.deepcopy(norm).to(dtype)
    h = h.detach().to(dtype).clone().requires_grad_(True)
    logits = F.linear(norm(h), W.to(dtype))
    loss, correct, count = masks.block_loss(logits, labels, w.to(dtype), block)
    ce_w, kd_w = objective.weights
    kd = masks.block_kd(logits, F.linear(teacher.to(dtype), W.to(dtype)), w.to(dtype), objective.kd_temperature)
    loss = ce_w * loss + kd_w * kd
    (loss / 5).backward()
    return loss.detach(), h.grad, norm.weight.grad, correct, count


def _chunked(norm, W, h, teacher, labels, w, block, objective, rows):
    norm = copy.deepcopy(norm)
    h = h.clone().requires_grad_(True)
    loss, correct, count = fused_ce.block_loss(h, norm, W, labels, w, block, rows=rows, teacher=teacher,
                                               objective=objective)
    (loss / 5).backward()
    return loss.detach(), h.grad, norm.weight.grad, correct, count


OBJECTIVES = [Objective("kd", 2.0), Objective("ce+kd", 0.5, 0.3), Objective("kd", 1.0)]


@pytest.mark.parametrize("objective", OBJECTIVES, ids=lambda o: o.described())
@pytest.mark.parametrize("rows", [None, 16, 7])  # 48 rows: one chunk, three, and 7 that do not divide them
def test_chunked_kd_equals_the_dense_reference(objective, rows):
    worst = 0.0
    for seed in range(3):
        case = _case(seed)
        exact = _dense(*case, objective, torch.float64)
        ref = _dense(*case, objective, torch.float32)
        got = _chunked(*case, objective, rows)
        for i, what in enumerate(("loss", "d h", "d norm weight")):
            worst = max(worst, _within_noise(got[i], exact[i], ref[i], f"seed {seed} {what}"))
        assert torch.equal(got[3], ref[3]) and torch.equal(got[4], ref[4])  # the drafter's argmax, counted
    print(f"worst |chunked - exact| / float32 noise: {worst:.2f}")


def test_the_tolerance_catches_a_gradient_without_its_temperature(monkeypatch):
    """The check above fails a chunked loss whose gradient lacks T (T^2 KL's is T (q - p))."""
    real = fused_ce._distill_core

    def broken(logits, teacher, labels, weights, t, ce_weight, kd_weight):
        loss, pred, grad = real(logits, teacher, labels, weights, t, ce_weight, kd_weight)
        return loss, pred, grad / t

    monkeypatch.setattr(fused_ce, "_distill_core", broken)
    objective, case = Objective("kd", 2.0), _case(0)
    exact, ref = _dense(*case, objective, torch.float64), _dense(*case, objective, torch.float32)
    got = _chunked(*case, objective, 16)
    _within_noise(got[0], exact[0], ref[0], "loss")   # the value is right
    with pytest.raises(AssertionError, match="d h"):
        _within_noise(got[1], exact[1], ref[1], "d h")


@pytest.mark.parametrize("t", [0.5, 1.0, 3.0])
def test_kd_of_identical_distributions_is_zero_and_so_is_its_gradient(t):
    """The target's hidden state IS the drafter's normed one: same logits, no loss, no gradient."""
    norm, W, h, _, labels, w, block = _case(4)
    teacher = norm(h).detach()
    objective = Objective("kd", t)
    # chunked: the drafter's logits and the target's are the same bits, so every term is exactly 0
    loss, dh, dnorm, _, _ = _chunked(norm, W, h, teacher, labels, w, block, objective, 7)
    assert float(loss) == 0.0 and not dh.any() and not dnorm.any()
    # dense: autograd's log-softmax backward leaves q - p in rounding (~1e-8 here, against ~1e-2 for any
    # real difference of the two distributions)
    loss, dh, dnorm, _, _ = _dense(norm, W, h, teacher, labels, w, block, objective, torch.float32)
    assert abs(float(loss)) <= 24 * eps(torch.float32)
    assert float(dh.abs().max()) <= 10 * eps(torch.float32) and float(dnorm.abs().max()) <= 10 * eps(torch.float32)


def test_kd_at_temperature_1_against_a_one_hot_target_is_the_cross_entropy():
    """With the target sure of the data's token (a logit gap of 40: p = onehot to 1e-16), KL(p || q) is
    -log q(label) = CE, value and gradient; at T 2 it is not (a loss that ignored T would pass the first)."""
    g = torch.Generator().manual_seed(7)
    C, V = 40, 100
    logits = torch.randn(C, V, generator=g) * 3
    labels = torch.randint(0, V, (C,), generator=g)
    w = torch.rand(C, generator=g)
    sure = 40.0 * F.one_hot(labels, V).float()
    ce, _, g_ce = fused_ce._ce_core(logits, labels, w)
    kd, _, g_kd = fused_ce._distill_core(logits, sure, labels, w, 1.0, 0.0, 1.0)
    dense = masks.block_kd(logits[None], sure[None], w[None], 1.0)
    scale = float(ce)
    assert abs(float(kd) - float(ce)) <= C * V * eps(torch.float32) * scale
    assert abs(float(dense) - float(ce)) <= C * V * eps(torch.float32) * scale
    assert float((g_kd - g_ce).abs().max()) <= 10 * eps(torch.float32)
    kd2, _, _ = fused_ce._distill_core(logits, sure, labels, w, 2.0, 0.0, 1.0)
    assert abs(float(kd2) - float(ce)) > 0.05 * scale


def test_ce_plus_kd_is_ce_at_mix_0_and_kd_at_mix_1():
    norm, W, h, teacher, labels, w, block = _case(5)
    for rows in (16, 7):
        ce = fused_ce.block_loss(h.clone().requires_grad_(True), norm, W, labels, w, block, rows=rows)
        kd = _chunked(norm, W, h, teacher, labels, w, block, Objective("kd", 1.5), rows)
        mix0 = _chunked(norm, W, h, teacher, labels, w, block, Objective("ce+kd", 1.5, 0.0), rows)
        mix1 = _chunked(norm, W, h, teacher, labels, w, block, Objective("ce+kd", 1.5, 1.0), rows)
        assert torch.equal(mix0[0], ce[0].detach())   # the same sums: 0 x KD adds exactly nothing
        assert all(torch.equal(a, b) for a, b in zip(mix1, kd))
    # and the dense reference alike
    for mix, alone in ((0.0, Objective("ce")), (1.0, Objective("kd", 1.5))):
        d_mix = _dense(norm, W, h, teacher, labels, w, block, Objective("ce+kd", 1.5, mix), torch.float32)
        d_alone = _dense(norm, W, h, teacher, labels, w, block, alone, torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(d_mix, d_alone))


def test_chunked_loss_refuses_a_teacher_without_a_distilling_objective():
    norm, W, h, teacher, labels, w, block = _case(0)
    with pytest.raises(ValueError, match="both or neither"):
        fused_ce.block_loss(h, norm, W, labels, w, block, teacher=teacher)
    with pytest.raises(ValueError, match="both or neither"):
        fused_ce.block_loss(h, norm, W, labels, w, block, objective=Objective("kd"))


def test_objective_weights_and_refusals():
    assert Objective().weights == (1.0, 0.0) and not Objective().distills
    assert Objective("kd", kd_mix=0.2).weights == (0.0, 1.0)
    assert Objective("ce+kd", kd_mix=0.25).weights == (0.75, 0.25)
    assert Objective("ce+kd", 2.0, 0.25).described() == "ce+kd (T 2, KD's share 0.25)"
    for bad, needle in ((dict(name="kl"), "--objective"), (dict(kd_temperature=0.0), "--kd-temperature"),
                        (dict(kd_temperature=float("inf")), "--kd-temperature"), (dict(kd_mix=1.5), "--kd-mix"),
                        (dict(kd_mix=float("nan")), "--kd-mix")):
        with pytest.raises(ValueError, match=needle):
            Objective(**bad)


# ---- the whole loss on the tiny target ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    target = load_target("tiny", device=torch.device("cpu"), dtype=torch.float32, final_hidden=True)
    torch.manual_seed(3)
    drafter = Drafter(target.drafter_config(num_layers=2, block_size=8, mask_token_id=None))
    drafter.init_norm(target.head_weights()[1])
    drafter.borrow_target_head(*target.head_weights())
    with torch.no_grad():
        for _, p in drafter.trainable_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return target, drafter


def _greedy(target, prompt_len=12, new=90, seed=0):
    """A batch of two rows: random prompts continued greedily by the target (as regen answers), loss
    on the continuation."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, prompt_len), generator=g)
    with torch.no_grad():
        for _ in range(new):
            nxt = target.model(input_ids=ids).logits[:, -1].argmax(-1)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
    lm = torch.zeros_like(ids, dtype=torch.float32)
    lm[:, prompt_len:] = 1
    picked = [masks.sample_anchors(lm[b], ids.shape[1], 8, 10, g) for b in range(2)]
    anchors, valid = torch.stack([a for a, _ in picked]), torch.stack([v for _, v in picked])
    return ids, lm, anchors, valid


def test_the_target_predicts_each_block_token_from_its_teacher_position(tiny):
    """On greedy data the target's argmax at masks.teacher_positions IS the block's label: the KD
    target and the CE target agree where they should (an off-by-one would not)."""
    target, _ = tiny
    ids, lm, anchors, valid = _greedy(target)
    S, H = ids.shape[1], target.config.hidden_size
    final = target.features(ids)[..., -H:]
    labels, weights = masks.block_labels(ids, lm, anchors, valid, masks.position_weights(8, 4.0))
    live = predicted_rows(weights, 8) > 0
    assert int(live.sum()) > 50
    lm_w = target.head_weights()[2]
    for shift, agree in ((0, True), (1, False)):
        at = predicted_rows(masks.teacher_positions(anchors, 8, S) + shift, 8).clamp(max=S - 1)
        rows = torch.gather(final, 1, at[..., None].expand(-1, -1, H))
        hit = F.linear(rows, lm_w).argmax(-1) == predicted_rows(labels, 8)
        assert bool(hit[live].all()) == agree, shift
        if not agree:
            assert float(hit[live].float().mean()) < 0.5


def test_features_carry_the_target_s_own_logits_input(tiny):
    """Target.final_hidden appends the final norm's output: the n layers' features are unchanged and the
    lm_head of the appended part is the model's own logits."""
    target, _ = tiny
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(1))
    H, n = target.config.hidden_size, len(target.layer_ids)
    feats = target.features(ids)
    plain = load_target("tiny", device=torch.device("cpu"), dtype=torch.float32).features(ids)
    assert feats.shape == (2, 30, (n + 1) * H) and torch.equal(feats[..., :n * H], plain)
    want = target.model(input_ids=ids).logits
    assert torch.allclose(F.linear(feats[..., n * H:], target.head_weights()[2]), want, rtol=0, atol=1e-5)


def _grads(drafter):
    out = [p.grad.clone() for _, p in drafter.trainable_parameters()]
    drafter.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("objective", OBJECTIVES[:2], ids=lambda o: o.described())
def test_draft_loss_chunked_kd_equals_dense_in_every_trainable_gradient(tiny, objective):
    target, drafter = tiny
    ids, lm, anchors, valid = _greedy(target, seed=2)
    pw = masks.position_weights(8, 4.0)
    feats = target.features(ids)

    def run(module, f):
        loss, correct, count = module(f, ids, lm, anchors, valid)
        (loss / 9).backward()
        return loss.detach(), correct, count

    exact_drafter = copy.deepcopy(drafter).double()
    exact = run(DraftLoss(exact_drafter, pw.double(), attention="sdpa", loss="dense", objective=objective),
                feats.double())
    g_exact = _grads(exact_drafter)
    ref = run(DraftLoss(drafter, pw, attention="sdpa", loss="dense", objective=objective), feats)
    g_ref = _grads(drafter)
    chunked = DraftLoss(drafter, pw, attention="sdpa", loss="chunked", objective=objective)
    names = [k for k, _ in drafter.trainable_parameters()]
    # eager, and traced by dynamo + AOTAutograd (what a compile policy does, minus inductor)
    for how, module in (("eager", chunked), ("compiled", torch.compile(chunked, backend="aot_eager"))):
        got = run(module, feats)
        _within_noise(got[0], exact[0], ref[0], f"{how} loss")
        assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
        for name, a, b, c in zip(names, _grads(drafter), g_ref, g_exact):
            assert float(c.abs().max()) > 0, name   # every trainable weight gets a gradient
            _within_noise(a, c, b, f"{how} {name}")


def test_draft_loss_refuses_features_without_the_final_hidden_state(tiny):
    target, drafter = tiny
    ids, lm, anchors, valid = _greedy(target, new=20)
    plain = target.features(ids)[..., :-target.config.hidden_size]
    with pytest.raises(ValueError, match="Target.final_hidden"):
        DraftLoss(drafter, masks.position_weights(8, 4.0), objective=Objective("kd"))(plain, ids, lm, anchors, valid)


# ---- the trainer ------------------------------------------------------------------------------------

def test_a_kd_run_trains_end_to_end_and_its_loss_falls(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "trainer", *QUICK, "--steps", "60", "--log-every", "5",
                        "--objective", "kd", "--kd-temperature", "2", "--out", str(out)],
                       cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.strip() == "", p.stderr[-3000:]
    assert "objective kd (T 2)" in p.stdout
    losses = step_losses(out)
    assert sorted(losses) == list(range(5, 61, 5))
    first, last = (losses[5] + losses[10]) / 2, (losses[55] + losses[60]) / 2
    print(f"kd loss: steps 5-10 {first:.3f}, steps 55-60 {last:.3f}")
    assert last < 0.6 * first, losses
    assert [m["loss"] for m in metrics(out) if m.get("event") == "done"] == [losses[60]]


@pytest.mark.parametrize("flags, needle", [
    (["--objective", "kl"], "--objective 'kl': expected one of ce, kd, ce+kd"),
    (["--objective", "kd", "--kd-temperature", "0"], "--kd-temperature must be a positive number, got 0.0"),
    (["--kd-temperature", "-1"], "--kd-temperature must be a positive number"),
    (["--objective", "ce+kd", "--kd-mix", "1.5"], "--kd-mix is KD's share of --objective ce+kd, in [0, 1]; got 1.5"),
    (["--kd-mix", "-0.1"], "--kd-mix"),
])
def test_bad_objective_settings_are_one_line_usage_errors(flags, needle):
    for check in (lambda: parse(["--steps", "3", *flags]), lambda: check_before_launch(flags)):
        with pytest.raises(UsageError) as e:
            check()
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_bad_temperature_exits_2_in_one_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("objective: kd\nkd_temperature: 0\n")
    p = subprocess.run([sys.executable, "-m", "trainer", "--config", str(cfg), "--out", str(tmp_path / "o")],
                       cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == "trainer: error: --kd-temperature must be a positive number, got 0.0"


def test_resume_may_change_the_objective_as_it_may_gamma(tmp_path, capsys):
    """The objective changes the loss, not the model or its data: like --gamma or --lr it is not one of
    the settings a resume must keep, and the resumed run trains with the new one."""
    assert not {"objective", "kd_temperature", "kd_mix", "gamma"} & set(RESUME_FIXED)
    out = tmp_path / "run"
    assert train(out, "--steps", "2", "--checkpoint-every", "1") == 0
    capsys.readouterr()
    assert train(out, "--steps", "4", "--resume", "--objective", "ce+kd", "--kd-mix", "0.3") == 0
    assert "objective ce+kd (T 1, KD's share 0.3)" in capsys.readouterr().out
    assert sorted(step_losses(out)) == [1, 2, 3, 4]
