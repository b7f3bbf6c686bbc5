"""Answers by the target: training rows whose assistant turns the target itself wrote.

    python -m trainer.regen --target T --prompts FILE --out FILE.jsonl [--max-new-tokens N]
        [--batch-size B] [--temperature 0] [--gpus N] [--thinking] [--no-resume]
        [--block-size 16 --seq-len 3072]      # the training run's: rows it would skip are counted

The DFlash recipe trains the drafter on the target's own answers (SpecForge's
regenerate_train_data.py): a drafter learns the distribution it will be asked to guess. Input rows
are JSONL, one of
    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}, ...]}
    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}   (ShareGPT)
    {"prompt": "..."}
The user (and system) turns are kept, assistant turns are dropped and answered again, turn by turn
(the second user turn sees the target's first answer). Generation uses the target's chat template
with thinking off (`enable_thinking=False`, as the recipe), greedy unless --temperature > 0.

The output is the chat-row JSONL the trainer reads, one row per input row, in input order, each
with its input line number (`"line"`). Rows are written a batch at a time (input rows
[k*B, (k+1)*B)), appended, flushed and fsynced; a killed run is resumed (the default when the
output exists) from the first batch not complete in the file: a torn last batch is cut off, so no
row is lost or doubled and the batches, hence the answers, are those of an uninterrupted run.
A row the target cannot answer (its tokenizer refuses it, it renders to no tokens, or it leaves no room in
the target's context for --max-new-tokens) is written as {"line": N, "skipped": why}, warned and counted,
and the trainer passes over it: the run never stops on one row. (Empty, unencodable and over-long rows
are refused before that, naming file:line, by `read_prompts`, which the controller runs too.)
One writer per output (trainer/writer_lock.py): a second regen of the same --out is refused while
the first runs, so two never append to one file.

Progress goes to stderr at least every PROGRESS_S seconds, answered batches or not: rows done,
rows/s, tokens/s and the ETA. The last stdout line is a JSON document with the output's path.
Rows the trainer will skip at the run's --block-size and --seq-len (no room for a block in the loss
mask: the prompt leaves too little of seq_len, or the answer is shorter than a block) are counted
as they are answered and said in one line at the end, with what to change.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from trainer import faults
from trainer.cores import passive_waits
from trainer.errors import UsageError
from trainer.run.jsonl import iter_jsonl
from trainer.writer_lock import output_lock

PROGRESS_S = 10.0
# A row's text (its kept turns together), checked before anything loads: no context takes more (a
# token is at least a character or so), and tokenizing 10 MB ran a regen's memory past 8 GB. The
# target's own context is checked once its tokenizer has rendered the row (`_prompt`).
MAX_PROMPT_CHARS = 1_000_000
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
         "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


@dataclass(frozen=True)
class Row:
    line: int
    turns: tuple[tuple[str, str], ...]  # (role, content) of the system/user turns, in order


def read_prompts(path: str) -> list[Row]:
    """Input rows -> the turns to answer; a bad row is a UsageError naming file:line. Torch-free."""
    return list(iter_prompts(path))


def iter_prompts(path: str) -> Iterator[Row]:
    """read_prompts' rows one at a time: memory bounded by a row, whatever their number."""
    for n, doc in iter_jsonl(path, "--prompts"):
        yield Row(n, _turns(doc, f"{path}:{n}"))


def count_prompts(path: str) -> int:
    """The rows of a prompts file, each checked as read_prompts checks it, none kept: what the controller
    runs before it uploads one (a million rows in bounded memory)."""
    return sum(1 for _ in iter_prompts(path))


def _turns(doc, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(doc, dict):
        raise UsageError(f"{where}: each row must be a JSON object")
    turns: list[tuple[Any, Any]]        # (role, content) as the JSON has them: checked below
    if isinstance(doc.get("prompt"), str):
        turns = [("user", doc["prompt"])]
    elif isinstance(doc.get("messages"), list):
        turns = [(m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None) for m in doc["messages"]]
    elif isinstance(doc.get("conversations"), list):
        turns = [(ROLES.get(str(m.get("from", "")).lower()), m.get("value")) if isinstance(m, dict) else (None, None)
                 for m in doc["conversations"]]
    else:
        raise UsageError(f"{where}: a row needs 'prompt', 'messages' or 'conversations'")
    for role, content in turns:
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            raise UsageError(f"{where}: each turn needs a role (system/user/assistant, or ShareGPT's "
                             "human/gpt) and a string content")
    kept = tuple((r, c) for r, c in turns if r != "assistant")
    if not any(r == "user" for r, _ in kept):
        raise UsageError(f"{where}: no user turn to answer")
    for role, content in kept:
        if role == "user" and not content:
            raise UsageError(f"{where}: an empty user turn: nothing to answer")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as e:   # JSON's "\ud800": a lone surrogate no tokenizer takes
            raise UsageError(f"{where}: text that cannot be encoded as UTF-8 ({e.reason}: "
                             f"{content[e.start:e.end]!r} at character {e.start})") from None
    size = sum(len(c) for _, c in kept)
    if size > MAX_PROMPT_CHARS:
        raise UsageError(f"{where}: {size:,} characters, more than any target's context takes "
                         f"(at most {MAX_PROMPT_CHARS:,} a row)")
    return kept


def resume_point(out: Path, batch_size: int, total: int) -> int:
    """Rows already complete in `out` (whole batches, or all `total`), after cutting off a torn tail."""
    if not out.exists():
        return 0
    data = out.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]  # whole lines only
    lines = keep.count(b"\n")
    whole = lines if lines >= total else lines - lines % batch_size
    cut = 0
    for _ in range(whole):
        cut = keep.index(b"\n", cut) + 1
    if cut != len(data):
        with out.open("r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
    return whole


def _render(tokenizer, messages, thinking: bool) -> list[int]:
    """A conversation's prompt with the generation prompt, rendered as the trainer renders chat rows."""
    from trainer.run import data

    return data._render(tokenizer, messages, True, {} if thinking else {"enable_thinking": False})


def _prompt(tokenizer, conv: list[dict], thinking: bool, room: int | None) -> list[int] | str:
    """A conversation's rendered prompt, or why it cannot be answered: what the pre-check cannot
    see (a tokenizer's own refusal, a prompt of no tokens, one longer than the context leaves)."""
    try:
        ids = _render(tokenizer, conv, thinking)
    except Exception as e:  # noqa: BLE001 - a tokenizer's refusal of one row skips that row, not the run
        first = (str(e).splitlines() or [""])[0][:200]
        return f"the chat template or tokenizer refused it ({type(e).__name__}: {first})"
    if not ids:
        return "its prompt renders to no tokens"
    if room is not None and len(ids) > room:
        return f"its prompt is {len(ids)} tokens; the target's context leaves {room} beside --max-new-tokens"
    return ids


def answer_batch(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                 eos: list[int], pad_id: int) -> list[tuple[str, int]]:
    """One generate call over rendered prompts (each ends with a user turn): (answer text, tokens)."""
    import torch

    width = max(map(len, prompts))
    dev = model.device
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every row's last prompt token at the same column
        ids[i, width - len(p):] = torch.tensor(p)
        att[i, width - len(p):] = 1
    kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    out = model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), max_new_tokens=max_new_tokens,
                         eos_token_id=eos, pad_token_id=pad_id, **kw)
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        answers.append((tokenizer.decode(row[:cut], skip_special_tokens=True), cut))
    return answers


def regen_batch(model, tokenizer, rows: list[Row], *, thinking: bool, max_new_tokens: int,
                context: int | None = None, **kw) -> tuple[list[dict], int]:
    """Answer every user turn of `rows`, turn by turn -> (output rows, tokens generated). A row that
    cannot be answered (`_prompt`) is written as {"line": N, "skipped": why}: still one line per
    input row, so a resume's count of whole batches holds; the trainer's reader passes over it."""
    convs: list[list[dict]] = [[] for _ in rows]
    pending = [list(r.turns) for r in rows]
    skipped: dict[int, str] = {}
    room = None if context is None else context - max_new_tokens
    tokens = 0
    while any(pending):
        ask, prompts = [], []
        for i, turns in enumerate(pending):
            while turns and turns[0][0] != "user":  # system turns go in as they come
                role, content = turns.pop(0)
                convs[i].append({"role": role, "content": content})
            if turns:
                role, content = turns.pop(0)
                convs[i].append({"role": role, "content": content})
                ids = _prompt(tokenizer, convs[i], thinking, room)
                if isinstance(ids, str):
                    skipped[i] = ids
                    turns.clear()
                    continue
                ask.append(i)
                prompts.append(ids)
        if not ask:
            break
        for i, (text, n) in zip(ask, answer_batch(model, tokenizer, prompts, max_new_tokens=max_new_tokens, **kw)):
            convs[i].append({"role": "assistant", "content": text})
            tokens += n
    return [{"line": r.line, "skipped": skipped[i]} if i in skipped else {"line": r.line, "messages": c}
            for i, (r, c) in enumerate(zip(rows, convs))], tokens


def no_room_counts(rows: list[dict], tokenizer, *, block_size: int, seq_len: int) -> dict:
    """How many of these answered rows the trainer will skip at block_size and seq_len, by reason
    (data.no_room: "prompt", "answer"), rendered as the trainer renders them by default."""
    from trainer.run.config import TrainConfig, template_kwargs
    from trainer.run.data import encode_rows, no_room

    counts = {"prompt": 0, "answer": 0}
    for _, sample in encode_rows([(r["line"], r) for r in rows], tokenizer, "regen",
                                 template_kwargs=template_kwargs(TrainConfig().chat_template_kwargs)):
        why = no_room(sample, block_size, seq_len)
        if why:
            counts[why] += 1
    return counts


def no_room_line(doc: dict) -> str | None:
    """The line that says, where the rows are made, which the trainer will skip and what to change."""
    room = doc.get("no_room") or {}
    short, long_ = room.get("answer", 0), room.get("prompt", 0)
    if not short and not long_:
        return None
    b, n = room["block_size"], room["seq_len"]
    why = [f"{long_} leave fewer than {b} tokens of --seq-len {n} for the answer (train with a larger "
           f"--seq-len, or give shorter prompts)" if long_ else "",
           f"{short} answers are shorter than a block (raise --max-new-tokens; an answer that ended at "
           f"end-of-text stays short)" if short else ""]
    return (f"regen: the trainer will skip {short + long_} of the {doc['written']} rows answered now at "
            f"--block-size {b} --seq-len {n} (no room for a block in the loss mask): "
            + "; ".join(w for w in why if w))


def regen(target_spec: str, prompts: str, out: str, *, max_new_tokens: int = 512, batch_size: int = 16,
          temperature: float = 0.0, thinking: bool = False, gpus: int = 0, resume: bool = True,
          seed: int = 0, block_size: int = 16, seq_len: int = 3072, log=print) -> dict:
    import threading

    rows = read_prompts(prompts)        # bad rows refused before torch loads (seconds)

    import torch

    from trainer.run.target import load_target

    out_path = Path(out)
    with output_lock(out_path, "--out", log=log):  # one writer: two would double rows
        if out_path.exists() and not resume:
            raise UsageError(f"--out {out}: exists (resume is the default; remove it to start over)")
        done = min(resume_point(out_path, batch_size, len(rows)), len(rows))
        batches = [rows[i: i + batch_size] for i in range(0, len(rows), batch_size)]
        todo = list(range(done // batch_size, len(batches)))
        if done:
            log(f"regen: resuming after {done} of {len(rows)} rows already in {out}")
        n_workers = max(1, min(gpus, torch.cuda.device_count())) if gpus > 0 else 1
        devices = [torch.device(f"cuda:{i}") for i in range(n_workers)] if gpus > 0 and torch.cuda.is_available() \
            else [torch.device("cpu")]
        log(f"regen: {len(rows) - done} of {len(rows)} rows to answer, batches of {batch_size}, "
            f"{len(devices)} worker(s): {', '.join(map(str, devices))}")
        results: dict[int, tuple[list[dict], int, dict] | BaseException] = {}    # (rows, tokens, room)
        ready = threading.Condition()

        def work(w: int, dev: torch.device) -> None:
            try:
                dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
                target = load_target(target_spec, device=dev, dtype=dtype)
                if target.tokenizer is None or not getattr(target.tokenizer, "chat_template", None):
                    raise UsageError(f"--target {target_spec}: regen needs the target's tokenizer with a chat template")
                tok = target.tokenizer
                eos = sorted(target.eos_ids())
                pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
                context = getattr(target.config, "max_position_embeddings", None)
                if context is not None and max_new_tokens >= context:
                    raise UsageError(f"--max-new-tokens {max_new_tokens}: the target's context is {context} "
                                     "tokens, prompt and answer together")
                for k in todo[w::len(devices)]:
                    if stop.is_set():
                        return
                    faults.hit("regen_batch", index=k)
                    torch.manual_seed(seed * 1_000_003 + k)  # the same draws for batch k on any resume
                    out_rows, n_tok = regen_batch(target.model, tok, batches[k], max_new_tokens=max_new_tokens,
                                                  temperature=temperature, thinking=thinking, eos=eos, pad_id=pad,
                                                  context=context)
                    room = no_room_counts([r for r in out_rows if "messages" in r], tok, block_size=block_size,
                                          seq_len=seq_len)
                    with ready:
                        results[k] = (out_rows, n_tok, room)
                        ready.notify_all()
            except BaseException as e:  # noqa: BLE001 - handed to the writer, which raises it
                with ready:
                    for k in todo[w::len(devices)]:
                        results.setdefault(k, e)
                    ready.notify_all()

        stop = threading.Event()
        threads = [threading.Thread(target=work, args=(w, d), daemon=True) for w, d in enumerate(devices)]
        for t in threads:
            t.start()
        try:
            doc = _write_in_order(out_path, todo, results, ready, len(rows), done, log)
            doc["no_room"] = {**doc["no_room"], "block_size": block_size, "seq_len": seq_len}
            return doc
        finally:
            stop.set()
            # The workers end before the interpreter does: a thread still unwinding torch state
            # while Python finalizes aborts the process ("terminate called without an active exception").
            for t in threads:
                t.join()


def _write_in_order(out_path: Path, todo: list[int], results: dict, ready, total: int, done: int, log,
                    every: float = PROGRESS_S) -> dict:
    """Append batch k's rows as soon as k and every batch before it are answered; fsync each.
    Progress is logged after the last batch and at least every `every` seconds while waiting."""
    progress = _Progress(total, done, log, every)
    room = {"prompt": 0, "answer": 0}
    with out_path.open("ab") as f:
        for k in todo:
            with ready:
                while not ready.wait_for(lambda: k in results, timeout=progress.due()):
                    progress.say()
                res = results.pop(k)
            if isinstance(res, BaseException):
                raise res
            out_rows, n_tok, skipped = res
            for why, n in skipped.items():
                room[why] += n
            for r in out_rows:
                if "skipped" in r:
                    progress.skipped += 1
                    log(f"regen: warning: input line {r['line']} skipped: {r['skipped']}")
            f.write(b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in out_rows))
            f.flush()
            os.fsync(f.fileno())
            progress.add(len(out_rows), n_tok, last=k == todo[-1])
    return {"event": "done", "rows": total, "resumed_at": done, "written": progress.rows, "skipped": progress.skipped,
            "tokens": progress.tokens, "seconds": time.time() - progress.t0, "out": str(out_path),
            "no_room": room}


class _Progress:
    """The progress line: rows done of all, rows/s and tokens/s since this run started, ETA."""

    def __init__(self, total: int, done: int, log, every: float):
        self.total, self.done, self.log, self.every = total, done, log, every
        self.t0 = self.last = time.time()
        self.rows = self.tokens = self.skipped = 0

    def due(self) -> float:
        """Seconds until the next line is due."""
        return max(0.0, self.last + self.every - time.time())

    def add(self, rows: int, tokens: int, last: bool) -> None:
        self.rows += rows
        self.tokens += tokens
        if last or not self.due():
            self.say()

    def say(self) -> None:
        self.last = now = time.time()
        elapsed = max(now - self.t0, 1e-9)
        rate = self.rows / elapsed
        left = self.total - self.done - self.rows
        eta = f"{left / rate:.0f}s" if rate > 0 else "unknown"
        self.log(f"regen: {self.done + self.rows}/{self.total} rows, {rate:.2f} rows/s, "
                 f"{self.tokens / elapsed:.0f} tokens/s, eta {eta}")


def main(argv: list[str] | None = None) -> int:
    passive_waits()     # before torch loads OpenMP: this module's imports do not load it, main's do
    from trainer.run.config import TrainConfig
    from trainer.run.flags import OneLineParser

    p = OneLineParser(prog="python -m trainer.regen",
                      description="Answer prompts with the target itself: training rows in the DFlash recipe's way.")
    p.add_argument("--target", required=True, help="the target: an HF folder, small-code or small-code-gpu")
    p.add_argument("--prompts", required=True, help="JSONL of chat rows (messages / ShareGPT conversations) or prompts")
    p.add_argument("--out", required=True, help="the chat-row JSONL to write (resumed when it exists)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--thinking", action="store_true", help="let the template think (enable_thinking on)")
    p.add_argument("--gpus", type=int, default=0, help="workers, one per GPU (0 = CPU)")
    p.add_argument("--seed", type=int, default=0, help="for --temperature > 0")
    p.add_argument("--no-resume", action="store_true", help="refuse an existing --out instead of resuming it")
    train = TrainConfig()
    p.add_argument("--block-size", type=int, default=train.block_size,
                   help="the training run's --block-size: rows without room for a block are counted "
                        "(default %(default)s)")
    p.add_argument("--seq-len", type=int, default=train.seq_len,
                   help="the training run's --seq-len, for the same count (default %(default)s)")
    a = p.parse_args(argv)
    if a.block_size < 2 or a.seq_len < a.block_size:
        raise UsageError(f"--block-size must be >= 2 and --seq-len >= it (got {a.block_size}, {a.seq_len})")
    for name in ("max_new_tokens", "batch_size"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if a.temperature < 0:
        raise UsageError("--temperature must be 0 (greedy) or more")
    if a.gpus == 0:
        from trainer import cores

        print(f"regen: {cores.threads_from_free_cores()}", file=sys.stderr, flush=True)
    doc = regen(a.target, a.prompts, a.out, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size,
                temperature=a.temperature, thinking=a.thinking, gpus=a.gpus, resume=not a.no_resume, seed=a.seed,
                block_size=a.block_size, seq_len=a.seq_len, log=lambda s: print(s, file=sys.stderr, flush=True))
    if no_room_line(doc):
        print(no_room_line(doc), file=sys.stderr, flush=True)
    if doc["skipped"]:
        print(f"regen: warning: {doc['skipped']} rows skipped (lines above); their lines in {doc['out']} say why",
              file=sys.stderr, flush=True)
    print(f"regen: done: {doc['rows']} rows in {doc['out']}; train on them with `--data {doc['out']}`",
          file=sys.stderr, flush=True)
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    from trainer.exits import exit_process, run
    exit_process(run(main))
