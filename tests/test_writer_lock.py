"""One writer per output (trainer/writer_lock.py): a second writer of the same file is refused in
one line naming the holder; a dead holder's lock is taken over, said so; a writer that ends leaves
no lock file."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.errors import UsageError
from trainer.writer_lock import lock_path, output_lock

ROOT = Path(__file__).resolve().parents[1]


def test_a_second_writer_is_refused_naming_the_holder_and_a_finished_writer_leaves_nothing(tmp_path, monkeypatch):
    out = tmp_path / "rows.jsonl"
    monkeypatch.setenv("DFLASH_OPS_RUN", "20250101-120000-3fa9c1")
    with output_lock(out, "--out"):
        assert json.loads(lock_path(out).read_text()) == {"pid": os.getpid(), "run": "20250101-120000-3fa9c1"}
        with pytest.raises(UsageError) as e:
            with output_lock(out, "--out"):
                pass
    msg = str(e.value)
    assert "\n" not in msg and f"--out {out}: another writer holds it (pid {os.getpid()}, run 20250101-120000-3fa9c1)" \
        in msg and "`dflash-ops stop TARGET 20250101-120000-3fa9c1`" in msg
    assert not lock_path(out).exists()
    with output_lock(out, "--out"):   # free again
        pass


def test_the_lock_of_a_killed_writer_is_taken_over_and_said_so(tmp_path):
    out = tmp_path / "rows.jsonl"
    code = ("import os, sys; from trainer.writer_lock import output_lock\n"
            f"with output_lock({str(out)!r}, '--out'):\n    print('held', flush=True); os.kill(os.getpid(), 9)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -9 and r.stdout == "held\n" and lock_path(out).exists()
    dead = json.loads(lock_path(out).read_text())["pid"]
    said = []
    with output_lock(out, "--out", log=said.append):
        pass
    assert said == [f"--out {out}: its previous writer (pid {dead}) died holding the lock; taken over"]


def test_a_lock_that_cannot_be_created_is_one_line(tmp_path):
    with pytest.raises(UsageError, match=r"^--out .*/nope/x.jsonl: cannot create its lock .*: No such file"):
        with output_lock(tmp_path / "nope" / "x.jsonl", "--out"):
            pass


def test_specdec_json_has_one_writer_refused_before_it_decodes(tmp_path):
    """`python -m trainer.specdec --json FILE` (bench-decode's result) holds FILE's lock for its whole run:
    a second one is refused at once, in one line, before it loads a model (no target here could load)."""
    import contextlib
    import io

    from trainer.exits import run
    from trainer import specdec

    out = tmp_path / "specdec.json"
    err = io.StringIO()
    with output_lock(out, "--json"), contextlib.redirect_stderr(err):
        rc = run(specdec.main, ["--target", "tiny", "--drafter", str(tmp_path / "none"),
                                "--prompts", str(tmp_path / "none.jsonl"), "--json", str(out)])
    assert rc == 2 and err.getvalue().count("\n") == 1, err.getvalue()
    assert f"--json {out}: another writer holds it (pid {os.getpid()}" in err.getvalue()
    assert not out.exists()


def test_the_lock_file_under_both_locks_keeps_its_file_when_asked_and_names_a_live_holder(tmp_path):
    """trainer/lock_file.py, shared by the writer's lock and play's one player (which keeps its file:
    tests/test_play_signals.py opens it after the play): a live holder is refused with what it wrote."""
    from trainer.controller_view import LockHeld, lock_file

    lock = tmp_path / ".p.lock"
    with lock_file(lock, b'{"pid": 1}', remove=False) as previous:
        assert previous == b"" and lock.read_bytes() == b'{"pid": 1}'
        with pytest.raises(LockHeld) as e:
            with lock_file(lock, b'{"pid": 2}', remove=False):
                pass
        assert e.value.said == b'{"pid": 1}'
    assert lock.read_bytes() == b'{"pid": 1}'     # kept, and free again: the next taker is told what it said
    with lock_file(lock, b'{"pid": 3}', remove=True) as previous:
        assert previous == b'{"pid": 1}'
    assert not lock.exists()
