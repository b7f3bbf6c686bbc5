"""Prompts files that are not what regen reads (reliability round 5): empty lines, lone surrogates, a 10 MB
prompt, bytes that are not UTF-8, NUL bytes, a line without end, a million tiny rows. The controller checks
the file before anything connects (`dflash-ops regen`, trainer/controller_view.py count_prompts) and
`python -m trainer.regen` reads it with the same reader (trainer/regen.py read_prompts) before torch
loads: a bad file is one line naming FILE:LINE (or the option), exit 2, in bounded time and memory; a
good one of a million rows is counted in the memory of one row."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_quick import CLI_MAIN

from trainer.run import jsonl
from trainer import regen

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


@pytest.fixture
def inv(tmp_path) -> Path:
    """A target nothing listens for (port 1): a command that connected would fail saying so."""
    path = tmp_path / "hosts.yaml"
    path.write_text("hosts:\n  node:\n    address: 127.0.0.1\n    port: 1\n    user: root\n    connect_timeout: 1\n"
                    "targets:\n  ct200:\n    host: node\n    vmid: 200\n    workdir: /srv/ct/dflash\n")
    return path


def controller_regen(inv: Path, prompts: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", str(inv), "regen", "ct200", "--prompts", str(prompts),
                           "--model", "/models/unused", "--gpus", "0"], capture_output=True, text=True, timeout=120)


def trainer_regen(prompts: Path, out: Path) -> subprocess.CompletedProcess:
    # --gpus 1: no CPU threads line first; the prompts are refused before torch loads or a GPU is looked for
    return subprocess.run([sys.executable, "-m", "trainer.regen", "--target", "/models/unused",
                           "--prompts", str(prompts), "--out", str(out), "--gpus", "1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def row(text: str) -> bytes:
    return json.dumps({"prompt": text}).encode() + b"\n"


# (file bytes, what the one line says after `FILE:`; `{p}` is the file's path)
BAD = {
    "only-empty-lines": (b"\n  \n\r\n\t\n", "--prompts {p}: no rows"),
    "empty-lines-counted": (row("a") + b"\n\n" + row(""), "{p}:4: an empty user turn: nothing to answer"),
    "lone-surrogate-escaped": (row("a") + b'{"messages": [{"role": "user", "content": "x\\udc80"}]}\n',
                               "{p}:2: text that cannot be encoded as UTF-8 (surrogates not allowed: '\\udc80' at "
                               "character 1)"),
    "surrogate-as-bytes": (row("a") + b'{"prompt": "x\xed\xa0\x80"}\n',      # CESU-8: no UTF-8 decoder takes it
                           "{p}:2: not UTF-8 text (byte 0xed at column 14); save the file as UTF-8"),
    "latin-1": (row("a") + b'{"prompt": "caf\xe9"}\n', "{p}:2: not UTF-8 text (byte 0xe9 at column 16)"),
    "nul-in-a-string": (row("a") + b'{"prompt": "a\x00b"}\n', "{p}:2: not JSON: a NUL byte at column 14"),
    "nul-after-a-row": (row("a") + b'{"prompt": "a"}\x00\n', "{p}:2: not JSON: a NUL byte at column 16"),
    "ten-mb-prompt": (row("a") + row("x" * 10_000_000),
                      "{p}:2: 10,000,000 characters, more than any target's context takes (at most 1,000,000 a row)"),
    "cut-short": (row("a") + b'{"prompt": \n', "{p}:2: not JSON: Expecting value at column 12"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_prompts_file_is_one_line_exit_2_at_the_controller_and_in_the_trainer(inv, tmp_path, name):
    data, said = BAD[name]
    p = tmp_path / "p.jsonl"
    p.write_bytes(data)
    want = said.format(p=p)
    r = controller_regen(inv, p)
    assert (r.returncode, r.stdout) == (2, ""), (r.returncode, r.stderr)
    assert r.stderr.splitlines() == [r.stderr.splitlines()[0]] and want in r.stderr, r.stderr
    assert r.stderr.startswith("dflash-ops: ") and "cannot connect" not in r.stderr
    if name in ("only-empty-lines", "surrogate-as-bytes", "nul-in-a-string", "ten-mb-prompt"):   # the same reader
        t = trainer_regen(p, tmp_path / "out.jsonl")
        assert (t.returncode, t.stderr.splitlines()) == (2, [f"trainer: error: {want}"]), t.stderr
        assert not (tmp_path / "out.jsonl").exists()


# The controller, which writes at its exit what it read in all (/proc/self/io: rchar, any file or pipe).
COUNTED = ("import atexit, os\n"
           "atexit.register(lambda: open(os.environ['DFLASH_TEST_IO'], 'w').write(open('/proc/self/io').read()))\n"
           + CLI_MAIN)


def test_a_line_without_end_is_refused_after_its_first_64_mib(inv, tmp_path):
    """A sparse file of 1 GiB of NUL bytes, no newline (a disk image named .jsonl): refused once a line passes
    64 MiB, not read whole: what the controller read in all, its own modules included, is a fraction of it."""
    p = tmp_path / "image.jsonl"
    with p.open("wb") as f:
        f.truncate(1 << 30)
    io = tmp_path / "io"
    r = subprocess.run([sys.executable, "-c", COUNTED, "-i", str(inv), "regen", "ct200", "--prompts", str(p),
                        "--model", "/models/unused", "--gpus", "0"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "DFLASH_TEST_IO": str(io)})
    assert r.returncode == 2 and r.stderr.strip() == f"dflash-ops: {p}:1: a line of more than 64 MiB", r.stderr
    read = int(dict(line.split(": ") for line in io.read_text().splitlines())["rchar"])
    assert 64 * MIB < read < 256 * MIB, read        # the line's first 64 MiB (and a little), not 1 GiB
    with pytest.raises(regen.UsageError, match=r":1: a line of more than 64 MiB"):
        regen.count_prompts(str(p))


def test_a_row_just_under_the_line_bound_is_read(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_bytes(row("x" * 100) + json.dumps({"prompt": "y", "pad": "z" * (jsonl.MAX_LINE_BYTES - 40)}).encode()
                  + b"\n")
    assert regen.count_prompts(str(p)) == 2


# VmHWM: this program's own peak (getrusage's ru_maxrss keeps the peak of the process before its exec: pytest's)
MEASURE = """
import sys
from trainer.controller_view import UsageError, count_prompts
try:
    print(count_prompts(sys.argv[1]))
except UsageError as e:
    print(e)
peak = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(peak)
"""


@pytest.mark.slow      # a million rows written and read: `make test`, not the quick room
def test_a_million_tiny_rows_are_counted_in_bounded_memory_and_a_bad_last_one_named(inv, tmp_path):
    """24 MB of rows: the controller's check once kept every row (hundreds of MB; docs/benchmarks.md);
    streamed, it holds one. The last row bad: named by its line, the million before it read, not kept."""
    p = tmp_path / "million.jsonl"
    with p.open("wb") as f:
        for start in range(0, 1_000_000, 10_000):
            f.write(b"".join(b'{"prompt": "hi %d"}\n' % i for i in range(start, start + 10_000)))
    # timeout: a hang guard, not a timing (a reader that went back over the rows would take minutes)
    r = subprocess.run([sys.executable, "-c", MEASURE, str(p)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    count, peak_kib = r.stdout.splitlines()
    assert int(count) == 1_000_000
    assert int(peak_kib) < 120 * 1024, peak_kib      # the interpreter and the reader (~35 MB), not the rows
    with p.open("ab") as f:
        f.write(b'{"prompt": ""}\n')
    r = controller_regen(inv, p)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"dflash-ops: {p}:1000001: an empty user turn: nothing to answer"), r.stderr


def test_the_trainers_data_reader_is_the_same_reader(tmp_path):
    """`--data` (chat rows) is read by the same jsonl reader (trainer/run/data.py read_rows): the same refusals."""
    p = tmp_path / "data.jsonl"
    for data, said in [(b"\n\n", f"--data {p}: no rows"), (b'{"messages": []}\n{"a": "\x00"}\n',
                                                             f"{p}:2: not JSON: a NUL byte at column 8"),
                       (b'{"a": "\xff"}\n', f"{p}:1: not UTF-8 text (byte 0xff at column 8)")]:
        p.write_bytes(data)
        with pytest.raises(jsonl.UsageError) as e:
            jsonl.read_jsonl(str(p), "--data")
        assert str(e.value).startswith(said), str(e.value)
