"""benchmarks/decode_shapes.py on a CPU at toy shapes: it runs end to end (nothing captured), its document
holds every part's cost and a table that decode_model reproduces from those costs, and bad input is one
line with exit 2 (checked before torch is imported, so those runs take a fraction of a second)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "decode_shapes.py"
TOY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
       "--intermediate", "128", "--vocab", "256", "--dtype", "float32", "--prompt-len", "16",
       "--new-tokens", "32", "--reps", "10"]


def _load():
    spec = importlib.util.spec_from_file_location("decode_shapes", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod    # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)


def test_a_toy_shape_end_to_end(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from trainer.run.decode_model import RoundCosts, speedup_at, tau_for

    torch.set_num_threads(1)
    out = tmp_path / "sub" / "toy.json"            # the folder is made
    assert _load().main([*TOY, "--json", str(out)]) == 0
    text, err = capsys.readouterr()
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["graphed"] is False and doc["compile"] is False
    assert doc["shape"]["name"] == "custom" and doc["shape"]["hidden"] == 64
    ms = doc["costs_ms"]
    for part in ("step", "verify", "draft", "extend", "round", "prefill_alone", "prefill_spec"):
        assert ms[part] > 0, part
    assert ms["host"] >= 0
    # (how a round compares with its three parts is a measurement, as noisy as a shared CPU's load: the
    # benchmark reports it, no test asserts it)
    assert doc["verify_over_step"] == pytest.approx(ms["verify"] / ms["step"])
    c = RoundCosts.from_ms(ms)
    n = doc["new_tokens"]
    rows = doc["table"]["tau_for"]
    assert [r["speedup"] for r in rows] == [2.0, 3.0]
    for r in rows:
        assert r["long"] == pytest.approx(tau_for(c, r["speedup"]))
        want = tau_for(c, r["speedup"], n)
        assert r["at_new_tokens"] == (None if want is None else pytest.approx(want))
    rows = doc["table"]["speedup_at"]
    assert [r["tau"] for r in rows] == [float(t) for t in _load().TAUS.split(",")]   # the default taus
    for r in rows:
        assert r["long"] == pytest.approx(speedup_at(c, r["tau"]))
        assert r["at_new_tokens"] == pytest.approx(speedup_at(c, r["tau"], n))
    # Two layers cannot give five taps: the trainer's own choice takes both, and says so
    assert doc["drafter"]["layer_ids"] == [0, 1] and doc["drafter"]["layers"] == 5
    assert "taps 2 of them (0,1), not 5" in err
    assert "the round" in err and "5 batches each" in err and "verify / step" in text and "tau needed" in text


@pytest.mark.parametrize("args, says", [
    (["--hidden", "-4"], "--hidden must be >= 1"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--heads", "6", "--kv-heads", "4"], "not a multiple of --kv-heads"),
    (["--head-dim", "15"], "--head-dim must be even"),
    (["--taus", "2.9,abc"], "'abc' is not a number"),
    (["--taus", "20"], "not a tau of block 16"),
    (["--taus", "0.5"], "not a tau of block 16"),
    (["--hidden", "x"], "invalid int value"),
    (["--prompt-len", "0"], "--prompt-len must be >= 1"),
    (["--config", "no-such.yaml"], "no such file"),
])
def test_bad_input_is_one_line_and_exit_2(args, says):
    r = _run(*args)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("decode_shapes: error: ") and says in r.stderr
    assert r.stdout == ""


def test_the_recipe_gives_the_drafter_and_its_taps(tmp_path):
    mod = _load()
    recipe = tmp_path / "r.yaml"
    recipe.write_text("target: /models/x\ndraft_layers: 2\nblock_size: 8\ntarget_layers: '0,2'\n")
    shape, draft, taus = mod.settle(mod.parser().parse_args(["--config", str(recipe), "--layers", "3",
                                                             "--taus", "2,8"]))
    assert (draft["layers"], draft["block_size"], draft["layer_ids"]) == (2, 8, (0, 2))
    assert shape.layers == 3 and shape.hidden == 4096 and taus == [2.0, 8.0]   # the rest: Qwen3-8B's
    r = _run("--config", str(recipe), "--layers", "2", "--taus", "2")          # layer 2 of a 2-layer target
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "layer 2 is not one of the target's 2" in r.stderr
    shipped = mod.settle(mod.parser().parse_args(["--config", str(REPO / "configs" / "qwen3-8b.yaml")]))
    assert (shipped[1]["layers"], shipped[1]["block_size"], shipped[1]["layer_ids"]) == (5, 16, (1, 9, 17, 25, 33))
    assert shipped[0] == mod.Shape(**mod.QWEN3_8B)


def test_a_cpu_refuses_the_8b_shape_unless_told():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the CPU refusal does not apply")
    r = _run()
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "~18.5 GB of weights" in r.stderr and "--cpu-ok" in r.stderr


def test_the_costs_are_the_decoders_own_step_costs_and_the_table_follows_from_them(tmp_path, monkeypatch):
    """The benchmark times nothing itself: GraphDecoder.step_costs (the one that specdec's model uses)
    gives the costs, and the table is decode_model's arithmetic over them."""
    pytest.importorskip("torch")
    from trainer.run import decode_graphs
    from trainer.run.decode_model import RoundCosts, speedup_at, tau_for

    c = RoundCosts(step=0.004, draft=0.001, verify=0.005, extend=0.0005, round=0.007, prefill_alone=0.02,
                   prefill_spec=0.022)
    asked = []
    monkeypatch.setattr(decode_graphs.GraphDecoder, "step_costs",
                        lambda self, n, reps: asked.append((n, reps)) or c)
    out = tmp_path / "own.json"
    assert _load().main([*TOY, "--reps", "5", "--new-tokens", "256", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert asked == [(16, 5)] and doc["costs_ms"]["round"] == pytest.approx(7.0)
    row = next(r for r in doc["table"]["speedup_at"] if r["tau"] == 2.71)
    assert row["long"] == pytest.approx(speedup_at(c, 2.71)) and row["at_new_tokens"] == pytest.approx(
        speedup_at(c, 2.71, 256))
    assert doc["table"]["tau_for"][0]["long"] == pytest.approx(tau_for(c, doc["table"]["tau_for"][0]["speedup"]))


def test_wait_for_holds_the_timing_until_the_file_exists(tmp_path):
    """--wait-for: the process has built and captured, says it waits, and times only once the file is
    there (event order, not a clock: the file is made only after the wait was announced)."""
    pytest.importorskip("torch")
    gate, out = tmp_path / "gate", tmp_path / "toy.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, str(SCRIPT), *TOY, "--json", str(out), "--wait-for", str(gate)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        seen = []
        for line in p.stderr:
            seen.append(line)
            if "waiting for" in line:
                break
        assert not out.exists() and p.poll() is None, seen
        gate.touch()
        _, rest = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 0, rest
    assert f"{gate} is there: timing" in rest and out.exists()
