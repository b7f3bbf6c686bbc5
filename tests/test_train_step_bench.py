"""benchmarks/train_step_bench.py end to end on the CPU: the same code the H200 runs, tiny shapes.

The GPU run cannot be tried before the lead runs it, so everything but CUDA is exercised here:
the trainer's tiny target through the command line, and the 8B code path (a Qwen3Config built in
place, wrapped in Target, 2 worker threads summing gradients) with the dimensions shrunk.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "train_step_bench.py"


def _load():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import train_step_bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return train_step_bench


def _check(res: dict, steps: int) -> None:
    assert res["ok"], res.get("error")
    assert res["truncated_equals_full"] is True
    assert res["timed_steps"] == steps
    for m in res["modes"].values():
        for key in ("features_ms_per_sample", "drafter_ms_per_sample", "total_ms_per_sample"):
            assert m[key] > 0
    for s in res["steps"]:
        assert len(s["features_ms"]) == res["workers"]  # every worker ran the target once per step
        assert s["total_ms"] > 0 and s["block"] >= 1 and torch.isfinite(torch.tensor(s["loss"]))


def test_tiny_runs_end_to_end_from_the_command_line(tmp_path):
    p = subprocess.run([sys.executable, str(BENCH), "--tiny", "--policy", "eager", "--steps", "2", "--warmup", "1",
                        "--case-steps", "2", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads((tmp_path / "results.json").read_text())
    _check(res, 2)
    assert res["target_modes"] == ["truncated"] and res["layer_ids"] == [1, 2, 3, 4, 5]
    # step 1 alone (it compiles), then blocks of 2: the warm-up is rounded up to whole blocks
    assert [s["block"] for s in res["steps"]] == [1, 1, 2, 2]
    assert "step 4/4 [truncated]" in p.stdout and "| truncated | 2 |" in p.stdout


def test_the_8b_code_path_with_two_workers_and_every_target_mode(tmp_path, monkeypatch):
    bench = _load()
    small = dict(sys.modules["train_step_setup"].QWEN3_8B, vocab_size=300, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    monkeypatch.setattr(sys.modules["train_step_setup"], "QWEN3_8B", small)
    monkeypatch.setitem(bench.SHAPES, "8b", dict(bench.SHAPES["8b"], layers=(0, 2), draft_layers=1, seq=64,
                                                  anchors=4))
    assert bench.main(["--cpu", "--workers", "2", "--policy", "eager", "--target-mode", "truncated,full,inference",
                       "--steps", "3", "--warmup", "1", "--case-steps", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    _check(res, 3)
    assert res["shape"] == "8b" and res["global_batch"] == 4 and res["target_layers"] == 4
    assert res["layer_ids"] == [0, 2] and res["attn_implementation"] == "sdpa"
    # the modes alternate, each warmed up once untimed, then one timed step each
    assert [s["mode"] for s in res["steps"]] == ["truncated", "full", "inference"] * 2
    assert [s["timed"] for s in res["steps"]] == [False] * 3 + [True] * 3
    assert set(res["modes"]) == {"truncated", "full", "inference"}
    assert all(m["timed_steps"] == 1 and m["total_ms_per_sample"] > 0 for m in res["modes"].values())


def test_an_error_is_recorded_in_the_results(tmp_path, monkeypatch):
    bench = _load()
    monkeypatch.setattr(bench, "build_target", lambda args, device: (_ for _ in ()).throw(RuntimeError("no target")))
    with pytest.raises(RuntimeError):
        bench.main(["--tiny", "--policy", "eager", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    assert not res["ok"] and "no target" in res["error"]


def test_cases_alternate_and_the_trace_is_kept(tmp_path):
    """--grads and --update alternate like target modes (one case per combination); --trace keeps the
    profiled steps' timeline and its gap report (CPU ops recorded in the worker's thread)."""
    p = subprocess.run([sys.executable, str(BENCH), "--tiny", "--policy", "eager", "--steps", "4", "--warmup", "1",
                        "--case-steps", "1", "--grads", "flat,own", "--update", "fused,compiled", "--trace",
                        "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads((tmp_path / "results.json").read_text())
    _check(res, 4)
    names = ["truncated+flat+fused", "truncated+flat+compiled", "truncated+own+fused", "truncated+own+compiled"]
    assert res["target_modes"] == names and list(res["modes"]) == names
    assert [(s["grads"], s["update"]) for s in res["steps"][:4]] == [("flat", "fused"), ("flat", "compiled"),
                                                                   ("own", "fused"), ("own", "compiled")]
    assert (tmp_path / "trace.json.gz").stat().st_size > 0 and "gaps" in res["profile"]
    assert "where the GPU sat idle" in p.stdout


def test_processes_train_the_same_steps_as_threads(tmp_path):
    """--topology processes starts torchrun ranks (DDP, RankEngine): the same losses as two worker
    threads on the same global batch, and the ranks' weights stay bit-identical. main() runs here (the
    threads in this process, as the 8B path's test; for processes it starts torchrun, whose ranks are
    processes of their own)."""
    bench = _load()
    losses = {}
    for topology in ("threads", "processes"):
        out = tmp_path / topology
        assert bench.main(["--tiny", "--policy", "eager", "--workers", "2", "--steps", "2", "--warmup", "1",
                           "--case-steps", "1", "--topology", topology, "--out", str(out)]) == 0
        res = json.loads((out / "results.json").read_text())
        if topology == "threads":  # (a rank times its own target forward only: one entry, not one per worker)
            _check(res, 2)
        assert res["ok"] and res["topology"] == topology and res["global_batch"] == 4
        assert res["replicas_identical"] is True
        losses[topology] = [s["loss"] for s in res["steps"]]
    assert losses["processes"] == pytest.approx(losses["threads"], rel=1e-5)
    assert len(set(round(x, 3) for x in losses["threads"])) > 1  # the steps trained on different batches


def test_the_host_running_ahead_trains_the_same_steps_as_waiting(tmp_path):
    """--host ahead (the trainer: the next step is queued before this one's results are read) and
    --host sync give the same losses on the same steps: the run-ahead changes when the host reads,
    not what the devices compute. In this process, as the 8B path's test: the command line's own
    start-up (torch, transformers: seconds each) is test_tiny_runs_end_to_end_from_the_command_line's."""
    bench = _load()
    losses = {}
    for host in ("ahead", "sync"):
        out = tmp_path / host
        assert bench.main(["--tiny", "--policy", "eager", "--steps", "4", "--warmup", "1", "--case-steps", "4",
                           "--host", host, "--out", str(out)]) == 0
        res = json.loads((out / "results.json").read_text())
        _check(res, 4)
        losses[host] = [(s["loss"], s["grad_norm"]) for s in res["steps"]]
    assert losses["ahead"] == losses["sync"]
    assert len(set(round(x, 3) for x, _ in losses["ahead"])) > 1  # the steps trained on different batches
