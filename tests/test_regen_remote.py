"""`dflash-ops regen` for real: a prompts file checked here, sent with the launch into a run's
folder in a pct stand-in container behind a real sshd on 127.0.0.1, answered there by the small
real target (`smoke` size, CPU) as a detached run that `logs --follow` and `status` see like a
training run; its rows are those of trainer.regen run directly on the same input."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from trainer_quick import CLI_MAIN, copy_trainer, wait_for

from orchestrator import inventory
from orchestrator.deploy import sync as deploy

REPO = Path(__file__).resolve().parent.parent
WORKDIR = "/srv/ct/dflash"
ROWS = [  # the three spellings trainer.regen reads, a blank line (line numbers are kept), multi-turn
    {"prompt": "def add(a, b):\n"},
    {"messages": [{"role": "user", "content": "import os\n"}, {"role": "assistant", "content": "old"}]},
    None,
    {"conversations": [{"from": "human", "value": "class Point:\n"}, {"from": "gpt", "value": "old"}]},
    {"messages": [{"role": "system", "content": "#"}, {"role": "user", "content": "for i in range(3):\n"},
                  {"role": "assistant", "content": "old"}, {"role": "user", "content": "\n"}]},
    {"prompt": "while True:\n"},
    {"prompt": "x = [1, 2, 3]\n"},
]
ANSWER = ["--max-new-tokens", "6", "--batch-size", "2"]


@pytest.fixture(scope="module")
def model(smoke_target):
    """The small real target at its smoke size: the session's build (conftest.py)."""
    return str(smoke_target[1])


@pytest.fixture(scope="module")
def direct(model, tmp_path_factory):
    """The prompts answered here, directly by trainer.regen's own function in this process, on one
    torch thread as the runs below (OMP_NUM_THREADS=1): (prompts file, rows file)."""
    import torch

    from trainer import regen

    folder = tmp_path_factory.mktemp("direct")
    prompts, out = _write_prompts(folder / "prompts.jsonl"), folder / "direct.jsonl"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        regen.regen(model, str(prompts), str(out), max_new_tokens=6, batch_size=2, log=lambda s: None)
    finally:
        torch.set_num_threads(threads)
    return prompts, out


@pytest.fixture
def ct(sshd, fakepct, make_inventory, tmp_path):
    """CT 200 (2 GPUs in the inventory, CPU in fact) with the trainer deployed."""
    src = copy_trainer(tmp_path / "src")
    fakepct.create(200)
    path = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable,
                                     "workdir": WORKDIR, "gpus": 2}})
    inv = inventory.load(str(path))
    assert deploy.deploy(inv, ["ct200"], source=str(src))["ct200"].ok

    def cli(*args, timeout=180):
        return subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", str(path), *map(str, args)],
                              capture_output=True, timeout=timeout, cwd=tmp_path)

    return type("CT", (), dict(cli=staticmethod(cli), tmp=tmp_path,
                               runs=fakepct.private(200) / "dflash" / "runs",
                               host_path=staticmethod(lambda p: fakepct.private(200) / Path(p).relative_to("/srv/ct"))))


def _write_prompts(path: Path) -> Path:
    path.write_text("".join((json.dumps(r) if r is not None else "   ") + "\n" for r in ROWS))
    return path


def test_regen_runs_detached_with_progress_and_writes_what_a_direct_regen_writes(ct, model, direct):
    prompts, direct_rows = direct
    r = ct.cli("regen", "ct200", "--prompts", prompts, "--model", model, "--gpus", "0", "--env", "OMP_NUM_THREADS=1",
               *ANSWER, "--follow", "--json")     # --follow as launch's: one document when the run ends
    assert r.returncode == 0, r.stderr.decode()
    doc = json.loads(r.stdout)
    run, out = doc["run"], doc["output"]
    assert doc["kind"] == "regen" and doc["target"] == "ct200" and doc["pid"] > 0 and doc["rows"] == 6
    assert doc["slots"] == ["cpu"] and out == f"{WORKDIR}/runs/{run}/regen.jsonl"
    assert doc["logs"]["state"] == "succeeded", doc["logs"]

    r = ct.cli("logs", "ct200", run, "--no-follow")
    log = r.stdout.decode()
    assert r.returncode == 0, (r.stderr.decode(), log)
    progress = [line for line in log.splitlines() if line.startswith("regen: 6/6 rows")]
    assert progress and all(w in progress[-1] for w in ("rows/s", "tokens/s", "eta 0s")), log
    # 6 new tokens an answer: no room for the trainer's default block of 16, said where the rows are made
    assert "regen: the trainer will skip 6 of the 6 rows answered now at --block-size 16 --seq-len 3072" in log
    assert "6 answers are shorter than a block (raise --max-new-tokens" in log
    assert log.splitlines()[-1] == (f"dflash-ops: the rows are in {out}; train on them with "
                                    f"`dflash-ops launch ct200 -- --data {out}`")
    # its end is a regen's: rows, not a trainer's steps, loss and tau
    ended = r.stderr.decode()
    assert f"ct200: regen run {run}: succeeded (exit 0); rows written 6;" in ended and "last loss" not in ended, ended
    r = ct.cli("status", "ct200", "--json")
    row = next(x for x in json.loads(r.stdout)["runs"] if x["run"] == run)
    assert row["kind"] == "regen" and row["output"] == out and row["state"] == "succeeded"

    # the prompts travelled byte for byte; the rows keep their input line numbers
    rundir = ct.runs / run
    assert (rundir / "prompts.jsonl").read_bytes() == prompts.read_bytes()
    assert not [p for p in ct.runs.iterdir() if p.name.startswith(".")]   # no upload left behind
    rows = [json.loads(line) for line in ct.host_path(out).read_text().splitlines()]
    assert [x["line"] for x in rows] == [1, 2, 4, 5, 6, 7]
    assert [m["role"] for m in rows[3]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert ct.host_path(out).read_bytes() == direct_rows.read_bytes()
    r = ct.cli("prune", "ct200", "--keep", "0", "--json")   # rows that training reads are kept; `rm` removes them
    assert r.returncode == 0 and json.loads(r.stdout)["targets"]["ct200"]["kept"] == [run], r.stdout
    assert ct.host_path(out).is_file()
    r = ct.cli("rm", "ct200", run)
    assert r.returncode == 0 and not rundir.exists(), r.stderr.decode()


def test_a_stopped_regen_resumes_where_its_file_ends_and_has_no_drafter_to_export(ct, model, direct):
    prompts, direct_rows = direct
    r = ct.cli("regen", "ct200", "--prompts", prompts, "--model", model, "--gpus", "2", "--env", "OMP_NUM_THREADS=1",
               "--env", "DFLASH_TRAINER_FAULTS=regen_batch=2:hang", *ANSWER)     # hangs before its third batch
    assert r.returncode == 0, r.stderr.decode()
    run = r.stdout.decode().strip()
    rec = json.loads((ct.runs / run / "run.json").read_text())   # --gpus reaches regen: one worker per GPU
    assert rec["slots"] == ["gpu0", "gpu1"] and rec["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert rec["command"][1:3] == ["-m", "trainer.regen"] and rec["command"][rec["command"].index("--gpus") + 1] == "2"
    out = ct.runs / run / "regen.jsonl"
    wait_for(lambda: out.exists() and out.read_bytes().count(b"\n") == 4, what="two batches written")
    r = ct.cli("stop", "ct200", run)
    assert r.returncode == 0 and b"stopped" in r.stdout, r.stderr.decode()
    r = ct.cli("logs", "ct200", run)
    remote = f"{WORKDIR}/runs/{run}/regen.jsonl"
    assert r.returncode == 103 and r.stdout.decode().splitlines()[-1] == (
        f"dflash-ops: the rows so far are in {remote}; `dflash-ops launch ct200 --resume {run}` continues from there")
    r = ct.cli("export", "ct200", run, "-o", ct.tmp / "drafter")
    assert r.returncode == 2 and b"a regen run has no drafter" in r.stderr and not (ct.tmp / "drafter").exists()

    r = ct.cli("launch", "ct200", "--resume", run, "--env", "OMP_NUM_THREADS=1")   # the fault is not set again
    assert r.returncode == 0 and f"regen into {remote}" in r.stderr.decode(), r.stderr.decode()
    r = ct.cli("logs", "ct200", run)
    assert r.returncode == 0 and b"regen: resuming after 4 of 6 rows" in r.stdout, r.stdout.decode()
    assert out.read_bytes() == direct_rows.read_bytes()


def test_a_bad_prompts_file_is_refused_before_anything_starts(ct):
    model = "/models/unused"    # never reached: the prompts are checked first
    bad = ct.tmp / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"messages": [{"role": "gpt"}]}) + "\n")
    notjson = ct.tmp / "notjson.jsonl"
    notjson.write_text('{"prompt": "ok"}\n{"prompt": \n')
    empty = ct.tmp / "empty.jsonl"
    empty.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    lone = ct.tmp / "lone.jsonl"
    lone.write_text('{"prompt": "ok"}\n\n{"prompt": "\\ud800"}\n')      # a lone surrogate, as JSON writes it
    for prompts, needle in [(ct.tmp / "missing.jsonl", f"--prompts {ct.tmp / 'missing.jsonl'}: no such file"),
                            (bad, f"{bad}:2: each turn needs a role"),
                            (notjson, f"{notjson}:2: not JSON"),
                            (empty, f"{empty}:2: an empty user turn"),
                            (lone, f"{lone}:3: text that cannot be encoded as UTF-8"),
                            (ct.tmp, f"--prompts {ct.tmp}: not a regular file (a folder)")]:
        r = ct.cli("regen", "ct200", "--prompts", prompts, "--model", model, "--gpus", "0")
        err = r.stderr.decode()
        assert r.returncode == 2 and needle in err, (prompts, r.returncode, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    r = ct.cli("regen", "ct200", "ct200", "--prompts", bad, "--model", model)
    assert r.returncode == 2
    assert not ct.runs.exists() or not list(ct.runs.iterdir())     # nothing was launched


def test_progress_is_logged_while_a_batch_takes_longer_than_the_interval(tmp_path):
    from trainer import regen

    results, ready, lines = {}, threading.Condition(), []

    def slow():     # batch 0 answers after a few intervals, batch 1 at once
        time.sleep(0.35)
        with ready:
            results[0] = ([{"line": 1, "messages": []}], 5, {"prompt": 0, "answer": 1})
            results[1] = ([{"line": 2, "messages": []}], 7, {"prompt": 1, "answer": 0})
            ready.notify_all()

    threading.Thread(target=slow, daemon=True).start()
    out = tmp_path / "out.jsonl"
    doc = regen._write_in_order(out, [0, 1], results, ready, total=2, done=0, log=lines.append, every=0.1)
    waiting = [line for line in lines if line.startswith("regen: 0/2 rows")]
    assert len(waiting) >= 2 and "eta unknown" in waiting[0], lines
    assert lines[-1].startswith("regen: 2/2 rows") and "tokens/s, eta 0s" in lines[-1]
    assert doc["written"] == 2 and doc["tokens"] == 12 and doc["event"] == "done"
    assert doc["no_room"] == {"prompt": 1, "answer": 1}
    line = regen.no_room_line({**doc, "no_room": {**doc["no_room"], "block_size": 8, "seq_len": 256}})
    assert line.startswith("regen: the trainer will skip 2 of the 2 rows answered now at --block-size 8 --seq-len 256")
    assert "1 leave fewer than 8 tokens of --seq-len 256" in line and "1 answers are shorter" in line
    assert regen.no_room_line({"no_room": {"prompt": 0, "answer": 0}}) is None
    assert out.read_text().count("\n") == 2
