"""The probe program: its pieces as units, then the real thing on this machine's CPU torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainer import faults, policies
from trainer.probe import program as probe, build as probe_build, case as probe_case
from trainer.signatures import load_catalog
from trainer_quick import gone, wait_for

REPO = Path(__file__).resolve().parent.parent
SAMPLES = Path(__file__).resolve().parent / "data" / "signatures"


def case(policy, topology="threads", outcome="ok", step_ms=10.0, signature=None, threads=2):
    ran = outcome in ("ok", "wrong")
    return {"policy": policy, "topology": topology, "threads": threads, "outcome": outcome,
            "signature": "compiled-wrong" if outcome == "wrong" else signature,
            "step_ms": step_ms if ran else None, "agrees": outcome == "ok" if ran else None}


# ---- the choice -----------------------------------------------------------------------------

def test_choose_fastest_that_passed_in_threads_and_matched_eager():
    cases = [case("eager", step_ms=30), case("inductor", step_ms=20),
             case("cudagraphs-no-trees", step_ms=4.5, outcome="wrong"),     # fastest, but wrong
             case("reduce-overhead", outcome="failed", signature="cudagraph-trees-tls"),
             case("max-autotune-no-cudagraphs", outcome="crashed", signature="segfault"),
             case("reduce-overhead", topology="processes", step_ms=1, threads=2)]   # processes do not count
    policy, reason = probe.choose(cases)
    assert policy == "inductor"
    assert "inductor: fastest of 2 policies that ran in 2 threads and matched eager's gradients" in reason
    assert "reduce-overhead (cudagraph-trees-tls)" in reason
    assert "max-autotune-no-cudagraphs (segfault)" in reason
    assert "computed a different gradient than eager (compiled-wrong): cudagraphs-no-trees" in reason


def test_choose_prefers_the_simpler_policy_within_noise():
    policy, reason = probe.choose([case("eager", step_ms=10.2), case("inductor", step_ms=10.0)])
    assert policy == "eager" and "the simpler policy wins" in reason


def test_choose_says_no_policy_works_and_never_calls_one_that_failed_a_fallback():
    policy, reason = probe.choose([case("inductor", outcome="timeout"),
                                   case("eager", outcome="skipped")])
    assert policy == "eager" and "NO WORKING POLICY in threads" in reason and "inductor (timeout)" in reason
    assert "eager skipped" in reason and "fallback" not in reason


def test_processes_choice_comes_from_the_ddp_cases_where_cuda_graphs_are_allowed():
    # as measured on the H200 (torch 2.11): trees fail in threads, run with one process per GPU
    cases = [case("eager", step_ms=30), case("inductor", step_ms=20),
             case("reduce-overhead", outcome="failed", signature="cudagraph-trees-tls"),
             case("eager", topology="processes", step_ms=28),
             case("inductor", topology="processes", step_ms=19),
             case("reduce-overhead", topology="processes", step_ms=12),
             case("cudagraphs-no-trees", topology="processes", step_ms=6, outcome="wrong")]
    assert probe.choose(cases)[0] == "inductor"
    policy, reason = probe.choose_processes(cases)
    assert policy == "reduce-overhead"
    assert "ran as 2 DDP rank(s)" in reason
    assert "CUDA-graph policies allowed with one process per GPU: reduce-overhead" in reason
    assert "(compiled-wrong): cudagraphs-no-trees" in reason
    policy, reason = probe.choose_processes([case("inductor", topology="processes", outcome="timeout")])
    assert policy == "eager" and "NO WORKING POLICY in processes" in reason and "eager not probed" in reason


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
    num = {"grad_err": 3e-7, "grad_tol": 3e-6, "grad_noise": 4e-7, "loss_err": 1e-6}
    ok = probe._case_record("eager", "processes", 2, run_record("", 0, {"ok": True, "step_ms": 3.0,
                                                                        "numerics": num}), cat)
    assert (ok["outcome"], ok["signature"], ok["step_ms"], ok["agrees"]) == ("ok", None, 3.0, True)
    assert (ok["grad_err"], ok["grad_tol"]) == (3e-7, 3e-6)
    why = "gradient differs from eager at step 1: relative L2 1 (tolerance 3e-06 = 8 x noise 3.8e-07)"
    wrong = probe._case_record("cudagraphs-no-trees", "threads", 2, run_record(
        "", 0, {"ok": True, "wrong": True, "why": why, "step_ms": 4.5, "numerics": dict(num, grad_err=1.0)}), cat)
    assert (wrong["outcome"], wrong["signature"], wrong["agrees"]) == ("wrong", "compiled-wrong", False)
    assert wrong["error"] == why and wrong["step_ms"] == 4.5 and wrong["grad_err"] == 1.0


def test_a_failing_worker_fails_the_case_without_hanging(monkeypatch):
    """A worker dies while its replica compiles; the case ends with its error instead of waiting."""
    from trainer.engine.workers import WorkerFailed

    real = policies.compile_module

    def flaky(module, policy, *, n_devices=1):
        if threading.current_thread().name == "dflash-worker1":
            raise AssertionError("worker 1 cannot compile")
        return real(module, policy, n_devices=n_devices)

    monkeypatch.setattr(policies, "compile_module", flaky)
    with pytest.raises(WorkerFailed, match="worker 1 .* AssertionError: worker 1 cannot compile"):
        probe_case.run_case("eager", "threads", 2, steps=1, device_kind="cpu")


@pytest.mark.timeout(120)     # a run_isolated that waited for the hung case (or its child holding the pipe) hangs
def test_run_isolated_reports_signals_and_kills_hangs(tmp_path):
    seg = probe.run_isolated([sys.executable, "-X", "faulthandler", "-c",
                              "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"], 30)
    assert seg["exit_code"] == -11 and "Fatal Python error: Segmentation fault" in seg["output"]
    pids = tmp_path / "pids"
    hang = probe.run_isolated(["bash", "-c", f"sleep 600 & echo $! >{pids}; echo $$ >>{pids}; sleep 600"], 1.5)
    assert hang["timed_out"] and hang["exit_code"] is None
    for pid in map(int, pids.read_text().split()):      # the case and the child it left, both killed
        wait_for(lambda: gone(pid), what=f"process {pid} to be killed")


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


# ---- the real program, on this machine ------------------------------------------------------

@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("probe-workdir")
    cmd = [sys.executable, "-m", "trainer.probe", "--threads", "2",
           "--policies", "eager,inductor,test-drop-first-grad,reduce-overhead",
           "--steps", "3", "--workdir", str(workdir), "--expect", json.dumps({"torch": ">=2.5"}),
           "--topologies", "threads,processes"]   # (threads alone is the default on a CPU)
    # the heartbeat every second, not every 10 s: test_probe_progress_and_saved_choice sees one on any
    # machine, not only where a case happens to run longer than 10 s
    env = dict(os.environ, **faults.env(test_policies="1", probe_beat_s="1"))
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return SimpleNamespace(doc=json.loads(p.stdout), stderr=p.stderr, workdir=workdir)


def test_probe_json_matches_the_documented_shape(probe_run):
    doc = probe_run.doc
    assert isinstance(doc["torch"]["version"], str) and doc["torch"]["version"] == torch.__version__
    assert "cuda" in doc["torch"] and isinstance(doc["torch"]["gpus"], list)
    assert all(isinstance(v, dict) for v in doc["modes"].values()) and "default" in doc["modes"]
    assert doc["policy"] in policies.POLICY_NAMES and doc["reason"]
    for c in doc["cases"]:
        assert c["topology"] in ("threads", "processes")
        assert c["outcome"] in ("ok", "wrong", "failed", "crashed", "timeout", "skipped")
        assert isinstance(c["threads"], int) and isinstance(c["policy"], str)
        assert c["signature"] is None or isinstance(c["signature"], str)
        assert c["step_ms"] is None or isinstance(c["step_ms"], float)
        assert {"grad_err", "grad_tol", "max_abs_diff", "agrees", "exit_code", "tail", "seconds"} <= set(c)
    b = doc["build"]
    assert {"python", "torch", "torch_git", "cuda", "cudnn", "nccl", "triton", "driver", "gpus", "bf16"} <= set(b)
    assert doc["expect"] == {"torch": ">=2.5", "mismatches": []}


def test_probe_runs_the_matrix_for_real(probe_run):
    """The trainer's own replica in 2 worker threads and in 2 gloo DDP ranks; a deliberately wrong
    policy (right loss, its first gradient dropped; an uncompiled module: what it proves is the verdict,
    and inductor's cases are the compiled ones) is `wrong` in both and never chosen."""
    doc = probe_run.doc
    got = {(c["policy"], c["topology"]): c for c in doc["cases"]}
    assert len(got) == 8 and doc["ranks"] == 2
    for policy in ("eager", "inductor"):
        for topology in ("threads", "processes"):
            c = got[(policy, topology)]
            assert (c["outcome"], c["threads"]) == ("ok", 2), c
            assert c["agrees"] is True and c["grad_err"] <= c["grad_tol"] and c["step_ms"] > 0
            assert c["numerics"]["learn"]["compiled_drop"] > 0 and c["backends"] == ["sdpa", "dense"]
    assert got[("eager", "threads")]["grad_err"] < 1e-5   # eager shards vs eager whole batch: reassociation only
    # one compile cache for every case (WORKDIR/probe-compile-cache unless the environment names one, as
    # the suite's may): the DDP ranks' inductor case finds graphs compiled before it
    assert len({c["caches"]["inductor"] for c in doc["cases"] if c.get("caches")}) == 1
    assert got[("inductor", "processes")]["caches"]["fxgraph_hit"] > 0, got[("inductor", "processes")]["caches"]
    for topology in ("threads", "processes"):
        c = got[("test-drop-first-grad", topology)]
        assert (c["outcome"], c["signature"], c["agrees"]) == ("wrong", "compiled-wrong", False), c
        assert c["grad_err"] == pytest.approx(1.0) and "at step 1" in c["error"]
        # a loss tolerance could not have told: the loss was right on every step
        assert all(abs(s["loss"] - s["eager_loss"]) < 1e-4 for s in c["numerics"]["per_step"])
    if not torch.cuda.is_available():
        for topology in ("threads", "processes"):
            c = got[("reduce-overhead", topology)]
            assert c["outcome"] == "skipped" and c["signature"] is None
    assert doc["policy"] in ("eager", "inductor") and doc["processes_policy"] in ("eager", "inductor")
    assert "(compiled-wrong): test-drop-first-grad" in doc["reason"]


def test_probe_progress_and_saved_choice(probe_run):
    talk = [ln for ln in probe_run.stderr.splitlines() if ln.startswith("probe: [")]
    lines = [ln for ln in talk if not ln.endswith(": starting") and ": running, " not in ln]
    # a heartbeat while a case runs, naming its phase (every second here: the fixture's probe_beat_s)
    beats = [ln.split(": running, ")[1].split(" (")[0] for ln in talk if ": running, " in ln]
    assert beats and set(beats) <= {"import", "compile", "teacher-forced", "timed", "verdict"}, talk
    # (the cases skipped at once, reduce-overhead's on a CPU, say so before the others have run)
    assert len(lines) == 8 and [ln for ln in lines if ": skipped " not in ln][0].startswith(
        "probe: [1/8] eager threads x2: ok")
    assert any("test-drop-first-grad threads x2: wrong" in ln and "[compiled-wrong]" in ln for ln in lines)
    saved = json.loads((probe_run.workdir / "probe.json").read_text())
    assert saved["policy"] == probe_run.doc["policy"] and saved["result"]["cases"] == probe_run.doc["cases"]
    assert policies.resolve("auto", str(probe_run.workdir)) == probe_run.doc["policy"]
    assert saved["processes_policy"] == probe_run.doc["processes_policy"] in ("eager", "inductor")
    assert probe_run.doc["processes_reason"] and "for --topology processes: " in probe_run.stderr
    assert policies.resolve("auto", str(probe_run.workdir), "processes") == probe_run.doc["processes_policy"]


def test_probe_refuses_bad_arguments(capsys):
    # in this process: `python -m trainer.probe` is main() (the fixture above runs it as a program), and
    # these end in argparse's exit 2 before anything runs
    for argv, said in ((["--policies", "eager,warp"], "unknown warp"), (["--expect", "[1]"], "must be a JSON object")):
        with pytest.raises(SystemExit) as e:
            probe.main(argv)
        out, err = capsys.readouterr()
        assert e.value.code == 2 and said in err and out == "", (argv, err)

