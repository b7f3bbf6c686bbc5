"""A compile policy must train the same model as eager: the verdict's pieces, and the trainer's guard.

The wrong policies are the trainer's test-only ones (trainer/policies.py, the fault point test_policies):
`test-drop-first-grad` is a module whose first loss carries no gradient (the loss value is right),
the shape of what inductor's non-tree CUDA graphs did on the H200; `test-frozen` drops every gradient.
They wrap the uncompiled module: the guard checks them because they are not `eager`, and what is
checked is the wrong gradient, not how it was computed; inductor's own compiled step is the guard's
passing case below.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from trainer import faults, policies  # noqa: E402
from trainer.engine import numerics  # noqa: E402
from trainer.engine.numerics import StepCheck, judge  # noqa: E402
from trainer.probe.case import CPU_SHAPE  # noqa: E402
from trainer_quick import metrics  # noqa: E402
from test_trainer_topology import STEPS, python_m_trainer  # noqa: E402

TEST_POLICIES = faults.env(test_policies="1")
# The runs below train at the probe's CPU shape (2 workers or ranks, one row each): the inductor run
# compiles the same graphs as the probe's inductor case, which tests/test_probe_program.py compiles into
# the session's one inductor cache (tests/conftest.py), so it finds them there instead of compiling them
# cold a second time.
_S = CPU_SHAPE
PROBE_SHAPE = ["--draft-layers", str(_S.draft_layers), "--block-size", str(_S.block_size), "--anchors", str(_S.anchors),
               "--batch-size", str(2 * _S.rows_per_worker), "--synthetic-prompt-len", str(_S.seq_len // 4),
               "--synthetic-new-tokens", str(_S.seq_len - _S.seq_len // 4)]
NAMES = ["fc.weight", "layers.0.mlp.up_proj.weight"]


def step(loss_c=2.0, loss_e=2.0, loss_t=2.0000001, err=(3e-7, 2e-7), noise=(4e-7, 3e-7), tot_err=3e-7, tot_noise=4e-7):
    return StepCheck(loss_c, loss_e, loss_t, list(err), list(noise), tot_err, tot_noise)


def test_rel_l2_and_grad_errors():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])
    assert numerics.rel_l2(a, b) == 0.0 and numerics.rel_l2(torch.zeros(2), b) == 1.0
    assert numerics.rel_l2(torch.zeros(2), torch.zeros(2)) == 0.0
    assert math.isinf(numerics.rel_l2(torch.ones(2), torch.zeros(2)))
    per, total = numerics.grad_errors([a, torch.zeros(3)], [b, torch.ones(3)])
    assert per == [0.0, 1.0] and total == pytest.approx(math.sqrt(3) / math.sqrt(5 + 3))


def test_judge_accepts_noise_and_rejects_a_wrong_gradient_a_stale_input_and_a_frozen_model():
    replay = [(2.0, 2.0), (1.5, 1.5), (1.7, 1.7), (2.0, 2.0)]
    learn = ([2.0, 1.5, 1.0], [2.0, 1.45, 1.02])
    ok = judge([step(), step()], replay, learn, NAMES, torch.float32)
    assert ok["ok"] and ok["why"] is None
    # the tolerance is NOISE_FACTOR x the measured noise, not a constant
    assert ok["grad_tol"] == pytest.approx(numerics.NOISE_FACTOR * 4e-7)
    # right loss, entirely wrong gradient on the first step (the H200's cudagraphs-no-trees)
    bad = judge([step(err=(1.0, 1.0), tot_err=1.0), step()], replay, learn, NAMES, torch.float32)
    assert not bad["ok"] and "gradient differs from eager at step 1: relative L2 1" in bad["why"]
    # one parameter's gradient wrong, the total still small
    one = judge([step(err=(3e-7, 1e-4)), step()], replay, learn, NAMES, torch.float32)
    assert not one["ok"] and "gradient of layers.0.mlp.up_proj.weight" in one["why"]
    # a stale input repeats batch 0's loss on batch 1
    stale = judge([step()], [(2.0, 2.0), (2.0, 1.5), (2.0, 1.7), (2.0, 2.0)], learn, NAMES, torch.float32)
    assert not stale["ok"] and stale["why"].startswith("replay: loss on batch 1")
    # the loss never falls: its updates are lost
    frozen = judge([step()], replay, ([2.0, 2.0, 2.0], [2.0, 1.5, 1.0]), NAMES, torch.float32)
    assert not frozen["ok"] and frozen["why"].startswith("learnability")


def test_a_noise_floor_keeps_a_zero_noise_estimate_from_failing_reassociation():
    s = step(err=(5e-8, 5e-8), noise=(0.0, 0.0), tot_err=5e-8, tot_noise=0.0)
    assert judge([s], [], None, NAMES, torch.float32)["ok"]
    assert judge([step(err=(0.05, 0.05), noise=(0.0, 0.0), tot_err=0.05, tot_noise=0.0)], [], None, NAMES,
                 torch.bfloat16)["ok"]   # bf16's epsilon is 7.8e-3: 8 x that covers 0.05


def test_test_policies_exist_only_with_the_test_hook(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert "test-frozen" not in policies.known()
    with pytest.raises(policies.PolicyError):
        policies.describe("test-frozen")
    monkeypatch.setenv(*faults.setting(test_policies="1"))
    assert {"test-drop-first-grad", "test-frozen"} <= set(policies.known())
    assert policies.needs_cuda("test-drop-first-grad") is False


# ---- the trainer's guard ---------------------------------------------------------------------------

@pytest.mark.slow
def test_the_guard_stops_a_wrong_policy_in_worker_threads_and_passes_inductor(tmp_path):
    out = tmp_path / "wrong"
    p = python_m_trainer(out, *STEPS, *PROBE_SHAPE, "--workers", "2", "--compile-policy", "test-drop-first-grad",
                         env=TEST_POLICIES, timeout=600)
    assert p.returncode == 1, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("trainer: error: worker 0 (cpu) failed during warm-up: CompiledStepWrong")
    assert "[signature compiled-wrong]" in last and "relative L2 1 > 0.001" in last
    failed = [m for m in metrics(out) if m.get("event") == "worker_failed"]
    assert failed and failed[0]["signature"] == "compiled-wrong"
    assert not [m for m in metrics(out) if "loss" in m and "event" not in m]   # not one step trained

    good = tmp_path / "inductor"
    p = python_m_trainer(good, *STEPS, *PROBE_SHAPE, "--workers", "2", "--compile-policy", "inductor", timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    checks = [m for m in metrics(good) if m.get("event") == "compile_guard"]
    assert [c["worker"] for c in checks] == [0, 1] and all(c["grad_err"] <= c["tolerance"] for c in checks)
    assert "first compiled step matches eager" in p.stdout and "the check cost" in p.stdout


@pytest.mark.slow
def test_the_guard_stops_a_wrong_policy_in_ddp_ranks(tmp_path):
    out = tmp_path / "wrong"
    p = python_m_trainer(out, *STEPS, *PROBE_SHAPE, "--workers", "2", "--topology", "processes",
                         "--compile-policy", "test-drop-first-grad", env=TEST_POLICIES, timeout=600)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "computes a different gradient than eager" in p.stderr and "(signature compiled-wrong)" in p.stderr
    assert "Root Cause (first observed failure)" in p.stderr
    from trainer.signatures import classify

    assert classify(p.stdout + p.stderr, p.returncode) == "compiled-wrong"


@pytest.mark.slow
def test_skip_compile_guard_trains_whatever_the_policy_computes(tmp_path):
    out = tmp_path / "skipped"
    # 2 workers at the probe's shape, as the first test's wrong run
    p = python_m_trainer(out, "--steps", "2", *PROBE_SHAPE, "--workers", "2",
                         "--compile-policy", "test-drop-first-grad",
                         "--skip-compile-guard", env=TEST_POLICIES, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not [m for m in metrics(out) if m.get("event") == "compile_guard"]
