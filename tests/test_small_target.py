"""The small real target, regen and specdec on a CPU, at the `smoke` size (seconds).

What is checked here is what a CPU can check: the target is built deterministically, cached and
atomically, from a module list whose held-out part never reaches training; regen's answers are
the target's own greedy `generate` through its chat template, row for row, and a regen killed
halfway and resumed writes the same file as one that ran through; the drafter's KV-cached
decoding computes what its full forward computes, and speculative decoding is lossless (and a
loop that changes a token is caught). The figures (tau, speedup) are for the real sizes:
scripts/small_target_check.sh, docs/fidelity.md.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from trainer import files  # noqa: E402
from trainer import regen, specdec  # noqa: E402
from trainer.run import small_target as small_lm  # noqa: E402
from trainer.run.acceptance import DraftCache, draft_block, extend_context, interval95  # noqa: E402
from trainer.run.target import load_target  # noqa: E402
from trainer.errors import UsageError  # noqa: E402
from trainer.model.drafter import Drafter  # noqa: E402
from trainer.model import masks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cache(smoke_target):
    """The session's smoke build (conftest.py), its cache folder this module's DFLASH_OPS_CACHE."""
    root, folder = smoke_target
    old = os.environ.get("DFLASH_OPS_CACHE")
    os.environ["DFLASH_OPS_CACHE"] = str(root)
    torch.set_num_threads(1)
    yield root, folder
    if old is None:
        os.environ.pop("DFLASH_OPS_CACHE", None)
    else:
        os.environ["DFLASH_OPS_CACHE"] = old


@pytest.fixture(scope="module")
def target(cache):
    return load_target("small-code-smoke", device=CPU, dtype=torch.float32)


def test_held_out_modules_never_reach_training():
    recipe = small_lm.RECIPES["smoke"]
    names = [p.name for p in small_lm.stdlib_modules()]
    assert names and len(names) == len(set(map(str, small_lm.stdlib_modules())))
    train, held, _ = small_lm.corpus(recipe)
    assert held and train and not set(train) & set(held)
    rels = [str(p) for p in small_lm.stdlib_modules()]
    assert sum(small_lm.held_out(r) for r in rels) < len(rels) / 10  # about one in twenty


def _stdlib(root: Path) -> dict[str, str]:
    """A standard library of 6 training modules and 2 held-out ones: `copied.py` repeats a training
    module's lines verbatim (re-indented, as a generated module would), `own.py` is text of its own."""
    def lines(tag, n=40):
        return "".join(f"value_{tag}_{i} = {i} * {i}\n" + ("\n" if i % 5 == 4 else "") for i in range(n))

    names = iter(f"m{i}.py" for i in range(10_000))
    held = [next(n for n in names if small_lm.held_out(n)) for _ in range(2)]
    train = [next(n for n in names if not small_lm.held_out(n)) for _ in range(6)]
    texts = {name: lines(f"t{k}") for k, name in enumerate(train)}
    texts[held[0]] = "".join("  " + line for line in texts[train[2]].splitlines(keepends=True))  # copied
    texts[held[1]] = lines("own")
    for name, text in texts.items():
        (root / name).write_text(text)
    return {"copied": held[0], "own": held[1]}


def test_held_out_prompts_whose_text_was_trained_on_are_dropped(tmp_path):
    names = _stdlib(tmp_path)
    out = tmp_path / "held.jsonl"
    got = small_lm.write_prompts("smoke", "held-out", 12, str(out), seed=1, root=str(tmp_path))
    prompts = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert got["prompts"] == len(prompts) == 12 and got["dropped"] > 0  # more drawn from `own.py`
    own = (tmp_path / names["own"]).read_text()
    assert all(p in own for p in prompts)
    train, held, _ = small_lm.corpus(small_lm.RECIPES["smoke"], str(tmp_path))
    assert any(map(small_lm.seen_in(train), small_lm.cut_prompts(held, 12, seed=1 + 7919)))  # the draw undeduplicated


def test_seen_in_needs_three_consecutive_lines_whatever_the_whitespace():
    seen = small_lm.seen_in(["a = 1\nb = 2\n\nc = 3\nd = 4\n"])
    assert seen("x\n  a  =  1\n\n\tb = 2\nc   = 3\n")  # blank lines and spacing do not hide a copy
    assert not seen("a = 1\nb = 2\nd = 4\n")  # the lines are there, not consecutively
    assert not seen("a = 1\nb = 2\n")  # fewer lines than a window


def test_the_held_out_cli_says_what_it_dropped_and_another_seed_draws_another_sample(tmp_path, monkeypatch, capsys):
    _stdlib(tmp_path)
    monkeypatch.setattr(small_lm.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    files = []
    for seed in (1, 1, 2):
        files.append(tmp_path / f"p{len(files)}.jsonl")
        assert small_lm.main(["--size", "smoke", "--prompts", "held-out", "--n", "5", "--seed", str(seed),
                              "--out", str(files[-1])]) == 0
        err = capsys.readouterr().err
        assert re.search(r"dropped [1-9]\d* held-out prompts .* 5 remain", err), err
    a, b, c = (f.read_text() for f in files)
    assert a == b and a != c


def test_the_target_is_an_hf_folder_built_once(cache, target):
    root, folder = cache
    report = json.loads((folder / "small_lm.json").read_text())
    assert report["recipe"]["name"] == "smoke" and report["held_out_loss"] > 0
    assert target.tokenizer.mask_token == small_lm.MASK and target.mask_token_id() == target.tokenizer.mask_token_id
    assert target.tokenizer.chat_template == small_lm.CHAT_TEMPLATE
    assert target.eos_ids() == {target.tokenizer.convert_tokens_to_ids(small_lm.EOT)}
    assert small_lm.ensure("smoke", log=lambda s: pytest.fail(s)) == folder  # cached: no rebuild (a build logs)
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-") and p.is_dir()]  # no temp left


def test_the_build_is_deterministic(cache, tmp_path):
    _, folder = cache
    small_lm.build("smoke", str(tmp_path / "again"), log=lambda s: None)
    from safetensors.torch import load_file

    a, b = load_file(str(folder / "model.safetensors")), load_file(str(tmp_path / "again" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (folder / "tokenizer.json").read_text() == (tmp_path / "again" / "tokenizer.json").read_text()
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "again").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o666 & ~files.umask(), modes   # not 0600


def test_a_second_build_into_the_same_folder_keeps_it(cache, tmp_path, capsys):
    _, folder = cache
    out = tmp_path / "dir"
    shutil.copytree(folder, out)       # what `--size smoke --out DIR` wrote the first time
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert small_lm.main(["--size", "smoke", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["kept"] is True and "kept: " in captured.err
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    assert small_lm.built("smoke", out) and not small_lm.built("cpu", out)   # another recipe: built again
    assert small_lm.built("smoke", tmp_path / "none") is None


def _prompts(path: Path, n: int, *, chat: bool = False) -> Path:
    train, _, _ = small_lm.corpus(small_lm.RECIPES["smoke"])
    rows = small_lm.cut_prompts(train, n, seed=5, lines=4)
    with path.open("w") as f:
        for i, p in enumerate(rows):
            if chat and i % 2:  # multi-turn chat rows (the old answers dropped) and ShareGPT rows
                f.write(json.dumps({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "x"},
                                                 {"role": "user", "content": "\n"}]}) + "\n")
            elif chat:
                f.write(json.dumps({"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "y"}]})
                        + "\n")
            else:
                f.write(json.dumps({"prompt": p}) + "\n")
    return path


def _greedy(target, messages, n):
    ids = regen._render(target.tokenizer, messages, False)
    out = target.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                eos_token_id=sorted(target.eos_ids()), pad_token_id=target.tokenizer.pad_token_id)
    new = out[0, len(ids):].tolist()
    cut = next((i for i, t in enumerate(new) if t in target.eos_ids()), len(new))
    return target.tokenizer.decode(new[:cut], skip_special_tokens=True)


def test_regen_answers_are_the_targets_greedy_generate(cache, target, tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl", 6, chat=True)
    doc = regen.regen("small-code-smoke", str(prompts), str(tmp_path / "out.jsonl"), max_new_tokens=12,
                      batch_size=4, log=lambda s: None)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert doc["written"] == len(rows) == 6 and [r["line"] for r in rows] == list(range(1, 7))
    for r in rows:
        msgs = r["messages"]
        assert [m["role"] for m in msgs] in (["user", "assistant"], ["user", "assistant"] * 2)
        assert msgs[1]["content"] not in ("x", "y")  # the file's own answers were dropped
        for i in range(1, len(msgs), 2):  # each answer, given the target's earlier answers
            assert msgs[i]["content"] == _greedy(target, msgs[:i], 12)


def test_a_bad_row_is_named_by_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "assistant", "content": "b"}]}\n')
    with pytest.raises(UsageError, match=r"bad.jsonl:3: no user turn"):
        regen.read_prompts(str(p))


@pytest.mark.parametrize("row, needle", [
    ({"prompt": ""}, "an empty user turn: nothing to answer"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": ""}]}, "an empty user turn"),
    ({"prompt": "a\ud800b"}, "text that cannot be encoded as UTF-8 (surrogates not allowed: '\\ud800' at character 1)"),
    ({"prompt": "x" * (regen.MAX_PROMPT_CHARS + 1)}, "1,000,001 characters, more than any target's context takes"),
])
def test_rows_no_tokenizer_or_context_takes_are_refused_by_file_and_line(tmp_path, row, needle):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(UsageError) as e:
        regen.read_prompts(str(p))
    assert str(e.value).startswith(f"{p}:2: ") and needle in str(e.value), str(e.value)


def test_a_row_the_tokenizer_refuses_is_skipped_not_fatal(target, monkeypatch):
    render = regen._render

    def refusing(tokenizer, messages, thinking):
        if messages[-1]["content"] == "boom":
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
        return render(tokenizer, messages, thinking)

    monkeypatch.setattr(regen, "_render", refusing)
    rows = [regen.Row(1, (("user", "def f():\n"),)), regen.Row(2, (("user", "boom"),))]
    out, _ = regen.regen_batch(target.model, target.tokenizer, rows, thinking=False, max_new_tokens=4, temperature=0,
                               eos=sorted(target.eos_ids()), pad_id=target.tokenizer.pad_token_id, context=4096)
    assert out[0]["messages"][-1]["role"] == "assistant"
    assert out[1] == {"line": 2, "skipped": "the chat template or tokenizer refused it (TypeError: TextEncodeInput "
                                            "must be Union[TextInputSequence, ...])"}


def test_a_row_longer_than_the_targets_context_is_skipped_counted_and_a_resume_completes(cache, tmp_path):
    """The small target's context is 4096 tokens: a row of ~16k tokens passes the pre-check (1 MB) and is
    skipped where the tokenizer renders it, one line in the file saying why; a regen that failed after
    its first batch resumes to the file of an uninterrupted run (that one written in this process, as
    `uninterrupted` below), saying what it skipped, and the trainer's reader passes over it."""
    from trainer.run import data

    prompts = _prompts(tmp_path / "p.jsonl", 4)
    train, _, _ = small_lm.corpus(small_lm.RECIPES["smoke"])
    lines = prompts.read_text().splitlines()
    lines[2] = json.dumps({"prompt": "".join(train)[:40_000]})
    prompts.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    whole = tmp_path / "whole.jsonl"
    said: list[str] = []
    doc = _regen_here(prompts, whole, said.append)
    assert any(line.startswith("regen: warning: input line 3 skipped: its prompt is ") for line in said), said
    assert doc["skipped"] == 1 and doc["written"] == 4
    cut = tmp_path / "cut.jsonl"
    r = subprocess.run(_regen_cmd(prompts, cut), env={**env, "DFLASH_TRAINER_FAULTS": "regen_batch=1"},
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and cut.read_bytes().count(b"\n") == 2, r.stderr
    r = subprocess.run(_regen_cmd(prompts, cut), env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    # the program says the skipped row (its line is in the resumed batch) and counts it
    assert "regen: warning: input line 3 skipped: its prompt is " in r.stderr and "1 rows skipped" in r.stderr
    doc = json.loads(r.stdout.splitlines()[-1])
    assert (doc["resumed_at"], doc["written"], doc["skipped"]) == (2, 2, 1)
    assert cut.read_bytes() == whole.read_bytes()
    row = json.loads(whole.read_text().splitlines()[2])
    assert set(row) == {"line", "skipped"}
    assert "the target's context leaves 4088 beside --max-new-tokens" in row["skipped"]
    assert [n for n, _ in data.read_rows(str(whole))] == [1, 2, 4]


def test_a_torn_tail_is_cut_back_to_whole_batches(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_bytes(b'{"line": 1}\n{"line": 2}\n{"line": 3}\n{"li')
    assert regen.resume_point(out, 2, total=10) == 2
    assert out.read_bytes() == b'{"line": 1}\n{"line": 2}\n'
    assert regen.resume_point(out, 2, total=2) == 2  # a complete file stays


def _regen_cmd(prompts: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "trainer.regen", "--target", "small-code-smoke", "--prompts", str(prompts),
            "--out", str(out), "--max-new-tokens", "8", "--batch-size", "2"]


def _regen_here(prompts: Path, out: Path, log) -> dict:
    """What `_regen_cmd` writes, by regen's own function in this process (no torch start-up of its own): one
    thread, as the programs, whose OMP_NUM_THREADS=1 regen keeps. Set here: under xdist another module's
    test may run on this worker between this module's `cache` fixture and the caller, and leave torch's
    thread count where it found it."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return regen.regen("small-code-smoke", str(prompts), str(out), max_new_tokens=8, batch_size=2, log=log)
    finally:
        torch.set_num_threads(old_threads)


@pytest.fixture(scope="module")
def uninterrupted(cache, tmp_path_factory):
    """10 prompts and what one regen that ran through wrote for them: the file the interrupted regen
    below must end with."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    prompts = _prompts(folder / "p.jsonl", 10)
    whole = folder / "whole.jsonl"
    _regen_here(prompts, whole, lambda s: None)
    return prompts, whole


def test_a_second_regen_of_the_same_out_is_refused_and_a_killed_one_is_taken_over_and_resumed(uninterrupted,
                                                                                                tmp_path):
    """A regen still writing (its wrapper gone, say) and a resume of the same --out typed by hand: the
    second is refused in one line naming the first. The first is then killed, as if in the middle of a
    write (a torn last line after its whole batches); the next takes its lock over, says so, cuts the torn
    line back to whole batches and resumes there, and the file holds the rows of one uninterrupted run."""
    prompts, whole = uninterrupted
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out.jsonl"
    first = subprocess.Popen(_regen_cmd(prompts, out), env={**env, "DFLASH_TRAINER_FAULTS": "regen_batch=1:hang"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and (not out.exists() or out.read_bytes().count(b"\n") < 2):
            time.sleep(0.02)
        r = subprocess.run(_regen_cmd(prompts, out), env=env, capture_output=True, text=True, cwd=ROOT)
        err = [line for line in r.stderr.splitlines() if "CPU thread" not in line]  # the threads it would use
        assert r.returncode == 2 and len(err) == 1, r.stderr
        assert f"another writer holds it (pid {first.pid})" in r.stderr and f"`kill {first.pid}`" in r.stderr
        assert out.read_bytes().count(b"\n") == 2           # the refused one wrote nothing
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    with out.open("ab") as f:  # as if killed in the middle of a write
        f.write(b'{"line": 99, "mess')
    done = out.read_bytes().count(b"\n")
    assert 2 <= done < 10, "the kill should land halfway"
    r = subprocess.run(_regen_cmd(prompts, out), env=env, check=True, capture_output=True, text=True, cwd=ROOT)
    assert f"its previous writer (pid {first.pid}) died holding the lock; taken over" in r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["resumed_at"] == done - done % 2
    assert out.read_bytes() == whole.read_bytes() and not (tmp_path / ".out.jsonl.lock").exists()


def _drafter(target, layers=2, block=8, seed=0):
    torch.manual_seed(seed)
    d = Drafter(target.drafter_config(num_layers=layers, block_size=block, mask_token_id=None))
    d.init_norm(target.head_weights()[1])
    d.borrow_target_head(*target.head_weights())
    with torch.no_grad():  # a random drafter with larger weights, so its guesses are not all one token
        for _, prm in d.trainable_parameters():
            if prm.dim() == 2:
                prm.normal_(0, 0.2)
    return d.eval()


def test_the_drafters_kv_cache_computes_its_full_forward(target):
    d = _drafter(target)
    ids = target.tokenizer("def f(x):\n    return x + 1\n")["input_ids"]
    _, hs, _ = target.decode(torch.tensor([ids]), hidden=True)
    feats = torch.cat([hs[i + 1] for i in target.layer_ids], dim=-1)
    p, B = len(ids), d.cfg.block_size
    cache = DraftCache(len(d.layers))
    extend_context(d, cache, feats[:, :5], 0)  # the context arrives in pieces, as in decoding
    extend_context(d, cache, feats[:, 5:], 5)
    block = torch.tensor([[ids[-1]] + [d.cfg.mask_token_id] * (B - 1)])
    full = d(block, torch.arange(p, p + B)[None], feats, torch.arange(p)[None],
             masks.attention_mask(torch.tensor([[p]]), p, B))
    ref = d.logits(full)[0, 1:]
    assert torch.equal(draft_block(d, cache, block, p), ref.argmax(-1))


@pytest.mark.parametrize("engine", ["graphs", "eager"])
def test_speculative_decoding_is_lossless_and_a_wrong_token_is_caught(target, engine, monkeypatch):
    d = _drafter(target, block=4)
    prompts = [target.tokenizer(t)["input_ids"] for t in ("import os\n", "class A:\n    def __init__(self):\n")]
    doc = specdec.measure(target, d, prompts, max_new_tokens=24, warmup=0, engine=engine, log=lambda s: None)
    assert doc["lossless"] and doc["rounds"] >= 1 and 1 <= doc["tau"] <= 4 and doc["engine"] == engine
    assert len(doc["accept_rate_by_position"]) == 3
    monkeypatch.setenv("DFLASH_TRAINER_FAULTS", "specdec_differ=1")  # the target alone's last token of prompt 1 changed
    with pytest.raises(RuntimeError, match="NOT lossless"):
        specdec.measure(target, d, prompts, max_new_tokens=24, warmup=0, engine=engine, log=lambda s: None)


def test_without_the_baseline_tau_is_the_same_and_nothing_claims_lossless(target):
    d = _drafter(target, block=4)
    prompts = [target.tokenizer(t)["input_ids"] for t in ("import os\n", "def f(x):\n")]
    both = specdec.measure(target, d, prompts, max_new_tokens=24, warmup=0, log=lambda s: None)
    alone = specdec.measure(target, d, prompts, max_new_tokens=24, warmup=0, baseline=False, log=lambda s: None)
    assert (alone["tau"], alone["rounds"], alone["tokens"]) == (both["tau"], both["rounds"], both["tokens"])
    assert alone["lossless"] is None and alone["speedup"] is None and alone["target_tokens_per_s"] is None
    json.dumps(alone, allow_nan=False)


def test_interval95():
    assert interval95([2, 2, 2]) == (2.0, 0.0)
    m, h = interval95([1, 3] * 50)
    assert m == 2.0 and 0.19 < h < 0.2
