"""A small real target: a Qwen3-architecture causal LM trained here on the standard library's sources.

No pretrained model can be downloaded on the machines this project runs on, and a target with random
weights says nothing about a drafter: its greedy continuations collapse into loops. Code is what every
Python installation carries (the standard library's own `.py` files) and is where speculative decoding
gains most, so this trains a small code model on it and writes an ordinary Hugging Face folder
(config, safetensors, a byte-level BPE tokenizer trained on the same text, a chat template, a mask
token) that `--target` loads like any other.

The text is a fixed, sorted list of modules; about one module in twenty (chosen by a hash of its path,
so the choice does not depend on which other modules exist) is held out: never trained on, used for
prompts and evaluation. The chat template is plain concatenation (a code model continues what it is
given): the user turn is the code so far, the assistant turn its continuation, then end-of-text.

    python -m trainer.small_lm --size cpu --out DIR      # minutes on 2 CPU cores
    python -m trainer.small_lm --size gpu --out DIR      # minutes on one H200 (docs/fidelity.md)

A DIR that already holds the same recipe's build (the cache's key) is kept, not trained again.

`--target small-code` / `small-code-gpu` resolve to the cached folder (built on first use), under
$DFLASH_OPS_CACHE or ~/.cache/dflash-ops/, keyed by the recipe and the text.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from trainer.files import atomic_folder
from trainer.owned import not_a_small_lm
from trainer.run.cache import cache_root
from trainer.run.cpu_shards import ShardedGrads

EOT, MASK = "<|endoftext|>", "<|mask|>"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}{% endfor %}")
SKIP_DIRS = {"site-packages", "__pycache__", "lib2to3"}
TEST_DIRS = {"test", "tests", "idle_test"}
HELD_OUT_EVERY = 20
CPU_SHARDS = 2      # each CPU step's batch in 2 shards, 2 worker threads where there are 2 cores


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the model; its hash names the cache folder."""
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int
    max_bytes: int  # training text used (the first modules of the sorted list up to this size)
    with_tests: bool = False  # also the standard library's own test suites (more text for a larger model)
    seed: int = 0
    eval_batches: int = 8


RECIPES = {
    # Seconds on a CPU: for tests and dry runs of the pipeline; too small to say anything about a drafter.
    "smoke": Recipe("smoke", vocab_size=384, hidden_size=32, num_layers=8, num_heads=2, num_kv_heads=1,
                    head_dim=16, intermediate_size=64, seq_len=64, batch_size=16, steps=60, lr=1e-2,
                    warmup=10, max_bytes=400_000, eval_batches=2),
    # 6 layers, not 8: at this budget the 8-layer model was the worse one (held-out loss 4.15 against
    # 4.29, both with the sharded step; docs/decisions.md) and a step costs ~1/5 less.
    "cpu": Recipe("cpu", vocab_size=2048, hidden_size=128, num_layers=6, num_heads=4, num_kv_heads=2,
                  head_dim=32, intermediate_size=384, seq_len=128, batch_size=16, steps=450, lr=3e-3,
                  warmup=30, max_bytes=6_000_000),
    # Measured on one H200 (docs/decisions.md): 204k tokens/s for this size in bf16; 1.5e-3 diverged
    # (NaN within 32 steps) and 6e-4 after ~200; steps whose gradient overflows are skipped. The text
    # (~2.7M tokens where the tests are not installed) limits the size more than the 5-minute budget
    # does: ~8 passes over it.
    "gpu": Recipe("gpu", vocab_size=8192, hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=4,
                  head_dim=64, intermediate_size=2304, seq_len=1024, batch_size=32, steps=650, lr=4e-4,
                  warmup=50, max_bytes=40_000_000, with_tests=True),
}


def stdlib_modules(root: str | None = None, with_tests: bool = False) -> list[Path]:
    """The standard library's .py files outside site-packages (and tests), sorted by relative path."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    skip = SKIP_DIRS if with_tests else SKIP_DIRS | TEST_DIRS
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


def held_out(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


def corpus(recipe: Recipe, root: str | None = None) -> tuple[list[str], list[str], str]:
    """(training texts, held-out texts, a hash of both) from the standard library."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    train, held, h, size = [], [], hashlib.sha256(), 0
    for p in stdlib_modules(str(base), recipe.with_tests):
        rel = p.relative_to(base).as_posix()
        held_back = held_out(rel)
        if not held_back and size >= recipe.max_bytes:
            continue        # past the training budget and not held out: not read
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if held_back:
            held.append(text)
        else:
            train.append(text)
            size += len(text)
        h.update(rel.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
    return train, held, h.hexdigest()[:16]


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT, MASK], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def hf_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    t = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token=EOT, mask_token=MASK)
    t.chat_template = CHAT_TEMPLATE
    return t


def model_config(recipe: Recipe, vocab_size: int):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab_size, hidden_size=recipe.hidden_size,
                       intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_layers,
                       num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_kv_heads,
                       head_dim=recipe.head_dim, max_position_embeddings=4096, rope_theta=10000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                       eos_token_id=0, pad_token_id=0)


def pack(token_lists: list[list[int]], seq_len: int, eot: int) -> torch.Tensor:
    """Documents joined by EOT, cut into (N, seq_len + 1) rows (input and shifted labels)."""
    flat = []
    for ids in token_lists:
        flat += ids + [eot]
    n = (len(flat) - 1) // seq_len
    t = torch.tensor(flat[: n * seq_len + 1])
    return torch.stack([t[i * seq_len: (i + 1) * seq_len + 1] for i in range(n)])


def unigram_loss(train_rows: torch.Tensor, eval_rows: torch.Tensor, vocab: int) -> float:
    """Held-out cross-entropy of the training text's token frequencies (add-one): the floor to beat."""
    counts = torch.bincount(train_rows[:, 1:].reshape(-1), minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return float(-logp[eval_rows[:, 1:].reshape(-1)].mean())


def build(size: str, out: str, *, root: str | None = None, log=print, steps: int | None = None) -> dict:
    """Train the `size` recipe and write an HF folder at `out` (atomically). Returns its report."""
    from transformers import Qwen3ForCausalLM

    recipe = RECIPES[size]
    if steps is not None:
        recipe = dataclasses.replace(recipe, steps=steps)
    t0 = time.time()
    torch.manual_seed(recipe.seed)
    train_texts, held_texts, text_hash = corpus(recipe, root)
    log(f"small_lm[{size}]: {len(train_texts)} training modules, {len(held_texts)} held out")
    tok = train_tokenizer(train_texts, recipe.vocab_size)
    hf_tok = hf_tokenizer(tok)
    eot = tok.token_to_id(EOT)
    enc = lambda texts: [e.ids for e in tok.encode_batch(texts)]  # noqa: E731
    train_rows = pack(enc(train_texts), recipe.seq_len, eot)
    eval_rows = pack(enc(held_texts), recipe.seq_len, eot)
    g = torch.Generator().manual_seed(recipe.seed)
    eval_rows = eval_rows[torch.randperm(len(eval_rows), generator=g)[: recipe.eval_batches * recipe.batch_size]]
    log(f"small_lm[{size}]: tokenizer {tok.get_vocab_size()} tokens; {train_rows.numel() / 1e6:.2f}M training "
        f"tokens; {time.time() - t0:.1f} s")

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = model_config(recipe, tok.get_vocab_size())
    model = Qwen3ForCausalLM(cfg).to(dev)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=recipe.lr, betas=(0.9, 0.95), fused=True)  # fused on a CPU too: faster there
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def lr_at(step: int) -> float:
        if step < recipe.warmup:
            return recipe.lr * (step + 1) / recipe.warmup
        frac = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
        return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    @torch.no_grad()
    def held_loss() -> float:
        model.eval()
        tot = 0.0
        for i in range(0, len(eval_rows), recipe.batch_size):
            rows = eval_rows[i: i + recipe.batch_size].to(dev)
            with amp:
                logits = model(input_ids=rows[:, :-1]).logits
            tot += float(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                           rows[:, 1:].flatten())) * len(rows)
        model.train()
        return tot / len(eval_rows)

    def loss_of(rows: torch.Tensor) -> torch.Tensor:
        with amp:
            logits = model(input_ids=rows[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())

    base = unigram_loss(train_rows, eval_rows, tok.get_vocab_size())
    # On the CPU the batch's gradient comes from shards in worker threads (cpu_shards: a busy machine
    # slows them less than torch's intra-op threads, and the bits do not follow the load).
    with contextlib.nullcontext() if cuda else ShardedGrads(list(model.parameters()), CPU_SHARDS) as shards:
        log(f"small_lm[{size}]: {params / 1e6:.2f}M parameters on {dev.type}"
            f"{'; ' + shards.describe() if shards else ''}; held-out loss: unigram {base:.3f}, "
            f"untrained {held_loss():.3f}")
        order = torch.randperm(len(train_rows), generator=g)
        t_train, pos, last, skipped = time.time(), 0, time.time(), 0
        for step in range(recipe.steps):
            if pos + recipe.batch_size > len(order):
                order, pos = torch.randperm(len(train_rows), generator=g), 0
            rows = train_rows[order[pos: pos + recipe.batch_size]].to(dev, non_blocking=True)
            pos += recipe.batch_size
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            if shards is not None:
                loss = shards(rows, loss_of)
            else:
                loss = loss_of(rows)
                loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if torch.isfinite(norm):
                opt.step()
            else:  # an overflowing bf16 step: skipped (as a loss scaler would), not applied as NaN weights
                skipped += 1
            opt.zero_grad(set_to_none=True)
            if time.time() - last >= 10 or step == recipe.steps - 1:
                last = time.time()
                rate = (step + 1) * recipe.batch_size * recipe.seq_len / (last - t_train)
                eta = (recipe.steps - step - 1) * (last - t_train) / (step + 1)
                log(f"small_lm[{size}]: step {step + 1}/{recipe.steps} loss {loss.item():.3f} "
                    f"{rate / 1e3:.1f}k tok/s eta {eta:.0f}s")
        final = held_loss()
    if not math.isfinite(final) or final >= base:
        raise RuntimeError(f"small_lm[{size}]: held-out loss {final:.3f} is no better than the unigram's {base:.3f}; "
                           f"{skipped} of {recipe.steps} steps overflowed")
    report = {"recipe": dataclasses.asdict(recipe), "text_hash": text_hash, "parameters": params,
              "held_out_loss": final, "unigram_loss": base, "train_seconds": time.time() - t_train,
              "seconds": time.time() - t0, "device": dev.type,
              "train_tokens_seen": recipe.steps * recipe.batch_size * recipe.seq_len, "skipped_steps": skipped}
    log(f"small_lm[{size}]: held-out loss {final:.3f} (unigram {base:.3f}) after {report['seconds']:.0f} s")

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's bar would bury the log's lines
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_folder(out_path, replaces=not_a_small_lm) as tmp:
        model.to(torch.float32 if not cuda else torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        hf_tok.save_pretrained(tmp)
        (tmp / "small_lm.json").write_text(json.dumps(report, indent=2))
    return report


def cut_prompts(texts: list[str], n: int, *, seed: int = 0, lines: int = 12, max_chars: int = 600,
                keep: Callable[[str], bool] | None = None) -> list[str]:
    """n distinct code prompts: `lines` whole lines from a random place in a random module
    (deterministic; distinct, so a run's held-out eval prompts never repeat a training prompt).
    keep: a test every prompt must pass; a candidate that fails it is not counted and more are drawn.
    Fewer than n where the texts hold no more (after 50 n draws)."""
    import random

    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        src = texts[rng.randrange(len(texts))].splitlines(keepends=True)
        if len(src) < lines + 1:
            continue
        i = rng.randrange(len(src) - lines)
        text = "".join(src[i: i + lines])[:max_chars]
        if text.strip() and text not in seen:
            seen.add(text)
            if keep is None or keep(text):
                out.append(text)
    return out


# A held-out module is not held-out text: the standard library repeats itself (the codecs generated
# from one template, test fodder, copied helpers), and a prompt the target was trained on measures
# recall, not drafting. Windows of 3 lines catch those copies; on the `gpu` recipe's text, requiring a
# window to hold at least 40 characters (to spare `pass` / `else:` / `pass`) kept 2 more of 300
# candidates: what 3 lines match is copied code, not common idiom.
SEEN_LINES = 3


def _windows(text: str, k: int) -> set[int]:
    """Hashes of every k consecutive non-blank lines of text, whitespace runs made one space (so
    re-indented or re-wrapped copies match). hash(): within one process, collisions ~1e-9 here."""
    norm = [" ".join(line.split()) for line in text.splitlines() if line.strip()]
    return {hash("\n".join(norm[i: i + k])) for i in range(len(norm) - k + 1)}


def seen_in(train: list[str], k: int = SEEN_LINES) -> Callable[[str], bool]:
    """A test of whether a text shares k consecutive non-blank lines (whitespace normalised) with the
    training texts; a text of fewer than k non-blank lines is never seen."""
    windows = set().union(*(_windows(t, k) for t in train))
    return lambda text: not windows.isdisjoint(_windows(text, k))


# --------------------------------------------------------------------------- the cache

def cache_key(recipe: Recipe, text_hash: str) -> str:
    return _key(dataclasses.asdict(recipe), text_hash)


def _key(recipe: dict, text_hash: str) -> str:
    doc = json.dumps([recipe, text_hash, CHAT_TEMPLATE, EOT, MASK], sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def built(size: str, out: str | Path) -> dict | None:
    """The report of OUT when it already holds the `size` recipe built from this text (the same key
    as the cache's), else None: `--out DIR` a second time keeps DIR rather than training again."""
    try:
        report = json.loads((Path(out) / "small_lm.json").read_text())
        key = _key(report["recipe"], report["text_hash"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    recipe = RECIPES[size]
    if not (Path(out) / "model.safetensors").is_file() or key != cache_key(recipe, corpus(recipe)[2]):
        return None
    return report


def ensure(size: str, *, log=print) -> Path:
    """The cached folder of the `size` recipe, built (under a lock, atomically) when missing."""
    import fcntl

    recipe = RECIPES[size]
    _, _, text_hash = corpus(recipe)
    folder = cache_root() / f"small-code-{size}-{cache_key(recipe, text_hash)}"
    if (folder / "small_lm.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second build of the same recipe waits for the first
        if not (folder / "small_lm.json").is_file():
            log(f"small_lm[{size}]: building the small real target once into {folder}")
            build(size, str(folder), log=log)
    return folder


def write_prompts(size: str, split: str, n: int, out: str, *, seed: int = 0, root: str | None = None) -> dict:
    """n prompts cut from the training modules (split 'train') or the held-out ones ('held-out') to a
    JSONL file; held-out candidates whose text occurs in the training text (`seen_in`) are dropped and
    others drawn. root: the standard library's folder (default this Python's). Returns {"prompts":
    written, "dropped": held-out candidates dropped}."""
    train, held, _ = corpus(RECIPES[size], root)
    dropped = []
    if split == "train":
        texts = cut_prompts(train, n, seed=seed)
    else:
        seen = seen_in(train)

        def unseen(text: str) -> bool:
            if seen(text):
                dropped.append(text)
                return False
            return True

        texts = cut_prompts(held, n, seed=seed + 7919, keep=unseen)
    from trainer.writer_lock import output_lock

    with output_lock(out, "--out"), open(out, "w", encoding="utf-8") as f:   # one writer per file
        for t in texts:
            f.write(json.dumps({"prompt": t}) + "\n")
    return {"prompts": len(texts), "dropped": len(dropped)}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m trainer.small_lm",
                                description="Build the small real target (a code LM trained on the standard "
                                            "library), or cut prompts from its text.")
    p.add_argument("--size", choices=sorted(RECIPES), default="cpu")
    p.add_argument("--out", help="the HF folder to write (default: the cache, reused when built)")
    p.add_argument("--prompts", choices=("train", "held-out"),
                   help="instead: write --n prompts cut from the training or the held-out modules to --out (JSONL); "
                        "held-out ones whose text occurs in the training text are dropped, and more drawn")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="which sample of prompts (another seed, another sample)")
    a = p.parse_args(argv)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if a.prompts:
        if not a.out:
            p.error("--prompts needs --out FILE")
        got = write_prompts(a.size, a.prompts, a.n, a.out, seed=a.seed)
        if a.prompts == "held-out":
            say(f"small_lm[{a.size}]: dropped {got['dropped']} held-out prompts drawn whose text occurs in the "
                f"training text ({SEEN_LINES} consecutive lines); {got['prompts']} remain")
        if got["prompts"] < a.n:
            say(f"small_lm[{a.size}]: only {got['prompts']} of the {a.n} prompts asked: the text holds no more")
        print(json.dumps({**got, "split": a.prompts, "out": a.out}))
        return 0
    if a.out:
        report = built(a.size, a.out)
        kept = report is not None
        if report is not None:      # kept
            say(f"small_lm[{a.size}]: kept: {a.out} already holds this recipe's build (held-out loss "
                f"{report['held_out_loss']:.3f}); delete it to build again")
        else:
            from trainer.errors import UsageError

            if why := not_a_small_lm(Path(a.out)):   # checked before minutes of building, and again at the swap
                raise UsageError(f"--out {a.out}: {why}; nothing was replaced (remove it yourself, or name another "
                                 "folder)")
            report = build(a.size, a.out, log=say)
        print(json.dumps({"out": a.out, "kept": kept,
                          **{k: report[k] for k in ("held_out_loss", "unigram_loss", "seconds")}}))
    else:
        print(json.dumps({"out": str(ensure(a.size, log=say))}))
    return 0

