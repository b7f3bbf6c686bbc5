"""The anchors a step uses (trainer/run/sizing.py): the recipe's where they fit, fewer with one line
saying why where the rows or the GPU cannot take them, never silently."""
from __future__ import annotations


import pytest

from trainer.run.sizing import (CPU_ANCHORS, GIB, Device, Fit, Shape, auto_anchors, fit_anchors, record, resumed,
                                 sequence_bytes, slow_line)

# The Qwen3-8B recipe (configs/qwen3-8b.yaml): 5 draft layers of the 8B shape, rows of 3072 tokens,
# 4 sequences per GPU; the 8B target (16.4 GB) already on the device.
RECIPE = Shape(hidden=4096, intermediate=12288, layers=5, kv_dim=1024, feature_layers=5, trainable=1_050_000_000,
               block=16, pad_len=3072, seqs=4)


def gpu(total_gb: float, workers: int = 1) -> Device:
    return Device("cuda", "cuda:0", free=int((total_gb - 16.4) * GIB), workers=workers)


@pytest.mark.parametrize("total_gb", [141, 80])
def test_the_recipe_fits_an_h200_and_an_80gb_gpu_as_it_is(total_gb):
    assert fit_anchors(512, RECIPE, gpu(total_gb)) == Fit(512, None)


def test_a_smaller_gpu_gets_fewer_anchors_and_one_line_that_says_why():
    fit = fit_anchors(512, RECIPE, gpu(48))
    assert 8 <= fit.anchors < 512 and fit.anchors % 8 == 0
    assert fit.line.startswith(f"anchors {fit.anchors} instead of 512: ")
    assert "cuda:0" in fit.line and "GiB free" in fit.line and "\n" not in fit.line
    # the most that fit: one anchor more (rounded) would not
    spare = gpu(48).free - 3 * GIB - RECIPE.trainable * 16
    assert RECIPE.seqs * sequence_bytes(RECIPE, fit.anchors) <= spare
    assert RECIPE.seqs * sequence_bytes(RECIPE, fit.anchors + 8) > spare


def test_workers_sharing_a_gpu_share_its_memory():
    alone, shared = fit_anchors(512, RECIPE, gpu(80)), fit_anchors(512, RECIPE, gpu(80, workers=2))
    assert shared.anchors < alone.anchors == 512 and "x 8 sequences" in shared.line


def test_when_nothing_fits_the_config_is_kept_and_the_line_says_what_to_lower():
    fit = fit_anchors(512, RECIPE, gpu(24))
    assert fit.anchors == 512
    assert fit.line.startswith("warning: ") and "--batch-size or --seq-len" in fit.line


def test_anchors_past_what_the_rows_hold_are_cut_to_it():
    short = Shape(**{**RECIPE.__dict__, "pad_len": 256})
    fit = fit_anchors(512, short, gpu(141))
    assert fit.anchors == 256 - 16 + 1
    assert fit.line == ("anchors 241 instead of 512: the longest row (256 tokens) holds at most 241 blocks "
                        "of 16; more are padding")


def test_on_the_cpu_the_config_is_kept_and_a_heavy_step_says_it_will_be_slow():
    cpu = Device("cpu", "cpu")
    fit = fit_anchors(512, RECIPE, cpu, step_flops=lambda n: n * 1e10)
    assert fit.anchors == 512 and fit.line.startswith("on the CPU: ") and "~5.1 TFLOP per worker step" in fit.line
    assert fit_anchors(16, RECIPE, cpu, step_flops=lambda n: n * 1e10) == Fit(16, None)


def test_the_trainer_says_it_once_at_start(tmp_path, capsys):
    """A real run whose rows (32 tokens, the loss on part of each) cannot hold the 100 anchors asked:
    it trains with the 21 that its fullest row takes and says so in one line, before the first step."""
    pytest.importorskip("torch")
    from trainer_quick import train

    assert train(tmp_path / "run", "--anchors", "100", "--steps", "2", "--eval-prompts", "0") == 0
    out = capsys.readouterr().out.splitlines()
    said = [i for i, line in enumerate(out) if "instead of 100" in line]
    assert [out[i] for i in said] == ["[trainer] anchors 21 instead of 100: no row has more than 21 loss positions "
                                      "with a whole block of 4 after them (the anchors a row can take); every one "
                                      "is drawn, more are padding"]
    first_step = next(i for i, line in enumerate(out) if line.startswith('{"step": 1'))
    assert said[0] < first_step


def test_a_resume_keeps_what_its_start_chose_unless_anchors_changed():
    assert resumed(record(512, 256), 512, Fit(512, None)) == Fit(
        256, "anchors 256 instead of 512: as the run chose at its start (recorded in its checkpoint), so the "
             "resumed steps are the same steps")
    assert resumed(record(512, 256), 512, Fit(128, "x")).line.endswith(
        "; the device's free memory would take 128 now")
    assert resumed(record(64, 64), 64, Fit(64, None)).anchors == 64
    assert resumed(record(512, 256), 1024, Fit(1024, None)) is None      # --anchors changed: fitted anew
    assert resumed(None, 512, Fit(512, None)) is None                    # an older trainer's checkpoint


def test_a_resumed_run_reuses_the_recorded_anchors_and_says_so(tmp_path, capsys):
    pytest.importorskip("torch")
    import json

    from trainer.run import checkpoint
    from trainer_quick import train

    out = tmp_path / "run"
    assert train(out, "--anchors", "100", "--steps", "2", "--eval-prompts", "0") == 0
    meta = checkpoint.find_latest(out) / "meta.json"
    assert json.loads(meta.read_text())["anchors"] == {"asked": 100, "used": 21}
    # as if its start had had less room (a GPU with less free memory then): the resume keeps that
    meta.write_text(meta.read_text().replace('"used": 21', '"used": 16'))
    capsys.readouterr()
    assert train(out, "--anchors", "100", "--steps", "3", "--eval-prompts", "0", "--resume") == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "anchors" in line and "instead of" in line]
    assert said == ["[trainer] anchors 16 instead of 100: as the run chose at its start (recorded in its "
                    "checkpoint), so the resumed steps are the same steps"]
    assert json.loads((checkpoint.find_latest(out) / "meta.json").read_text())["anchors"]["used"] == 16


@pytest.mark.parametrize("seqs, peak_gb", [(2, 54.2), (4, 76.5)])
def test_the_estimate_covers_the_measured_peaks_at_the_recipes_shape(seqs, peak_gb):
    """docs/benchmarks.md#9-memory (M1): the trainer's eager step at the recipe's shape on one H200.
    Target (16.4 GB) + drafter state + the activations estimated lands at or a little above it."""
    s = Shape(**{**RECIPE.__dict__, "seqs": seqs})
    predicted = 16.4e9 + RECIPE.trainable * 16 + seqs * sequence_bytes(s, 512)
    assert peak_gb * 1e9 <= predicted <= 1.08 * peak_gb * 1e9


def test_anchors_past_what_any_row_can_take_are_cut_to_that():
    """An anchor is a loss position with a whole block after it: rows whose answers are 128 tokens
    take ~113 however long their prompts, so 512 anchors would be ~78% padding."""
    answers = Shape(**{**RECIPE.__dict__, "pad_len": 512, "room": 113})
    fit = fit_anchors(512, answers, gpu(141))
    assert fit.anchors == 113
    assert fit.line == ("anchors 113 instead of 512: no row has more than 113 loss positions with a whole block "
                        "of 16 after them (the anchors a row can take); every one is drawn, more are padding")
    assert fit_anchors(64, answers, gpu(141)) == Fit(64, None)


def test_most_anchors_counts_what_sample_anchors_can_draw():
    """Asked for far more, sample_anchors draws every anchor a row has: the fullest row's count is
    most_anchors, and with exactly that many no row loses one."""
    import torch

    from trainer.model import masks
    from trainer.run.data import Sample, most_anchors

    g = torch.Generator().manual_seed(0)
    rows = []
    for length in (40, 90, 17, 5):
        lm = tuple(int(v) for v in (torch.rand(length, generator=g) > 0.3))
        rows.append(Sample(tuple(range(length)), lm))

    def drawn(n: int) -> list[int]:
        return [int(masks.sample_anchors(torch.tensor(s.loss_mask, dtype=torch.float32), len(s.input_ids), 16, n,
                                         torch.Generator().manual_seed(1))[1].sum()) for s in rows]

    every = drawn(500)
    assert most_anchors(rows, 16) == max(every) > 0
    assert drawn(most_anchors(rows, 16)) == every
    assert most_anchors([Sample((1, 2, 3), (1, 1, 1))], 16) == 0


def test_cutting_padding_anchors_leaves_the_loss_and_gradients_as_they_were():
    """The cut is only safe because every anchor a row has is still drawn: the same rows with the
    anchors cut to most_anchors and with 40 more (padding) give the same loss and gradients, within
    the rounding of the longer reductions (tests/tolerance.py)."""
    import torch

    from tiny_engine import tiny_engine
    from tolerance import assert_close, loss_chain
    from trainer.run.data import Sample, make_batch, most_anchors

    tiny = tiny_engine(1)
    try:
        r = tiny.engine.primary
        g = torch.Generator().manual_seed(3)
        rows = []
        for length, answer in ((64, 20), (48, 30), (64, 9)):      # loss on the answer at the row's end
            ids = torch.randint(0, tiny.vocab - 1, (length,), generator=g).tolist()
            rows.append(Sample(tuple(ids), (0,) * (length - answer) + (1,) * answer))
        room = most_anchors(rows, 16)
        assert room == 30 - 16 + 1

        def loss_and_grads(anchors: int):
            b = make_batch(rows, pad_len=64, pad_id=0, step=0, seed=0, block_size=16, anchors=anchors,
                           pos_weights=tiny.pos_weights)
            for p in r.params:
                p.grad = None
            feats = r.target.features(b.input_ids, eager=True)
            loss_sum, _, count = r.loss_module(feats, b.input_ids, b.loss_mask, b.anchors, b.valid)
            (loss_sum / b.weight_total).backward()
            return loss_sum.detach(), count.detach(), [p.grad.clone() for p in r.params], int(b.valid.sum())

        cut, padded = loss_and_grads(room), loss_and_grads(room + 40)
        assert cut[3] == padded[3] == room + 5        # every anchor of every row, both times (the third has none)
        n = loss_chain(r.drafter.cfg, keys=64 + 16, rows=int(cut[1].sum()))
        assert_close(cut[0], padded[0], n=n, msg="loss")
        assert torch.equal(cut[1], padded[1])
        for a, b in zip(cut[2], padded[2]):
            assert_close(a, b, n=2 * n, msg="gradient")
        assert float(cut[0]) > 0 and any(float(x.abs().max()) > 0 for x in cut[2])
    finally:
        tiny.engine.close()


# --- auto (--anchors 0, the default): the recipe's on a GPU, the demo's on the CPU -----------------

TINY_CPU = Shape(hidden=256, intermediate=688, layers=5, kv_dim=128, feature_layers=5, trainable=4_000_000,
                 block=16, pad_len=256, seqs=8)


def flops(n: int) -> float:
    return 1e9 * n       # a step's work grows with the anchors


def test_auto_is_the_demos_anchors_on_the_cpu_said_in_one_line_with_what_the_recipe_would_cost():
    fit = fit_anchors(0, TINY_CPU, Device("cpu", "cpu"), flops)
    assert fit.anchors == CPU_ANCHORS == 16
    # the rows hold at most 241 blocks: the recipe's 512 would be 241, ~15x this step's work
    assert fit.line.startswith("anchors 16 (--anchors auto on the CPU: trainer/demo.yaml's; the recipe's 512 are "
                               "a GPU's, ~15x the work of a step here; --anchors N asks for others)")
    assert "\n" not in fit.line
    # rows too short even for 16: both said
    short = fit_anchors(0, Shape(**{**TINY_CPU.__dict__, "pad_len": 20}), Device("cpu", "cpu"), flops)
    assert short.anchors == 5 and "anchors 5 instead of 16: the longest row (20 tokens)" in short.line


def test_auto_is_the_recipe_on_a_gpu_and_anchors_asked_for_on_the_cpu_are_kept():
    assert fit_anchors(0, RECIPE, gpu(141)) == fit_anchors(512, RECIPE, gpu(141)) == Fit(512, None)
    assert fit_anchors(0, RECIPE, gpu(48)).anchors == fit_anchors(512, RECIPE, gpu(48)).anchors < 512
    assert fit_anchors(64, TINY_CPU, Device("cpu", "cpu"), flops) == Fit(64, None)
    assert (auto_anchors("cpu"), auto_anchors("cuda")) == (16, 512)


def test_a_resumed_auto_run_keeps_what_its_start_chose():
    fit = fit_anchors(0, TINY_CPU, Device("cpu", "cpu"), flops)
    kept = resumed(record(0, fit.anchors), 0, fit)
    assert kept is not None and kept.anchors == 16


def test_a_slow_cpu_step_names_the_flag_that_makes_it_cheaper():
    assert slow_line(6.2, 9700, 241, 8, 1) == (
        "slow steps: 6.2 s a step on the CPU, ~16.7 h for the 9700 steps left; --anchors 16 (now 241) makes each "
        "step cheaper (trainer/demo.yaml is a CPU-sized run)")
    assert "--batch-size 4 (now 8) halves" in slow_line(4.0, 100, 16, 8, 1)
    assert "~7 min for the 100 steps left" in slow_line(4.0, 100, 16, 8, 1)
    assert "~16 s for the 2 steps left" in slow_line(7.8, 2, 225, 8, 1)
    assert "--workers" in slow_line(4.0, 100, 16, 2, 2)
