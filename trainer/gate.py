"""`python -m trainer.gate`: prove the pipeline on one row before the long run.

    python -m trainer.gate [--target T] [--data FILE|synthetic] [--config C] [--row N] [--steps 300]
        [--new-tokens 48] [--gpus 0|1] [--out DIR] [--json FILE] [-- TRAINER_ARGS...]

--target and --data default to the run's own (its --config and TRAINER_ARGS, read as the trainer reads
them), so `dflash-ops launch --gate` runs it with exactly the real run's settings.

The field's most common failure is a drafter whose training loss looks fine and whose acceptance when
served is near zero: something between training, export and decoding is broken (a layer id off by one,
a mask token, a norm, a cache). The long run finds it after hours. This gate finds it in minutes, as
SpecForge's does: overfit one sample, export it, decode it; a working pipeline then accepts every
draft. The stages, each said as it starts, the first that fails named (exit 1):

1. `row`: row N of --data gives its prompt (the tokens before its first loss token, or a chat row's
   turns before the assistant's; with `synthetic`, the random prompt the run's --seed draws); the target
   writes its own greedy continuation of it (--new-tokens), and that is the one row trained on (a drafter
   learns what the target will say).
2. `train`: `python -m trainer` with the run's --config and TRAINER_ARGS (after `--`) on that row alone,
   one sequence a step with every position of the row an anchor, no eval: the gate's own data, length,
   batch, anchors, eval and checkpoint flags come last, so they win over the run's. The loss must fall
   below a tenth of its first value.
3. `export`: `trainer.export` of the run (float32) loads back as a drafter for this target.
4. `decode`: the row's prompt decoded with the drafter by both engines of trainer.specdec (eager, and
   graphs), and by the reference's `dflash_generate` where PyPI's `dflash` is importable. Each must give
   the target's own continuation, the engines the same rounds as each other (and as the reference), and
   every round but the budget-cut last one must accept the whole block: tau equal to the block size.

The last stdout line is a JSON document (each stage's result, `passed`); --json writes it to a file too.
Exit 0 passed, 1 a stage failed, 2 bad input.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STAGES = ("row", "train", "export", "decode")
SYNTHETIC = "synthetic"     # --data synthetic: the trainer's own random prompts (trainer/run/data.py)
LOSS_FALL = 10.0        # the overfit's last logged loss must be below first / this


class GateFailed(Exception):
    """A stage did not pass: str() says which and what it saw."""

    def __init__(self, stage: str, message: str):
        super().__init__(f"{stage}: {message}")
        self.stage = stage


def say(text: str) -> None:
    print(f"[gate] {text}", file=sys.stderr, flush=True)


def checked_rows(data: str, row: int) -> list:
    """--data's rows, refused in one line (exit 2) where row `row` is not among them."""
    from trainer.errors import UsageError
    from trainer.run import data as data_mod

    if data == SYNTHETIC:
        return []
    rows = data_mod.read_rows(data)
    if not 1 <= row <= len(rows):
        raise UsageError(f"--row {row}: {data} has {len(rows)} row(s)")
    return rows


def one_row(target, data: str, row: int, new_tokens: int, cfg) -> tuple[list[int], list[int]]:
    """(prompt ids, the target's greedy continuation) of row `row` (1-based, among the rows the trainer
    reads; synthetic: the row-th random prompt the run's seed draws, as its synthetic data does)."""
    from trainer.run import data as data_mod
    from trainer.specdec import target_greedy

    if data == SYNTHETIC:
        low, high, exclude = data_mod.prompt_vocab(target)
        prompt = data_mod.random_prompts(row, cfg.synthetic_prompt_len, low=low, high=high, seed=cfg.seed,
                                         exclude=exclude)[row - 1]
    else:
        rows = checked_rows(data, row)
        (n, sample), = data_mod.encode_rows([rows[row - 1]], target.tokenizer, data)
        prompt = list(data_mod.row_prompt(sample))
    # the row must fit the run's --seq-len whole, or its last tokens are cut before training and never
    # learnt: the prompt keeps its last tokens
    keep = max(1, cfg.seq_len - new_tokens)
    if len(prompt) > keep:
        say(f"row: its prompt keeps its last {keep} of {len(prompt)} tokens, so that prompt and continuation fit "
            f"--seq-len {cfg.seq_len}")
        prompt = prompt[-keep:]
    cont, _ = target_greedy(target, prompt, new_tokens, target.eos_ids())
    return prompt, cont


def train(args, row_file: Path, out: Path, gpus: int, extra: list[str], positions: int) -> dict:
    """The trainer on the one row, in its own process; {"first_loss", "last_loss", "seconds"}.
    positions: the row's loss positions; every one is an anchor at every step (a run's few anchors,
    drawn at random, would leave some positions of the row unlearnt and the gate failing a sound pipeline)."""
    config = ["--config", args.config] if args.config else []
    # the run's flags first, the gate's after them: the trainer takes a flag's last value
    cmd = [sys.executable, "-m", "trainer", *config, *extra, "--target", args.target,
           "--data", str(row_file), "--out", str(out), "--steps", str(args.steps), "--epochs", "0", "--gpus", str(gpus),
           "--batch-size", "1", "--anchors", str(positions), "--eval-prompts", "0", "--eval-every", "0",
           "--checkpoint-every", "0", "--log-every", str(max(1, args.steps // 10))]
    t0 = time.monotonic()
    with open(out.parent / "train.log", "w") as log:
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    tail = (out.parent / "train.log").read_text(errors="replace").strip().splitlines()[-3:]
    if r.returncode != 0:
        raise GateFailed("train", f"the trainer exited {r.returncode}: {' | '.join(tail)} "
                                  f"({out.parent / 'train.log'})")
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in x and '"event"' not in x]
    if len(losses) < 2 or losses[-1] is None or not losses[-1] < losses[0] / LOSS_FALL:
        raise GateFailed("train", f"the loss did not fall on one row: {losses[0] if losses else None} -> "
                                  f"{losses[-1] if losses else None} in {args.steps} steps (the model, the mask or the "
                                  f"lr does not learn; raise --steps if it was still falling)")
    return {"first_loss": losses[0], "last_loss": losses[-1], "seconds": round(time.monotonic() - t0, 1)}


def export(run: Path, folder: Path, target, device) -> object:
    import torch

    from trainer.errors import TrainerError
    from trainer import export as export_mod
    from trainer.specdec import load_drafter

    try:
        export_mod.export(str(run), str(folder), dtype="float32")
        return load_drafter(str(folder), target, device, torch.float32)
    except Exception as e:      # noqa: BLE001 - whatever stops the folder loading (a safetensors error included)
        what = str(e) if isinstance(e, TrainerError) else f"{type(e).__name__}: {e}"
        raise GateFailed("export", f"the exported folder does not load back: {what}") from None


def decode(target, drafter, folder: Path, prompt: list[int], cont: list[int]) -> dict:
    """The row decoded by each engine (and the reference where installed): the same tokens, rounds
    that accept the whole block."""
    from trainer.specdec import decoder

    B = drafter.cfg.block_size
    got = {}
    for engine in ("eager", "graphs"):
        d = decoder(engine, target, drafter, [prompt], len(cont))
        r = d.speculative(prompt, len(cont))
        got[engine] = (r.tokens, r.produced)
    ref = _reference(target, folder, prompt, len(cont))
    if ref is not None:
        got["reference"] = ref
    for name, (tokens, _) in got.items():
        if tokens != cont:
            k = next((i for i, (a, b) in enumerate(zip(tokens, cont)) if a != b), min(len(tokens), len(cont)))
            raise GateFailed("decode", f"{name}: the output differs from the target's own continuation at new "
                                       f"token {k}: the decoder is not lossless")
    rounds = {name: produced for name, (_, produced) in got.items()}
    if len({json.dumps(p) for p in rounds.values()}) > 1:
        raise GateFailed("decode", "the decoders disagree round for round: " +
                         "; ".join(f"{k} {v}" for k, v in rounds.items()))
    produced = rounds["eager"]
    short = [i for i, n in enumerate(produced[:-1]) if n != B]
    tau = sum(produced) / max(1, len(produced))
    if short:
        raise GateFailed("decode", f"tau {tau:.2f} on the row it was trained on, not the block size {B}: round(s) "
                                   f"{', '.join(map(str, short[:8]))} accepted less than the whole block "
                                   f"(tokens per round {produced}): training, export and decoding disagree")
    return {"tau": tau, "block_size": B, "rounds": produced, "decoders": sorted(got)}


def _reference(target, folder: Path, prompt: list[int], new_tokens: int):
    """(tokens, tokens per round) by PyPI dflash's dflash_generate, or None where it is not installed."""
    try:
        from dflash import model as dflash_model
    except ImportError:
        say("decode: PyPI's dflash is not installed here: the reference decoder is left out")
        return None
    import torch

    if target.device.type != "cuda":   # its timing helper synchronises CUDA, which a CPU torch refuses:
        dflash_model._cuda_time = time.perf_counter     # only the clock, nothing that decides a token
    import warnings

    draft = dflash_model.DFlashDraftModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.tensor([prompt], device=target.device)
    with warnings.catch_warnings():     # it passes past_key_values, which transformers 5 deprecates
        warnings.simplefilter("ignore", FutureWarning)
        r = dflash_model.dflash_generate(draft.to(target.device), target.model, ids, max_new_tokens=new_tokens,
                                         stop_token_ids=sorted(target.eos_ids()), return_stats=True)
    return r.output_ids[0, len(prompt):].tolist(), list(r.acceptance_lengths)


def main(argv: list[str] | None = None) -> int:
    from trainer.errors import UsageError
    from trainer.run.config import check_target_spec
    from trainer.run.flags import OneLineParser, parse

    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = OneLineParser(prog="python -m trainer.gate",
                      description="Overfit one row, export, decode it: the pipeline works when every draft is "
                                  "accepted (tau = block size).")
    p.add_argument("--target", help="the target (an HF folder, tiny, small-code, ...; default: the run's, from "
                                     "--config and TRAINER_ARGS)")
    p.add_argument("--data", help="the run's data (chat or input_ids rows, or synthetic; default: the run's)")
    p.add_argument("--config", help="the run's YAML config (its drafter's shape and recipe)")
    p.add_argument("--row", type=int, default=1, help="which row's prompt (1-based; default 1)")
    p.add_argument("--steps", type=int, default=300, help="training steps on the one row (default 300)")
    p.add_argument("--new-tokens", type=int, default=48, help="the target's continuation to train on and decode")
    p.add_argument("--gpus", type=int, choices=(0, 1), help="0: the CPU; 1: one GPU (default: one where there is)")
    p.add_argument("--out", help="where the row, the run and the export go (default: a temporary folder, removed)")
    p.add_argument("--json", dest="json_out", help="also write the result document here")
    a = p.parse_args(argv)
    # the run's own settings, read as the trainer reads them (its --config, then its flags)
    a.cfg = parse([*(["--config", a.config] if a.config else []), *extra])
    a.target = a.target or a.cfg.target
    a.data = a.data or a.cfg.data
    check_target_spec(a.target)
    if a.steps < 10 or a.new_tokens < 2:
        raise UsageError("--steps must be >= 10 and --new-tokens >= 2")
    if a.new_tokens >= a.cfg.seq_len:
        raise UsageError(f"--new-tokens {a.new_tokens}: the row (a prompt and its continuation) must fit the run's "
                         f"--seq-len {a.cfg.seq_len}; ask for fewer")
    if a.out and Path(a.out).exists() and any(Path(a.out).iterdir()):
        raise UsageError(f"--out {a.out}: not empty; name a new folder")
    with tempfile.TemporaryDirectory(prefix="dflash-gate-") as tmp:
        return _gate(a, extra, Path(a.out or tmp))


def _gate(a, extra: list[str], root: Path) -> int:
    import torch

    from trainer.errors import UsageError
    from trainer.files import atomic_file
    from trainer.run.target import load_target

    root.mkdir(parents=True, exist_ok=True)
    gpus = a.gpus if a.gpus is not None else int(torch.cuda.is_available())
    device = torch.device("cuda:0" if gpus else "cpu")
    doc: dict = {"target": a.target, "data": a.data, "row": a.row, "steps": a.steps, "passed": False}
    stage = "row"
    checked_rows(a.data, a.row)     # bad input before anything loads
    try:
        say(f"row: row {a.row} of {a.data}, the target's own continuation of its prompt ({a.new_tokens} tokens)")
        target = load_target(a.target, device=device, dtype=torch.float32)
        prompt, cont = one_row(target, a.data, a.row, a.new_tokens, a.cfg)
        row_file = root / "row.jsonl"
        row_file.write_text(json.dumps({"input_ids": prompt + cont, "loss_mask": [0] * len(prompt) + [1] * len(cont)})
                            + "\n")
        doc["row_tokens"] = {"prompt": len(prompt), "continuation": len(cont)}
        stage = "train"
        say(f"train: {a.steps} steps on that row alone ({'GPU' if gpus else 'CPU'}; log {root / 'train.log'})")
        doc["train"] = train(a, row_file, root / "run", gpus, extra, len(cont))
        say(f"train: loss {doc['train']['first_loss']:.3f} -> {doc['train']['last_loss']:.4f} "
            f"in {doc['train']['seconds']:.0f} s")
        stage = "export"
        say("export: the run's drafter as a DFlash folder, loaded back")
        drafter = export(root / "run", root / "export", target, device)
        stage = "decode"
        say("decode: the row's prompt with the drafter (eager, graphs, and the reference where installed)")
        doc["decode"] = decode(target, drafter, root / "export", prompt, cont)
        doc["passed"] = True
        say(f"PASSED: every round accepted the whole block of {doc['decode']['block_size']} on the trained row (tau "
            f"{doc['decode']['tau']:.2f}, the last round cut by the budget); decoders "
            f"{', '.join(doc['decode']['decoders'])} agree: the pipeline works, start the long run")
        code = 0
    except GateFailed as e:
        doc.update(failed=e.stage, error=str(e))
        say(f"FAILED at {e}")
        code = 1
    except UsageError:          # bad input (the row's data, the target): one line, exit 2
        raise
    except Exception as e:      # noqa: BLE001 - a stage that crashed is that stage failing, said in one line
        doc.update(failed=stage, error=f"{type(e).__name__}: {e}")
        say(f"FAILED at {stage}: {type(e).__name__}: {e}")
        code = 1
    if a.json_out:
        with atomic_file(a.json_out) as f:
            f.write(json.dumps(doc, indent=1))
    print(json.dumps(doc), flush=True)
    return code


if __name__ == "__main__":
    from trainer.exits import exit_process, run

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    exit_process(run(main))
