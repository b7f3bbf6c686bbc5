"""Training data: JSONL rows, chat rows through the target's template, or the target's own continuations.

Row formats (one JSON object per line; other keys are ignored):
  {"input_ids": [int, ...], "loss_mask": [0|1, ...]}   loss_mask optional (default: all ones)
  {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
      rendered with the target tokenizer's chat template, loss on the assistant turns' tokens.
`synthetic` (for tests: random-token prompts, no chat template): random prompts continued by the
target itself, loss on the continuation; written once as JSONL under OUT/data/ and reused on resume.

Eval prompts are the prompts of held-out rows (split_eval), synthetic rows included, so tau is
measured on the training data's distribution; `overlap` counts those a training row also starts with.

Batches are deterministic functions of (seed, step, data position), so a resumed run sees exactly
the batches and anchors the uninterrupted run would have seen.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

import torch

from trainer.model import masks
from trainer.errors import Stopped, UsageError
from trainer.files import atomic_file
from trainer.run.jsonl import read_jsonl


@dataclass(frozen=True)
class Sample:
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]


# --------------------------------------------------------------------------- reading JSONL

def read_rows(path: str) -> list[tuple[int, dict]]:
    """(line number, row) for each non-empty line; bad JSON or a non-object is a UsageError. Rows
    regen could not answer ({"line": N, "skipped": why}, warned and counted there) are passed over."""
    rows = [(n, row) for n, row in read_jsonl(path, "--data")
            if not (isinstance(row, dict) and "skipped" in row and "messages" not in row and "input_ids" not in row)]
    if not rows:
        raise UsageError(f"--data {path}: every row is one regen skipped")
    checked: list[tuple[int, dict]] = []
    for n, row in rows:
        if not isinstance(row, dict) or not (("input_ids" in row) ^ ("messages" in row)):
            raise UsageError(f"{path}:{n}: each row needs exactly one of 'input_ids' or 'messages'")
        checked.append((n, row))
    return checked


def encode_rows(rows: list[tuple[int, dict]], tokenizer, path: str, *, template_kwargs: Mapping | None = None,
                train_thinking: bool = False) -> list[tuple[int, Sample]]:
    out = []
    for n, row in rows:
        where = f"{path}:{n}"
        if "input_ids" in row:
            ids = row["input_ids"]
            mask = row.get("loss_mask", [1] * len(ids) if isinstance(ids, list) else None)
            if not _int_list(ids) or not _int_list(mask):
                raise UsageError(f"{where}: 'input_ids' and 'loss_mask' must be lists of integers")
            if len(mask) != len(ids):
                raise UsageError(f"{where}: 'loss_mask' has {len(mask)} entries, 'input_ids' {len(ids)}")
            if any(m not in (0, 1) for m in mask):
                raise UsageError(f"{where}: 'loss_mask' entries must be 0 or 1")
        else:
            if tokenizer is None:
                raise UsageError(f"{where}: chat rows need the target's tokenizer, and the target folder has none")
            ids, mask = encode_chat(tokenizer, row["messages"], where, template_kwargs=template_kwargs,
                                    train_thinking=train_thinking)
        out.append((n, Sample(tuple(ids), tuple(mask))))
    return out


def _int_list(v) -> TypeGuard[list[int]]:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def encode_chat(tokenizer, messages, where: str = "messages", *, template_kwargs: Mapping | None = None,
                train_thinking: bool = False) -> tuple[list[int], list[int]]:
    """Render a chat with the tokenizer's template; loss mask 1 on the tokens of assistant turns.

    An assistant turn's tokens are those the template adds after the generation prompt of the
    conversation before it: render(msgs[:i], add_generation_prompt=True) is a prefix of
    render(msgs[:i+1]). Templates that rewrite earlier turns (Qwen3 drops old <think> blocks) can
    break the prefix property for earlier turns; then the common prefix decides where loss starts.

    template_kwargs go to every apply_chat_template call (Qwen3-style templates read
    `enable_thinking`; with it false the generation prompt ends in an empty think block, which is
    then part of the prompt). A `<think>...</think>` block (and the whitespace after it) that opens
    an assistant turn gets loss mask 0 unless train_thinking: a drafter trained the DFlash way
    learns the answers, not the template's scaffolding.
    """
    if not isinstance(messages, list) or not all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise UsageError(f"{where}: 'messages' must be a list of {{'role': str, 'content': str}}")
    if not any(m["role"] == "assistant" for m in messages):
        raise UsageError(f"{where}: no assistant message, so nothing to train on")
    kw = dict(template_kwargs or {})
    full = _render(tokenizer, messages, False, kw)
    mask = [0] * len(full)
    think = None if train_thinking else think_ids(tokenizer)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _common_prefix(_render(tokenizer, messages[:i], True, kw), full)
        end = _common_prefix(_render(tokenizer, messages[: i + 1], False, kw), full)
        if think is not None:
            start = _skip_think_block(tokenizer, full, start, end, *think)
        for j in range(start, end):
            mask[j] = 1
    return full, mask


def think_ids(tokenizer) -> tuple[int, int] | None:
    """The ids of `<think>` and `</think>` when the tokenizer has each as one token, else None."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is None:
        return None
    ids = [convert(t) for t in ("<think>", "</think>")]
    unk = getattr(tokenizer, "unk_token_id", None)
    if any(not isinstance(i, int) or i == unk or i < 0 for i in ids):
        return None
    return ids[0], ids[1]


def _skip_think_block(tokenizer, ids: list[int], start: int, end: int, open_id: int, close_id: int) -> int:
    """Where loss starts in ids[start:end]: past a leading <think>...</think> block and the
    whitespace after it, if the turn opens with one (else start)."""
    j = start
    while j < end and not tokenizer.decode([ids[j]]).strip():  # whitespace before <think>
        j += 1
    if j >= end or ids[j] != open_id:
        return start
    try:
        j = ids.index(close_id, j, end) + 1
    except ValueError:
        return start  # an unclosed think block: the answer never starts; leave the turn as it is
    while j < end and not tokenizer.decode([ids[j]]).strip():
        j += 1
    return j


def _render(tokenizer, messages, generation_prompt: bool, template_kwargs: Mapping | None = None) -> list[int]:
    if not messages:
        return []
    r = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=generation_prompt,
                                      **dict(template_kwargs or {}))
    if isinstance(r, Mapping) or hasattr(r, "input_ids"):  # transformers 5 returns a BatchEncoding
        r = r["input_ids"]
    if r and isinstance(r[0], list):
        r = r[0]
    return [int(t) for t in r]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_samples(numbered: list[tuple[int, Sample]], *, path: str, block_size: int, seq_len: int,
                  vocab_size: int) -> tuple[list[Sample], int]:
    """Truncate to seq_len; a row shorter than one block or with an out-of-range id is an error.

    Rows with no loss-masked position where a block fits are skipped (a short final answer in chat
    data is normal); returns (usable samples, number skipped). No usable row at all is an error.
    """
    usable, skipped = [], 0
    for n, s in numbered:
        if len(s.input_ids) < block_size:
            raise UsageError(f"{path}:{n}: sequence of {len(s.input_ids)} tokens is shorter than one block "
                             f"({block_size})")
        bad = next((t for t in s.input_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise UsageError(f"{path}:{n}: token id {bad} is outside the target's vocabulary (0..{vocab_size - 1})")
        s = Sample(s.input_ids[:seq_len], s.loss_mask[:seq_len])
        if no_room(s, block_size, seq_len):
            skipped += 1
            continue
        usable.append(s)
    if not usable:
        raise UsageError(f"{path}: no row has a loss-masked position where a block of {block_size} fits "
                         f"within --seq-len {seq_len}")
    return usable, skipped


def no_room(s: Sample, block_size: int, seq_len: int) -> str | None:
    """Why check_samples will skip this row ("prompt": its answer starts too late for a block within
    seq_len; "answer": its answers are shorter than a block), or None when a block fits."""
    s = Sample(s.input_ids[:seq_len], s.loss_mask[:seq_len])
    if len(masks.anchor_candidates(torch.tensor(s.loss_mask), len(s.input_ids), block_size)):
        return None
    first = next((i for i, m in enumerate(s.loss_mask) if m), len(s.loss_mask))
    return "prompt" if first > seq_len - block_size else "answer"


def row_prompt(s: Sample) -> tuple[int, ...]:
    """A row's prompt: its tokens before the first loss token (at least one)."""
    first = next((i for i, m in enumerate(s.loss_mask) if m), len(s.loss_mask))
    return s.input_ids[: max(first, 1)]


def split_eval(samples: list[Sample], n_eval: int) -> tuple[list[Sample], list[list[int]], bool]:
    """Hold out the last n_eval rows as eval prompts (their row_prompt).

    Returns (train samples, prompts, held_out). With fewer than 2 * n_eval rows nothing is held out
    and the prompts come from training rows (held_out False; `overlap` then finds them all).
    """
    if n_eval <= 0:
        return samples, [], True
    if len(samples) >= 2 * n_eval:
        return samples[:-n_eval], [list(row_prompt(s)) for s in samples[-n_eval:]], True
    return samples, [list(row_prompt(s)) for s in samples[:n_eval]], False


def overlap(prompts: list[list[int]], samples: list[Sample]) -> int:
    """How many eval prompts are also a training row's prompt (the same tokens)."""
    seen = {row_prompt(s) for s in samples}
    return sum(tuple(p) in seen for p in prompts)


# --------------------------------------------------------------------------- synthetic data

def random_prompts(n: int, length: int, *, low: int, high: int, seed: int,
                   exclude: Collection[int] = frozenset()) -> list[list[int]]:
    """n prompts of `length` token ids drawn uniformly from [low, high) minus `exclude`."""
    allowed = torch.tensor([t for t in range(low, high) if t not in exclude])
    g = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(len(allowed), (n, length), generator=g)].tolist()


def prompt_vocab(target) -> tuple[int, int, set[int]]:
    """(low, high, excluded) ids for random prompts: ordinary tokens of the target's tokenizer."""
    tok = target.tokenizer
    if tok is None:
        return 0, target.config.vocab_size, set()
    if hasattr(tok, "all_special_ids"):
        return 0, len(tok), set(tok.all_special_ids)
    return 0, 256, set()  # ByteTokenizer: bytes only


@torch.no_grad()
def continue_prompts(target, prompts: torch.Tensor, new_tokens: int, *, temperature: float,
                     generator: torch.Generator | None) -> torch.Tensor:
    """prompts (N, P) -> continuations (N, new_tokens), greedy (temperature 0) or sampled, KV cached."""
    logits, _, cache = target.decode(prompts)
    logits = logits[:, -1]
    toks = []
    for i in range(new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(prompts.device)[:, 0]
        else:
            nxt = logits.argmax(-1)
        toks.append(nxt)
        if i + 1 < new_tokens:
            logits, _, cache = target.decode(nxt[:, None], cache)
            logits = logits[:, -1]
    return torch.stack(toks, dim=1)


@contextlib.contextmanager
def one_cpu_thread(on: bool):
    """torch's intra-op threads at 1 while the target decodes on the CPU: each call of a token's decode is
    little work, and a second thread's spinning waits lose several-fold to a busy machine's other
    processes (docs/benchmarks.md, "Synthetic data")."""
    if not on:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def synthetic(target, *, folder: Path, identity: dict, n: int, prompt_len: int, new_tokens: int, temperature: float,
              seed: int, min_new: int, batch: int = 128, should_stop=lambda: False) -> tuple[Path, bool]:
    """(FOLDER/synthetic-KEY.jsonl, whether it was there already): n random prompts continued by the
    target, written once (atomically) and reused by every later run with the same inputs.

    KEY covers everything that changes the rows (the target's identity: trainer/run/provenance.py's, its
    weights' hashes included, so a target rebuilt in the same folder is another; the device type, whose
    kernels may round differently; the seed and every size), so a cached file is only reused when it is
    the same data.
    A continuation is cut after the first EOS, and dropped if that leaves fewer than `min_new` tokens
    (no room for a block); rows are prompt + continuation, with loss on the continuation.
    """
    spec = dict(target=identity, device=target.device.type, n=n, prompt_len=prompt_len,
                new_tokens=new_tokens, temperature=temperature, seed=seed, min_new=min_new, v=1)
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    path = Path(folder) / f"synthetic-{key}.jsonl"
    if path.is_file():
        return path, True
    path.parent.mkdir(parents=True, exist_ok=True)
    low, high, exclude = prompt_vocab(target)
    prompts = random_prompts(n, prompt_len, low=low, high=high, seed=seed, exclude=exclude)
    eos = target.eos_ids()
    g = torch.Generator().manual_seed(seed + 1)
    with one_cpu_thread(target.device.type == "cpu"), atomic_file(path) as f:  # SIGTERM (Stopped) leaves no file
        for i in range(0, n, batch):
            if should_stop():
                break
            p = torch.tensor(prompts[i: i + batch], device=target.device)
            cont = continue_prompts(target, p, new_tokens, temperature=temperature, generator=g).tolist()
            for prompt, c in zip(prompts[i: i + batch], cont):
                cut = next((j + 1 for j, t in enumerate(c) if t in eos), len(c))
                c = c[:cut]
                if len(c) < min_new:
                    continue
                f.write(json.dumps({"input_ids": prompt + c, "loss_mask": [0] * len(prompt) + [1] * len(c)}) + "\n")
        if should_stop():
            raise Stopped("SIGTERM while generating synthetic data, before training started: nothing to checkpoint")
    return path, False


# --------------------------------------------------------------------------- batches

class Loader:
    """Sample indices in a fresh seeded permutation per epoch; its position is (epoch, cursor)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self.epoch, self.cursor = 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.cursor == self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._perm = self._permutation()
            take = min(k - len(out), self.n - self.cursor)
            out += self._perm[self.cursor: self.cursor + take]
            self.cursor += take
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state(self, state: Mapping) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._perm = self._permutation()


@dataclass
class Batch:
    input_ids: torch.Tensor   # (B, S) long, right-padded
    loss_mask: torch.Tensor   # (B, S) float
    anchors: torch.Tensor     # (B, N) long, sorted; padding anchors are 0
    valid: torch.Tensor       # (B, N) bool
    lengths: torch.Tensor     # (B,) long, real (unpadded) tokens per row
    weight_total: float       # sum of loss weights over the WHOLE batch (every shard divides by it)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def shard(self, i: int, k: int) -> "Batch":
        """The i-th of k equal contiguous shards; weight_total stays the global one."""
        b = len(self) // k
        sl = slice(i * b, (i + 1) * b)
        return Batch(self.input_ids[sl], self.loss_mask[sl], self.anchors[sl], self.valid[sl],
                     self.lengths[sl], self.weight_total)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device) -> "Batch":
        t = lambda x: x.to(device, non_blocking=True)  # noqa: E731
        return Batch(t(self.input_ids), t(self.loss_mask), t(self.anchors), t(self.valid), self.lengths,
                     self.weight_total)


def anchor_seed(seed: int, step: int, row: int) -> int:
    """Anchors for row `row` of step `step`: a pure function, so resume and sharding reproduce them."""
    return (seed * 1_000_003 + step * 8191 + row) % (2**63 - 1)


def most_anchors(samples: Sequence[Sample], block_size: int) -> int:
    """The most anchors any row holds (masks.anchor_candidates: its loss positions with a whole block
    after them), which sample_anchors draws all of when --anchors is at least this."""
    return max((len(masks.anchor_candidates(torch.tensor(s.loss_mask), len(s.input_ids), block_size))
                for s in samples), default=0)


def make_batch(samples: Sequence[Sample], *, pad_len: int, pad_id: int, step: int, seed: int,
               block_size: int, anchors: int, pos_weights: torch.Tensor) -> Batch:
    B = len(samples)
    ids = torch.full((B, pad_len), pad_id, dtype=torch.long)
    lm = torch.zeros((B, pad_len), dtype=torch.float32)
    anc = torch.zeros((B, anchors), dtype=torch.long)
    val = torch.zeros((B, anchors), dtype=torch.bool)
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)
    for j, s in enumerate(samples):
        L = len(s.input_ids)
        ids[j, :L] = torch.tensor(s.input_ids)
        lm[j, :L] = torch.tensor(s.loss_mask, dtype=torch.float32)
        g = torch.Generator().manual_seed(anchor_seed(seed, step, j))
        anc[j], val[j] = masks.sample_anchors(lm[j], L, block_size, anchors, g)
    _, w = masks.block_labels(ids, lm, anc, val, pos_weights)
    return Batch(ids, lm, anc, val, lengths, float(w.sum()))
