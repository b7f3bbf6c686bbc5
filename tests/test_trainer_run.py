"""The trainer as users run it: resume exactly, stop on SIGTERM, survive kill -9 mid-checkpoint, refuse bad input.

Runs are tiny (the `tiny` target, a 1-layer drafter, block 4) and CPU-only with one torch thread, so
they are deterministic: a resumed run must reproduce the uninterrupted run bit for bit.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import statistics
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from trainer import faults  # noqa: E402
from trainer.engine.numerics import rel_l2  # noqa: E402
from tolerance import QUICK_CHAIN, bound, trained_weights_bound  # noqa: E402
from trainer.run import checkpoint  # noqa: E402
from trainer.run.config import CHOSEN_POLICY  # noqa: E402
from trainer_quick import (QUICK, ROOT, metrics, sigterm_once_training, step_losses,  # noqa: E402
                           subprocess_env, train)


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(checkpoint.find_latest(out)).model


# ---- resume ----------------------------------------------------------------------------------------

def test_resume_reproduces_the_uninterrupted_run(tmp_path, monkeypatch):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train(straight, "--steps", "10") == 0

    # The same run, stopped by SIGTERM after step 5: the loop draws each batch one step early (the
    # look-ahead), so batch index 5 is built during the 5th step, and the loop stops after it.
    import trainer.train.batches as tt

    real = tt.make_batch

    def make_batch_then_sigterm(*a, **kw):
        batch = real(*a, **kw)
        if kw["step"] == 5:
            signal.raise_signal(signal.SIGTERM)
        return batch

    monkeypatch.setattr(tt, "make_batch", make_batch_then_sigterm)
    assert train(split, "--steps", "10") == 143
    monkeypatch.setattr(tt, "make_batch", real)
    assert checkpoint.find_latest(split).name == "step-00000005"
    assert max(step_losses(split)) == 5
    assert train(split, "--steps", "10", "--resume") == 0

    a, b = step_losses(straight), step_losses(split)
    assert sorted(a) == sorted(b) == list(range(1, 11))
    assert [a[s] for s in a] == [b[s] for s in a]  # bit-identical on a deterministic CPU
    wa, wb = final_weights(straight), final_weights(split)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [m for m in metrics(split) if m.get("event") == "resume"] == [{"event": "resume", "step": 5}]
    done = [m for m in metrics(split) if m.get("event") == "done"]
    assert len(done) == 1 and done[0]["acceptance_length"] >= 1.0


def test_extending_a_finished_run_continues_from_its_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    assert train(out, "--steps", "3", "--checkpoint-every", "2") == 0
    assert train(out, "--steps", "5", "--resume") == 0
    assert sorted(step_losses(out)) == [1, 2, 3, 4, 5]
    names = sorted(p.name for p in checkpoint.root(out).glob("step-*"))
    assert names == ["step-00000003", "step-00000005"]  # keep 2: the previous one survives


def test_two_workers_compute_the_same_update_as_one(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert train(one, "--steps", "4") == 0
    assert train(two, "--steps", "4", "--workers", "2") == 0
    la, lb = step_losses(one), step_losses(two)
    printed = 1e-6  # metrics.jsonl rounds a loss to 6 decimals
    assert all(abs(la[s] - lb[s]) <= bound(torch.float32, QUICK_CHAIN) * abs(la[s]) + printed for s in la)
    wa, wb = final_weights(one), final_weights(two)
    # Sharded sums differ from the single pass only by float reassociation.
    assert max(rel_l2(wa[k], wb[k]) for k in wa) <= trained_weights_bound(4, QUICK_CHAIN)


# ---- SIGTERM and kill -9 (real processes) ----------------------------------------------------------

def test_sigterm_mid_run_checkpoints_and_exits_143_then_resumes(tmp_path):
    out = tmp_path / "run"
    code, rest, err = sigterm_once_training(
        [sys.executable, "-m", "trainer", *QUICK, "--out", str(out), "--steps", "100000"])
    assert code == 143, err
    stopped = [json.loads(x) for x in rest.splitlines() if x.startswith("{") and '"stopped"' in x]
    assert len(stopped) == 1
    k = stopped[0]["step"]
    latest = checkpoint.find_latest(out)
    assert latest is not None and latest.name == f"step-{k:08d}" and checkpoint.verify(latest)
    assert checkpoint.load(latest).step == k
    assert not list(checkpoint.root(out).glob(".tmp-*"))

    # resumable: continues at k+1 (in-process, same settings, a few more steps)
    assert train(out, "--steps", str(k + 2), "--resume") == 0
    assert max(step_losses(out)) == k + 2


def test_ctrl_c_of_a_trainer_run_by_hand_checkpoints_as_sigterm_does(tmp_path):
    """Ctrl-C once: the step boundary's checkpoint and exit 143, saying so (it used to exit 130 with none)."""
    out = tmp_path / "run"
    code, rest, err = sigterm_once_training(
        [sys.executable, "-m", "trainer", *QUICK, "--out", str(out), "--steps", "100000"],
        stop=lambda proc: proc.send_signal(signal.SIGINT))
    assert code == 143, err
    assert "[trainer] Ctrl-C: checkpointing at the next step boundary" in rest
    k = next(json.loads(x)["step"] for x in rest.splitlines() if x.startswith("{") and '"stopped"' in x)
    latest = checkpoint.find_latest(out)
    assert latest is not None and checkpoint.load(latest).step == k and checkpoint.verify(latest)


def test_kill_9_during_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path):
    out, flag = tmp_path / "run", tmp_path / "paused"
    cmd = [sys.executable, "-m", "trainer", *QUICK, "--out", str(out), "--steps", "50", "--checkpoint-every", "2"]
    env = subprocess_env(**faults.env(pause_in_checkpoint=f"4:{flag}"))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 90
        while not flag.exists():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.time() < deadline, "the trainer never reached checkpoint 4"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # mid-write: model.safetensors of step 4 is on disk, the rest is not
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert list(checkpoint.root(out).glob(".tmp-step-00000004-*"))  # the torn write is there ...
    latest = checkpoint.find_latest(out)
    assert latest.name == "step-00000002"  # ... and `latest` still names the complete previous one
    ck = checkpoint.load(latest)
    assert ck.step == 2 and ck.model and ck.optimizer["state"]

    assert train(out, "--steps", "5", "--resume", "--checkpoint-every", "2") == 0
    assert not list(checkpoint.root(out).glob(".tmp-*"))  # the leftover is cleaned up
    assert checkpoint.find_latest(out).name == "step-00000005"
    assert [m["step"] for m in metrics(out) if m.get("event") == "resume"] == [2]


# ---- bad input: exit 2, one line, no traceback ------------------------------------------------------

def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and err.startswith("trainer: error: "), err
    return err


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("case, needle", [
    ("unknown-flag", "unrecognized arguments: --bogus"),
    ("unknown-key", "unknown key 'stepz'"),
    ("wrong-type", "key 'steps': expected int"),
    ("missing-data", "no such file"),
    ("wrong-keys", ":2: each row needs exactly one of 'input_ids' or 'messages'"),
    ("short-sequence", ":1: sequence of 3 tokens is shorter than one block (4)"),
    ("bad-id", "outside the target's vocabulary"),
    ("not-a-model", "not a Hugging Face model folder"),
    ("bad-model-config", "not a model"),
    ("processes", "captures CUDA graphs and needs --gpus >= 1"),
    ("auto-without-probe", "no probe result"),
    ("split-batch", "does not split over 3 workers"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, case, needle):
    out = tmp_path / "out"
    good = {"input_ids": list(range(10, 30)), "loss_mask": [0] * 5 + [1] * 15}
    data = {"wrong-keys": [good, {"ids": [1, 2, 3]}], "short-sequence": [{"input_ids": [1, 2, 3]}, good],
            "bad-id": [{"input_ids": [1, 2, 3, 99999, 5]}]}
    args = {
        "unknown-flag": ["--bogus"],
        "missing-data": ["--data", str(tmp_path / "nope.jsonl")],
        "not-a-model": ["--target", str(tmp_path)],
        "processes": ["--topology", "processes", "--compile-policy", "reduce-overhead"],
        "auto-without-probe": ["--compile-policy", "auto", "--workdir", str(tmp_path)],
        "split-batch": ["--workers", "3"],
    }.get(case, [])
    if case in data:
        args = ["--data", str(write_jsonl(tmp_path / "d.jsonl", data[case]))]
    if case in ("unknown-key", "wrong-type"):
        cfg = tmp_path / "c.yaml"
        cfg.write_text("steps: 3\nstepz: 4\n" if case == "unknown-key" else "steps: three\n")
        args = ["--config", str(cfg)]
    if case == "bad-model-config":
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text('{"model_type": "no-such-architecture"}')
        args = ["--target", str(tmp_path / "m")]
    assert train(out, "--steps", "2", *args) == 2
    assert needle in _one_line_error(capsys)


def test_resume_refuses_changed_model_settings_and_fresh_runs_refuse_old_checkpoints(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "1") == 0
    capsys.readouterr()
    assert train(out, "--steps", "2") == 2
    assert "already holds checkpoints" in _one_line_error(capsys)
    assert train(out, "--steps", "2", "--resume", "--block-size", "6") == 2
    assert "block_size was 4" in _one_line_error(capsys)


def test_bad_input_in_a_real_process_prints_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "trainer", "--data", str(tmp_path / "missing.jsonl"), "--out",
                        str(tmp_path / "o")],
                       cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip() == f"trainer: error: --data {tmp_path / 'missing.jsonl'}: no such file"


# ---- data formats ----------------------------------------------------------------------------------

def test_chat_and_token_jsonl_train(tmp_path):
    def chat(i):
        return {"messages": [{"role": "user", "content": f"count up from {i}"},
                             {"role": "assistant", "content": "1 2 3 4 5 6 7 8"}]}

    rows = [r for i in range(3) for r in (chat(i), {"input_ids": list(range(40 + i, 70))})]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "run"
    assert train(out, "--data", str(data), "--steps", "2", "--eval-prompts", "1") == 0
    assert sorted(step_losses(out)) == [1, 2]
    assert json.loads((out / "eval_prompts.json").read_text())  # held out from the data


def test_chat_loss_mask_covers_assistant_turns_only():
    from trainer.run.data import encode_chat
    from trainer.run.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"},
            {"role": "assistant", "content": "ok!"}]
    ids, mask = encode_chat(tok, msgs)
    trained = [tok.decode([t]) if t < 256 else t for t, m in zip(ids, mask) if m]
    assert "".join(x for x in trained if isinstance(x, str)) == "yo\nok!\n"
    assert trained.count(tok.im_end_id) == 2  # the end-of-turn token is the model's to predict too
    assert len(ids) == len(mask)


def test_hugging_face_folder_target_with_a_chat_template(tmp_path):
    """A local HF folder (model + fast tokenizer with a chat template) loads offline and trains on chat rows."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from trainer.run.target import build_tiny

    model_dir = tmp_path / "model"
    build_tiny(3).save_pretrained(model_dir)
    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "\n", " "] + [f"w{i}" for i in range(100)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|im_start\|>|<\|im_end\|>|\n| "), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>",
                                  chat_template="{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                                                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                                                "<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(model_dir)
    answer = " ".join(f"w{i}" for i in range(10, 40))
    rows = [{"messages": [{"role": "user", "content": f"w1 w{2 + k}"}, {"role": "assistant", "content": answer}]}
            for k in range(4)]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    out = tmp_path / "run"
    assert train(out, "--target", str(model_dir), "--data", str(data), "--steps", "2", "--eval-prompts", "1") == 0
    assert sorted(step_losses(out)) == [1, 2]


# ---- eval that can be trusted ------------------------------------------------------------------------

def test_eval_prompts_that_are_also_training_prompts_are_refused_unless_eval_overlap_ok(tmp_path, capsys):
    """Six answers to one prompt: the held-out rows' prompt is a training row's prompt too."""
    rows = [{"input_ids": [10, 11, 12, 13] + list(range(20 + i, 40 + i)), "loss_mask": [0] * 4 + [1] * 20}
            for i in range(6)]
    data = str(write_jsonl(tmp_path / "same.jsonl", rows))
    assert train(tmp_path / "a", "--data", data, "--steps", "1", "--eval-prompts", "2") == 2
    err = _one_line_error(capsys)
    assert "2 of 2 eval prompts are also training rows' prompts" in err and "--eval-overlap-ok" in err
    assert not (tmp_path / "a" / "checkpoints").exists()
    # too few rows to hold any out: the prompts would be training rows' own
    few = str(write_jsonl(tmp_path / "few.jsonl", [{"input_ids": [9, i] + list(range(20, 40)),
                                                    "loss_mask": [0, 0] + [1] * 20} for i in range(3)]))
    assert train(tmp_path / "b", "--data", few, "--steps", "1", "--eval-prompts", "2") == 2
    assert "nothing could be held out" in _one_line_error(capsys)
    assert train(tmp_path / "c", "--data", data, "--steps", "1", "--eval-prompts", "2", "--eval-overlap-ok") == 0
    out = capsys.readouterr().out
    assert "2 of 2 eval prompts are training rows' prompts (--eval-overlap-ok)" in out
    assert " rounds, 2 prompts, 2 of them training rows' prompts)" in out
    # distinct prompts: the last rows are held out, and none of theirs is trained on
    other = str(write_jsonl(tmp_path / "other.jsonl", [{"input_ids": [9, i] + list(range(20, 40)),
                                                        "loss_mask": [0, 0] + [1] * 20} for i in range(6)]))
    assert train(tmp_path / "d", "--data", other, "--steps", "1", "--eval-prompts", "2") == 0
    assert json.loads((tmp_path / "d" / "eval_prompts.json").read_text()) == [[9, 4], [9, 5]]


def test_synthetic_eval_prompts_are_held_out_synthetic_rows(tmp_path, capsys):
    """Not fresh random tokens: the prompts of the last rows the target continued, which are not trained on."""
    out = tmp_path / "run"
    assert train(out, "--steps", "1") == 0
    printed = capsys.readouterr().out
    said, = [line for line in printed.splitlines() if "synthetic data (for tests" in line]
    path = Path(said.split("target): ")[1].split(" (")[0])     # the log names the cached file it reads
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    prompts = [r["input_ids"][: r["loss_mask"].index(1)] for r in rows]
    assert len(set(map(tuple, prompts))) == len(prompts) > 32  # 32 + 2 made, less any cut short by an EOS
    assert json.loads((out / "eval_prompts.json").read_text()) == prompts[-2:]
    assert f"{len(rows) - 2} rows for training; 2 eval prompts held out" in printed


def test_synthetic_data_is_made_once_per_inputs_and_reused_by_a_later_run(tmp_path, capsys, monkeypatch):
    """Kept in the tool's cache, keyed by the target's identity, the seed and the sizes: a second run in
    another --out reads the same file and makes nothing; another seed, or a changed target, is other data."""
    import trainer.run.data as data_mod

    monkeypatch.setenv("DFLASH_OPS_CACHE", str(tmp_path / "cache"))
    made = []
    real = data_mod.continue_prompts
    monkeypatch.setattr(data_mod, "continue_prompts", lambda *a, **k: made.append(1) or real(*a, **k))

    def said(out: Path, *extra: str) -> str:
        assert train(out, "--steps", "1", "--eval-prompts", "0", *extra) == 0
        line, = [x for x in capsys.readouterr().out.splitlines() if "synthetic data (for tests" in x]
        return line

    first = said(tmp_path / "a")
    assert "(generated in " in first and made
    path = Path(first.split("target): ")[1].split(" (")[0])
    assert path.parent == tmp_path / "cache" / "synthetic" and path.is_file()
    before, made[:] = path.read_bytes(), []
    again = said(tmp_path / "b")
    assert again.endswith(f"{path} (reused: the same target, seed and sizes made it before)") and not made
    assert path.read_bytes() == before
    other = said(tmp_path / "c", "--seed", "6")
    assert "(generated in " in other and made and str(path) not in other
    # the target's identity is in the key: the same name with other weights (its built-in seed) is other data
    import trainer.run.provenance as provenance

    real_identity = provenance.identity
    monkeypatch.setattr(provenance, "identity", lambda t: {**real_identity(t), "weights_sha256": "rebuilt"})
    assert "(generated in " in said(tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "cache" / "synthetic").iterdir() if p.name.startswith(".")) == []


def test_epochs_set_the_length_from_the_rows_and_say_so(tmp_path, capsys):
    """--epochs 1.5 over the rows left for training, 4 a step: ceil(1.5 x rows / 4) steps, whatever --steps says;
    the schedule and the step lines count to that length."""
    out = tmp_path / "run"
    assert train(out, "--epochs", "1.5", "--steps", "999", "--eval-prompts", "2", "--log-every", "1") == 0
    printed = capsys.readouterr().out
    rows = int(printed.split(" rows for training;")[0].rsplit(" ", 1)[1])
    steps = -(-3 * rows // 8)
    assert f"[trainer] --epochs 1.5: {steps} steps ({rows} training rows, batch 4), not --steps" in printed
    assert sorted(step_losses(out)) == list(range(1, steps + 1))
    assert f"step {steps}/{steps} |" in printed and "/999" not in printed
    done, = [m for m in metrics(out) if m.get("event") == "done"]
    assert done["step"] == steps
    lrs = [m["lr"] for m in metrics(out) if "lr" in m and "event" not in m]
    assert lrs[-1] < lrs[len(lrs) // 2] < max(lrs)      # the cosine ran its course over those steps


def test_run_summary_gives_tau_with_rounds_interval_and_acceptance_by_position(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "2", "--eval-every", "1") == 0
    printed = capsys.readouterr().out
    done = [m for m in metrics(out) if m.get("event") == "done"][0]
    ev = [m for m in metrics(out) if m.get("event") == "eval"][0]
    for m in (done, ev):
        lo, hi = m["tau_ci95"]
        assert m["rounds"] >= 2 and lo <= m["acceptance_length"] <= hi
        assert len(m["accept_rate_by_position"]) == 3  # block 4: positions 1..3
        assert all(r is None or 0 <= r <= 1 for r in m["accept_rate_by_position"])
    last = printed.strip().splitlines()[-1]
    lo, hi = done["tau_ci95"]
    assert done["steps_trained"] == 2 and done["trained_s"] > 0   # the run's own wall clock of its steps
    assert last.startswith(f"[trainer] done: 2 steps (2 trained in {done['trained_s']:.1f} s, warm-up included); "
                           f"tau {done['acceptance_length']:.3f} "
                           f"(95% {lo:.3f}-{hi:.3f}, {done['rounds']} rounds, 2 held-out prompts); ")
    assert "acceptance by block position 1..3: " in last


def test_each_eval_gives_the_loss_on_the_held_out_rows(tmp_path, capsys):
    """The loss on the held-out rows the eval prompts come from, at each eval from the untrained
    baseline on. At a learning rate of 1e-12 the drafter does not move: every eval gives the same held-out loss, and it
    lies among the losses of the run's training batches (the same untrained drafter on rows of the same
    kind; the range widened by their spread). Trained, it falls; a loss read from the wrong weights
    would stay where it started."""
    still = tmp_path / "still"
    assert train(still, "--steps", "12", "--eval-every", "6", "--eval-prompts", "4", "--lr", "1e-12") == 0
    held = [m["heldout_loss"] for m in metrics(still) if m.get("event") in ("eval", "done")]
    batches = list(step_losses(still).values())
    spread = statistics.pstdev(batches)
    assert len(held) == 3 and held[1:] == [pytest.approx(held[0], rel=1e-5)] * 2, held
    assert min(batches) - spread <= held[0] <= max(batches) + spread, (held[0], batches)

    out = tmp_path / "run"
    assert train(out, "--steps", "40", "--eval-every", "20", "--eval-prompts", "4") == 0
    printed = capsys.readouterr().out
    evals = [m for m in metrics(out) if m.get("event") in ("eval", "done")]
    assert [m["step"] for m in evals] == [0, 20, 40]       # the last one in `done`
    held = [m["heldout_loss"] for m in evals]
    assert held[-1] < 0.9 * held[0], held
    assert "eval at step 20: " in printed and f"; held-out loss {held[1]:.4f}" in printed


def test_step_pause_sleeps_before_each_step_after_its_first_ones(tmp_path, monkeypatch):
    """The test hook for runs that only have to keep running: from step AFTER on, a sleep before each step;
    a run trains the same steps either way."""
    slept, sleep = [], time.sleep
    monkeypatch.setattr(faults.time, "sleep", lambda s: slept.append(s) if s == 0.25 else sleep(s))
    monkeypatch.setenv(*faults.setting(step_pause="2:0.25"))
    assert train(tmp_path / "paused", "--steps", "5", "--eval-prompts", "0") == 0
    assert slept == [0.25, 0.25]                       # before steps 4 and 5 (the loop's step 3 and 4)
    monkeypatch.delenv(faults.ENV)
    assert train(tmp_path / "plain", "--steps", "5", "--eval-prompts", "0") == 0
    assert step_losses(tmp_path / "paused") == step_losses(tmp_path / "plain") and len(slept) == 2


def test_auto_trains_eager_when_the_run_is_shorter_than_the_compile_payback_and_says_why(tmp_path, capsys):
    work = tmp_path / "work"        # the probe's CPU figures: inductor saves 100 ms a step for a 211.7 s compile
    work.mkdir()
    cases = [{"policy": p, "topology": "threads", "threads": 1, "outcome": "ok", "step_ms": ms, "first_step_s": s}
             for p, ms, s in (("eager", 400.0, 0.5), ("inductor", 300.0, 211.7))]
    (work / "probe.json").write_text(json.dumps({"policy": "inductor", "torch": torch.__version__,
                                                 "result": {"cases": cases}}))
    assert train(tmp_path / "run", "--steps", "1", "--compile-policy", "auto", "--workdir", str(work)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("compile policy eager (auto: from probe.json)" in line for line in lines)
    assert any(line.startswith("[trainer] auto: eager, not the probe's inductor: this run's 1 steps are fewer than "
                               "the 2,112 its 211.2 s compile takes to pay back") for line in lines), lines
    assert any("ready in" in line and "first step" in line and "compile" not in line for line in lines)
    # what it resolved is recorded beside its settings, for `dflash-ops status` to read back
    chosen = json.loads((tmp_path / "run" / CHOSEN_POLICY).read_text())
    assert chosen["compile_policy"] == "eager" and chosen["asked"] == "auto" and "2,112" in chosen["why"]
