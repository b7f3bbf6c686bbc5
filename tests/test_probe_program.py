"""The probe program: its pieces as units, then the real thing on this machine's CPU torch."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainer import policies, probe, probe_block, probe_build, probe_case
from trainer.signatures import load_catalog

REPO = Path(__file__).resolve().parent.parent
SAMPLES = Path(__file__).resolve().parent / "data" / "signatures"


def case(policy, topology="threads", outcome="ok", step_ms=10.0, agrees=True, signature=None, threads=2):
    return {"policy": policy, "topology": topology, "threads": threads, "outcome": outcome,
            "signature": signature, "step_ms": step_ms if outcome == "ok" else None,
            "agrees": agrees if outcome == "ok" else None}


# ---- the choice -----------------------------------------------------------------------------

def test_choose_fastest_that_passed_in_threads_and_agreed():
    cases = [case("eager", step_ms=30), case("inductor", step_ms=20),
             case("max-autotune-no-cudagraphs", step_ms=15, agrees=False),
             case("reduce-overhead", outcome="failed", signature="cudagraph-trees-tls"),
             case("cudagraphs-no-trees", outcome="crashed", signature="cudagraph-static-input"),
             case("reduce-overhead", topology="main", step_ms=1, threads=1)]   # main does not count
    policy, reason = probe.choose(cases)
    assert policy == "inductor"
    assert "inductor: fastest of 2 policies that ran in 2 threads" in reason
    assert "reduce-overhead (cudagraph-trees-tls)" in reason
    assert "cudagraphs-no-trees (cudagraph-static-input)" in reason
    assert "disagreed with eager: max-autotune-no-cudagraphs" in reason


def test_choose_prefers_the_simpler_policy_within_noise():
    policy, reason = probe.choose([case("eager", step_ms=10.2), case("inductor", step_ms=10.0)])
    assert policy == "eager" and "the simpler policy wins" in reason


def test_choose_falls_back_to_eager():
    policy, reason = probe.choose([case("inductor", outcome="timeout"),
                                   case("eager", outcome="skipped")])
    assert policy == "eager" and "fallback" in reason and "inductor (timeout)" in reason


def test_processes_choice_comes_from_the_main_thread_where_cuda_graphs_are_allowed():
    # as measured on the H200 (torch 2.11): trees fail in threads, pass in the main thread
    cases = [case("eager", step_ms=30), case("inductor", step_ms=20),
             case("reduce-overhead", outcome="failed", signature="cudagraph-trees-tls"),
             case("eager", topology="main", step_ms=28, threads=1),
             case("inductor", topology="main", step_ms=19, threads=1),
             case("reduce-overhead", topology="main", step_ms=12, threads=1),
             case("cudagraphs-no-trees", topology="main", step_ms=12.1, threads=1, agrees=False)]
    assert probe.choose(cases)[0] == "inductor"
    policy, reason = probe.choose_processes(cases)
    assert policy == "reduce-overhead"
    assert "CUDA-graph policies allowed with one process per GPU: reduce-overhead" in reason
    policy, reason = probe.choose_processes([case("inductor", topology="main", outcome="timeout")])
    assert policy == "eager" and "fallback" in reason


# ---- classification of a case's process -----------------------------------------------------

def run_record(output, exit_code, result=None, timed_out=False):
    lines = output.splitlines()
    return {"result": result, "exit_code": exit_code, "timed_out": timed_out, "output": output,
            "tail": lines[-probe.TAIL_LINES:], "seconds": 1.0}


def test_case_record_names_a_crash_by_its_root_cause():
    text = (SAMPLES / "cudagraph-trees-tls.txt").read_text()
    rec = probe._case_record("reduce-overhead", "threads", 2, run_record(text, -11), load_catalog())
    assert rec["outcome"] == "crashed" and rec["signature"] == "cudagraph-trees-tls"
    assert rec["exit_code"] == -11 and rec["step_ms"] is None and rec["agrees"] is None
    assert len(rec["tail"]) == probe.TAIL_LINES


def test_case_record_failed_timeout_ok():
    cat = load_catalog()
    text = (SAMPLES / "cudagraph-static-input.txt").read_text()
    failed = probe._case_record("cudagraphs-no-trees", "threads", 2,
                                run_record(text, 1, {"ok": False, "error": "thread 1: AssertionError: "}), cat)
    assert (failed["outcome"], failed["signature"]) == ("failed", "cudagraph-static-input")
    hung = probe._case_record("inductor", "threads", 2, run_record("compiling...", None, timed_out=True), cat)
    assert (hung["outcome"], hung["exit_code"]) == ("timeout", None)
    ok = probe._case_record("eager", "main", 1, run_record("", 0, {"ok": True, "step_ms": 3.0,
                                                                   "max_abs_diff": 0.0, "agrees": True}), cat)
    assert (ok["outcome"], ok["signature"], ok["step_ms"], ok["agrees"]) == ("ok", None, 3.0, True)


def test_a_failing_thread_fails_the_case_and_releases_the_others(monkeypatch, capsys):
    """One worker dies while compiling; the other is waiting at the start barrier and must not hang."""
    real = policies.compile_module

    def flaky(module, policy, *, n_devices=1):
        if threading.current_thread().name == "probe-1":
            raise AssertionError
        return real(module, policy, n_devices=n_devices)

    monkeypatch.setattr(policies, "compile_module", flaky)
    out = probe_case.run_case("eager", "threads", 2, steps=1, warmup=1, device_kind="cpu")
    assert out == {"ok": False, "error": "thread 1: AssertionError"}
    err = capsys.readouterr().err
    assert "[thread 1] failed:" in err and "AssertionError" in err


def test_run_isolated_reports_signals_and_kills_hangs():
    seg = probe.run_isolated([sys.executable, "-X", "faulthandler", "-c",
                              "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"], 30)
    assert seg["exit_code"] == -11 and "Fatal Python error: Segmentation fault" in seg["output"]
    hang = probe.run_isolated(["bash", "-c", "sleep 60 & sleep 60"], 1.5)
    assert hang["timed_out"] and hang["exit_code"] is None and hang["seconds"] < 10


# ---- build expectations, modes, the saved result --------------------------------------------

def test_check_expect():
    build = {"torch": "2.11.0+cu130", "cuda": "13.0", "python": "3.12.3", "triton": None,
             "gpus": [{"name": "NVIDIA H200"}] * 2, "bf16": True}
    assert probe_build.check_expect(build, {"torch": ">=2.5", "cuda": "13.0", "gpus": 2,
                                      "gpu_name": "h200", "bf16": True})["mismatches"] == []
    out = probe_build.check_expect(build, {"torch": ">=2.13", "cuda": "12.8", "gpus": 8, "triton": ">=3",
                                     "colour": "red"})
    assert out["torch"] == ">=2.13" and len(out["mismatches"]) == 5
    assert "torch: have 2.11.0+cu130, expected >=2.13" in out["mismatches"]


def test_mode_options_lists_every_mode():
    modes = probe_build.mode_options()
    assert {"default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"} <= set(modes)
    assert modes["default"] == {} and modes["reduce-overhead"] == {"triton.cudagraphs": True}
    json.dumps(modes)


def test_save_result_keeps_history(tmp_path):
    for i in range(23):
        doc = {"policy": "eager" if i % 2 else "inductor", "reason": f"run {i}", "time": f"t{i}",
               "torch": {"version": torch.__version__}}
        probe.save_result(str(tmp_path), doc)
    saved = json.loads((tmp_path / "probe.json").read_text())
    assert saved["reason"] == "run 22" and saved["result"]["reason"] == "run 22"
    assert len(saved["history"]) == probe.HISTORY_KEEP and saved["history"][-1]["reason"] == "run 21"
    assert [p.name for p in tmp_path.iterdir()] == ["probe.json"]   # no temp files left
    assert policies.resolve("auto", str(tmp_path)) == "inductor"


def test_batches_follow_the_dflash_mask():
    c = probe_block.CPU_CONFIG
    ctx, ids, mask, cos_q, sin_q, cos_k, sin_k, labels, w = probe_block.make_batches(c, 1)[0]
    Q, C = c.blocks * c.block_size, c.context
    assert mask.shape == (c.batch, 1, Q, C + Q) and ids.shape == labels.shape == w.shape == (c.batch, Q)
    for b in range(c.batch):
        for j in range(c.blocks):
            q = j * c.block_size
            anchor_token = ids[b, q]
            seen_ctx = mask[b, 0, q, :C]
            a = int(seen_ctx.sum())                      # sees context strictly before its anchor
            assert seen_ctx[:a].all() and not seen_ctx[a:].any() and a >= 1
            blk = mask[b, 0, q, C:].view(c.blocks, c.block_size)
            assert blk[j].all() and blk.sum() == c.block_size   # its own block only
            assert (ids[b, q + 1:q + c.block_size] == 0).all() and anchor_token != 0
    assert (w[:, 0] == 0).all() and torch.isclose(w[0, 1], torch.tensor(1.0))


# ---- the real program, on this machine ------------------------------------------------------

@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("probe-workdir")
    cmd = [sys.executable, "-m", "trainer.probe", "--threads", "2",
           "--policies", "eager,inductor,reduce-overhead,cudagraphs-no-trees",
           "--steps", "3", "--warmup", "2", "--workdir", str(workdir),
           "--expect", json.dumps({"torch": ">=2.5"})]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return SimpleNamespace(doc=json.loads(p.stdout), stderr=p.stderr, workdir=workdir)


def test_probe_json_matches_the_contract(probe_run):
    doc = probe_run.doc
    assert isinstance(doc["torch"]["version"], str) and doc["torch"]["version"] == torch.__version__
    assert "cuda" in doc["torch"] and isinstance(doc["torch"]["gpus"], list)
    assert all(isinstance(v, dict) for v in doc["modes"].values()) and "default" in doc["modes"]
    assert doc["policy"] in policies.POLICY_NAMES and doc["reason"]
    for c in doc["cases"]:
        assert c["topology"] in ("main", "threads")
        assert c["outcome"] in ("ok", "failed", "crashed", "timeout", "skipped")
        assert isinstance(c["threads"], int) and isinstance(c["policy"], str)
        assert c["signature"] is None or isinstance(c["signature"], str)
        assert c["step_ms"] is None or isinstance(c["step_ms"], float)
        assert {"max_abs_diff", "agrees", "exit_code", "tail", "seconds"} <= set(c)
    b = doc["build"]
    assert {"python", "torch", "torch_git", "cuda", "cudnn", "nccl", "triton", "driver", "gpus", "bf16"} <= set(b)
    assert doc["expect"] == {"torch": ">=2.5", "mismatches": []}


def test_probe_runs_the_matrix_for_real(probe_run):
    doc = probe_run.doc
    got = {(c["policy"], c["topology"]): c for c in doc["cases"]}
    assert len(got) == 8
    for policy in ("eager", "inductor"):
        for topology, n in (("main", 1), ("threads", 2)):
            c = got[(policy, topology)]
            assert (c["outcome"], c["threads"]) == ("ok", n), c
            assert c["agrees"] is True and c["max_abs_diff"] < 1e-3 and c["step_ms"] > 0
    if not torch.cuda.is_available():
        for policy in ("reduce-overhead", "cudagraphs-no-trees"):
            for topology in ("main", "threads"):
                c = got[(policy, topology)]
                assert c["outcome"] == "skipped" and c["signature"] is None
    assert doc["policy"] in ("eager", "inductor")


def test_probe_progress_and_saved_choice(probe_run):
    lines = [ln for ln in probe_run.stderr.splitlines() if ln.startswith("probe: [")]
    assert len(lines) == 8 and lines[0].startswith("probe: [1/8] eager main: ok")
    saved = json.loads((probe_run.workdir / "probe.json").read_text())
    assert saved["policy"] == probe_run.doc["policy"] and saved["result"]["cases"] == probe_run.doc["cases"]
    assert policies.resolve("auto", str(probe_run.workdir)) == probe_run.doc["policy"]
    assert saved["processes_policy"] == probe_run.doc["processes_policy"] in ("eager", "inductor")
    assert probe_run.doc["processes_reason"] and "for --topology processes: " in probe_run.stderr
    assert policies.resolve("auto", str(probe_run.workdir), "processes") == probe_run.doc["processes_policy"]


def test_probe_refuses_bad_arguments():
    p = subprocess.run([sys.executable, "-m", "trainer.probe", "--policies", "eager,warp"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown warp" in p.stderr and p.stdout == ""
    p = subprocess.run([sys.executable, "-m", "trainer.probe", "--expect", "[1]"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "must be a JSON object" in p.stderr
