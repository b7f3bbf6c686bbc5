"""`dflash-ops bench-decode` for real: a 4-step run against `tiny` (its byte tokenizer has a chat template)
trained on chat rows through the tool in a pct stand-in container behind a real sshd on 127.0.0.1,
then its drafter decoding there against the target alone: on the rows the run held out, and on a
prompts file sent from here; refusals in one line with their exit codes; nothing left on the target."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from trainer_quick import CLI_MAIN, copy_trainer, tiny_run_config

from orchestrator import inventory
from orchestrator.deploy import sync as deploy

WORKDIR = "/srv/ct/dflash"
CODE = [("def add(a, b):\n", "    return a + b\n"), ("import os\n", "import sys\nimport re\n"),
        ("class Point:\n", "    def __init__(self, x, y):\n        self.x = x\n"),
        ("for i in range(3):\n", "    print(i)\n"),
        ("while True:\n", "    break\n"), ("x = [1, 2, 3]\n", "y = [a * 2 for a in x]\n"),
        ("def main():\n", "    pass\n"), ("with open(path) as f:\n", "    data = f.read()\n")]


@pytest.fixture
def ct(sshd, fakepct, make_inventory, tmp_path):
    """CT 200 with the trainer deployed and one succeeded 4-step `tiny` run on 8 chat rows, 2 held out."""
    src = copy_trainer(tmp_path / "src")
    fakepct.create(200)
    ct200 = {"host": "node", "vmid": 200, "python": sys.executable, "workdir": WORKDIR, "gpus": 0,
             "env": {"OMP_NUM_THREADS": "1"}}
    differ = {**ct200, "env": {"OMP_NUM_THREADS": "1", "DFLASH_TRAINER_FAULTS": "specdec_differ=0"}}
    path = make_inventory({"ct200": ct200, "differ": differ}, default="ct200")
    assert deploy.deploy(inventory.load(str(path)), ["ct200"], source=str(src))["ct200"].ok
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n" for q, a in CODE))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(tiny_run_config(data=data, block_size=4, eval_prompts=2, eval_new_tokens=8))

    def cli(*args, timeout=180):
        return subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", str(path), *map(str, args)],
                              capture_output=True, timeout=timeout, cwd=tmp_path)

    return type("CT", (), dict(cli=staticmethod(cli), cfg=cfg, tmp=tmp_path,
                               exports=fakepct.private(200) / "dflash" / "exports"))


def one_line(r, code: int, needle: str) -> None:
    err = r.stderr.decode()
    assert r.returncode == code and needle in err, (r.returncode, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_bench_decode_measures_a_trained_run_on_its_held_out_rows_or_a_file_and_refuses_bad_input(ct):
    one_line(ct.cli("bench-decode", "ct200", "20990101-000000-abcdef"), 102, "no run '20990101-000000-abcdef'")
    bad = ct.tmp / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"messages": [{"role": "gpt"}]}) + "\n")
    one_line(ct.cli("bench-decode", "ct200", "--prompts", bad), 2, f"{bad}:2: each turn needs a role")
    one_line(ct.cli("bench-decode", "ct200", "--prompts", ct.tmp / "missing.jsonl"), 2, "no such file")

    r = ct.cli("launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", ct.cfg, "--", "--steps", "4")
    assert r.returncode == 0, r.stderr.decode()
    run = r.stdout.decode().strip()
    assert ct.cli("logs", "ct200", run, "--follow").returncode == 0
    r = ct.cli("bench-decode", "ct200", "--max-new-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr.decode()
    doc = json.loads(r.stdout)
    assert doc["target"] == "ct200" and doc["run"] == run and doc["step"] == 4
    assert doc["prompts_source"] == "held-out" and doc["prompts"] == 2 and doc["lossless"] is True
    assert doc["tau"] >= 1 and doc["tokens"] > 0 and doc["speedup"] > 0 and doc["target"] == "ct200"
    assert r.stderr == b"" and doc["notes"] == []      # --json: the document alone, nothing to warn of
    assert ct.exports.is_dir() and list(ct.exports.iterdir()) == []     # the temporary folder is gone

    prompts = ct.tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n\n"
                       + json.dumps({"prompt": "import os\n"}) + "\n" + json.dumps({"prompt": "x = 1\n"}) + "\n")
    r = ct.cli("bench-decode", "ct200", run, "--prompts", prompts, "--max-new-tokens", "8", "--limit", "2")
    assert r.returncode == 0, r.stderr.decode()
    err = r.stderr.decode().splitlines()
    assert [line.split(":")[1] for line in err if line.startswith("specdec: prompt ")] == [" prompt 1/2",
                                                                                        " prompt 2/2"], err
    out = r.stdout.decode().strip()
    assert out.startswith(f"ct200: run {run} step 4, 2 prompts ({prompts}),") and "tau " in out, out
    assert "tokens/s alone" in out and "speedup" in out and out.endswith("lossless yes"), out
    assert list(ct.exports.iterdir()) == []

    prompts = ct.tmp / "one.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n")
    r = ct.cli("regen", "ct200", "--prompts", prompts, "--model", "tiny", "--gpus", "0",     # hangs until teardown
               "--env", "DFLASH_TRAINER_FAULTS=regen_batch=0:hang")
    assert r.returncode == 0, r.stderr.decode()
    regen = r.stdout.decode().strip()
    one_line(ct.cli("bench-decode", "ct200", regen), 2, "a regen run has no drafter")

    # the same container, specdec's reference decode of prompt 0 changed by a test hook: exit 1, said last
    r = ct.cli("bench-decode", "differ", run, "--max-new-tokens", "4", "--limit", "1")
    err = r.stderr.decode().strip().splitlines()
    assert f"agent: run {regen} is running here too: the timings share the machine with it" in err, err
    assert r.returncode == 1 and "Traceback" not in r.stderr.decode() and r.stdout == b"", err
    assert err[-1].startswith(f"dflash-ops: differ: run {run}: prompt 0: ") and err[-1].endswith("NOT lossless"), err
    assert list(ct.exports.iterdir()) == []



def test_the_held_out_prompts_are_the_last_eval_prompts_rows_cut_before_their_first_answer(tmp_path, capsys):
    from orchestrator.remote.runs.bench import _held_out

    rundir, out = tmp_path / "run", tmp_path / "prompts.jsonl"
    rundir.mkdir()
    (rundir / "run.json").write_text(json.dumps({"cwd": str(tmp_path)}))
    turns = [{"role": "system", "content": "#"}, {"role": "user", "content": "a"},
             {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    rows = [{"messages": [{"role": "user", "content": str(i)}, {"role": "assistant", "content": "x"}]}
            for i in range(4)] + [{"messages": turns}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n\n" for r in rows))   # blank lines: no rows
    (tmp_path / "ids.jsonl").write_text("[1]\n" + json.dumps({"input_ids": [1, 2, 3]}) + "\n")

    def held(**cfg):
        (rundir / "trainer-config.json").write_text(json.dumps(cfg))
        try:
            return _held_out("R", str(rundir), str(out))
        except SystemExit:
            return json.loads(capsys.readouterr().out)

    assert held(data="data.jsonl", eval_prompts=2) == 2      # relative to the trainer's cwd, as it read it
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"messages": [{"role": "user", "content": "3"}]}, {"messages": turns[:2]}]
    for cfg, why in [({"data": "synthetic", "eval_prompts": 2}, "synthetic data"),
                     ({"data": "data.jsonl", "eval_prompts": 0}, "held out no rows"),
                     ({"data": "data.jsonl", "eval_prompts": 3}, "5 rows were too few to hold 3 out"),
                     ({"data": "missing.jsonl", "eval_prompts": 1}, "cannot read its data"),
                     ({"data": str(tmp_path / "ids.jsonl"), "eval_prompts": 1}, "not chat rows")]:
        doc = held(**cfg)
        assert doc["reason"] == "no_prompts" and why in doc["message"] and doc["exit_code"] == 2, doc
