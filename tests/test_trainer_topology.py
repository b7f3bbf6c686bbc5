"""Topologies of the trainer: worker threads and torchrun processes train the same drafter.

Tiny runs on the CPU with one torch thread each (deterministic). Tolerances:
- 2 worker threads vs 1 worker, same global batch: the sharded gradient is the same sum in another
  order (float reassociation), so losses and weights after 4 AdamW steps agree within the rounding
  bound of that reduction (tests/tolerance.py), on any CPU's kernels.
- torchrun (2 gloo processes, DDP with a SUM hook) vs 2 worker threads: the same shards, the same
  two-term sum (a + b == b + a), the same optimizer: bit-identical on the CPU; asserted to 1e-6.
The failure paths use the trainer's test-only hooks (trainer/faults.py).
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from trainer.run import checkpoint  # noqa: E402
from trainer_quick import (QUICK, ROOT, children, metrics, sigterm_once_training, step_losses,  # noqa: E402
                           subprocess_env, train)
from trainer import faults  # noqa: E402
from trainer.engine.allreduce import gather_chunks, reduce_own_chunk  # noqa: E402
from trainer.engine.step import FlatGrads  # noqa: E402
from trainer.engine.numerics import rel_l2  # noqa: E402
from tolerance import QUICK_CHAIN, bound, trained_weights_bound  # noqa: E402

STEPS = ["--steps", "4", "--checksum-every", "2"]
LOSS_TOL = bound(torch.float32, QUICK_CHAIN)
PRINTED = 1e-6  # metrics.jsonl rounds a loss to 6 decimals


def python_m_trainer(out: Path, *extra: str, env: dict | None = None, timeout: float = 180):
    cmd = [sys.executable, "-m", "trainer", *QUICK, "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=subprocess_env(**(env or {})), capture_output=True, text=True,
                          timeout=timeout)


def events(out: Path, name: str) -> list[dict]:
    return [m for m in metrics(out) if m.get("event") == name]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(checkpoint.find_latest(out)).model


@pytest.fixture(scope="module")
def threaded_runs(tmp_path_factory):
    """The same 4 steps with 1 worker and with 2 worker threads (global batch 4 both times)."""
    base = tmp_path_factory.mktemp("threads")
    one, two = base / "one", base / "two"
    assert train(one, *STEPS) == 0
    assert train(two, *STEPS, "--workers", "2") == 0
    return one, two


# ---- threads -----------------------------------------------------------------------------------------

def test_two_worker_threads_train_the_same_weights_as_one(threaded_runs):
    one, two = threaded_runs
    la, lb = step_losses(one), step_losses(two)
    assert sorted(la) == sorted(lb) == [1, 2, 3, 4]
    assert all(abs(la[s] - lb[s]) <= LOSS_TOL * abs(la[s]) + PRINTED for s in la)
    wa, wb = final_weights(one), final_weights(two)
    assert wa.keys() == wb.keys()
    assert max(rel_l2(wa[k], wb[k]) for k in wa) <= trained_weights_bound(4, QUICK_CHAIN)

    # the handshake: worker 0 became ready first, then worker 1, each with its ready time
    ready = events(two, "worker_ready")
    assert [(e["worker"], e["device"]) for e in ready] == [(0, "cpu"), (1, "cpu")]
    assert all(e["seconds"] >= e["first_step_s"] > 0 for e in ready)
    # the replicas were compared at step 2 and at the end
    assert [e["step"] for e in events(two, "checksum")] == [2, 4]


def test_flat_gradients_stay_in_place_and_the_reduce_sums_bit_identically():
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)) for _ in range(3)]
    for n in nets[1:]:
        n.load_state_dict(nets[0].state_dict())
    xs = [torch.randn(4, 5) for _ in nets]
    expected = [torch.zeros_like(p) for p in nets[0].parameters()]
    replicas = []
    for net, x in zip(nets, xs):
        params = list(net.parameters())
        flat = FlatGrads(params)
        for _ in range(2):  # a second step: zero() then backward must land in the same buffer again
            flat.zero()
            net(x).square().sum().backward()
            flat.collect()
        assert all(p.grad.data_ptr() == v.data_ptr() for p, v in flat.views)
        for e, p in zip(expected, params):
            e += p.grad
        replicas.append(SimpleNamespace(grads=flat, scratch={}))
    for i in range(3):
        reduce_own_chunk(replicas, i)
    for i in range(3):
        gather_chunks(replicas, i)
    buffers = [r.grads.buffers[0] for r in replicas]
    assert all(torch.equal(b, buffers[0]) for b in buffers)  # every replica: the same bits
    for e, p in zip(expected, nets[2].parameters()):
        # three replicas' gradients summed in another order; each a sum over 4 rows
        assert float((p.grad - e).abs().max()) <= bound(torch.float32, 3 * 4, float(e.abs().max()))


@pytest.mark.timeout(120)      # a run that waited on its failed worker would hang here
def test_a_worker_that_fails_in_warm_up_ends_the_run_with_its_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(*faults.setting(fail_worker="1"))
    out = tmp_path / "run"
    assert train(out, *STEPS, "--workers", "2") == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: test hook" in err  # the worker's own traceback, in the log
    assert err.strip().splitlines()[-1].startswith("trainer: error: worker 1 (cpu) failed during warm-up: RuntimeError")
    assert [e["worker"] for e in events(out, "worker_ready")] == [0]
    failed = events(out, "worker_failed")
    assert len(failed) == 1 and failed[0]["worker"] == 1 and failed[0]["phase"] == "warmup"
    assert not step_losses(out)  # nothing was trained


def test_a_worker_that_hangs_in_warm_up_ends_the_run_at_the_timeout(tmp_path):
    # the worker hangs for an hour: ended by the 2 s warm-up timeout (its words below), or by the call's
    p = python_m_trainer(tmp_path / "run", *STEPS, "--workers", "2", "--warmup-timeout", "2",
                         env=faults.env(fail_worker="1:hang"), timeout=120)
    assert p.returncode == 1, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("trainer: error: worker 1 (cpu) did not become ready within 2 s"), p.stderr[-2000:]
    assert "time.sleep(3600)" in p.stderr  # where the hung worker was


def test_replicas_that_diverge_stop_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(*faults.setting(diverge="1:2"))
    out = tmp_path / "run"
    assert train(out, "--steps", "4", "--workers", "2", "--checksum-every", "1") == 1
    err = capsys.readouterr().err.strip()
    assert err == ("trainer: error: replica weights diverged at step 2: worker 1 (cpu) differs from "
                   "worker 0 (cpu) in fc.weight")
    assert max(step_losses(out)) == 2
    assert events(out, "diverged") == [{"event": "diverged", "step": 2, "worker": 1, "tensors": 1}]


# ---- processes (torchrun, gloo) ----------------------------------------------------------------------

def test_torchrun_processes_train_the_same_weights_as_threads(tmp_path, threaded_runs):
    _, two = threaded_runs
    out = tmp_path / "run"
    p = python_m_trainer(out, *STEPS, "--workers", "2", "--topology", "processes")
    assert p.returncode == 0, p.stderr[-3000:]
    la, lb = step_losses(two), step_losses(out)
    assert sorted(lb) == [1, 2, 3, 4]  # rank 0 alone writes metrics: each step once
    assert all(abs(la[s] - lb[s]) <= 1e-6 for s in la)
    wa, wb = final_weights(two), final_weights(out)
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-6
    assert [e["worker"] for e in events(out, "worker_ready")] == [0, 1]
    assert [e["step"] for e in events(out, "checksum")] == [2, 4]
    done = events(out, "done")
    assert len(done) == 1 and done[0]["acceptance_length"] >= 1.0
    # the log reads as in threads: [trainer] lines and JSON lines (rank 0), nothing else on stdout
    assert all(line.startswith(("[trainer] ", "{")) for line in p.stdout.splitlines()), p.stdout


def test_a_failing_rank_fails_the_run_with_its_error_and_root_cause(tmp_path):
    out = tmp_path / "run"
    p = python_m_trainer(out, *STEPS, "--workers", "2", "--topology", "processes", env=faults.env(fail_worker="1"))
    assert p.returncode == 1
    assert "[rank1]: RuntimeError: test hook" in p.stderr  # the rank's traceback, rank-prefixed
    assert "Root Cause (first observed failure)" in p.stderr and "rank      : 1" in p.stderr
    assert list((out / "torchelastic").rglob("error.json"))  # @record wrote the rank's error file


def test_sigterm_to_the_launcher_checkpoints_on_rank_0_and_exits_143(tmp_path):
    out = tmp_path / "run"
    code, _, err = sigterm_once_training(
        [sys.executable, "-m", "trainer", *QUICK, "--out", str(out), "--steps", "100000", "--workers", "2",
         "--topology", "processes"], timeout=90)
    assert code == 143, err[-3000:]
    stopped = events(out, "stopped")
    assert len(stopped) == 1
    latest = checkpoint.find_latest(out)
    assert latest is not None and latest.name == f"step-{stopped[0]['step']:08d}"


def test_a_sigterm_after_the_ranks_stopped_on_their_own_does_not_kill_the_launcher(tmp_path):
    """With several nodes, a stop that reaches another node first ends this node's ranks too (all
    ranks agree on it at a step boundary and exit 143); this node's own SIGTERM may then land after
    torchrun has returned. Here the ranks get SIGTERM directly, then the launcher one every 10 ms
    until it ends: wherever one lands, the launcher exits 143, not killed by the signal."""
    import os
    import signal

    def ranks_first_then_the_launcher_until_it_ends(proc):
        ranks = children(proc.pid)
        assert len(ranks) == 2, ranks
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.01)

    out = tmp_path / "run"
    code, _, err = sigterm_once_training(
        [sys.executable, "-m", "trainer", *QUICK, "--out", str(out), "--steps", "100000", "--workers", "2",
         "--topology", "processes"], timeout=30, stop=ranks_first_then_the_launcher_until_it_ends)
    assert code == 143, err[-3000:]
    assert len(events(out, "stopped")) == 1 and checkpoint.find_latest(out) is not None


# ---- settings --------------------------------------------------------------------------------------

def test_workers_may_share_gpus_under_threads_only():
    from trainer.run.flags import parse
    from trainer.errors import UsageError

    assert parse(["--gpus", "1", "--workers", "4", "--batch-size", "8"]).n_devices == 4  # 4 threads on one GPU
    assert parse(["--gpus", "2", "--topology", "processes"]).n_devices == 2
    with pytest.raises(UsageError, match="one process per GPU"):
        parse(["--gpus", "1", "--workers", "2", "--topology", "processes"])
    with pytest.raises(UsageError, match="a multiple of 2 workers"):
        parse(["--gpus", "2", "--workers", "3", "--batch-size", "6"])


def test_the_launcher_hands_the_ranks_the_same_settings(tmp_path):
    from trainer.run.flags import parse
    from trainer.train.distributed import child_exit_code, config_argv

    cfg = parse([*QUICK, "--out", str(tmp_path), "--workers", "2", "--topology", "processes", "--eval-at-start",
                 "--warmup-timeout", "12.5", "--mask-token-id", "-1", "--target-layers", "1,2"])
    assert parse(config_argv(cfg)) == cfg
    assert child_exit_code([143, 143], 143) == 143 and child_exit_code([-15, 143], -15) == 143
    assert child_exit_code([1, -15], 1) == 1 and child_exit_code([-11], -11) == 139 and child_exit_code([2], 2) == 2


def test_a_warm_up_failure_is_named_by_the_failure_catalog(tmp_path):
    """What a worker thread hits with reduce-overhead on torch < 2.13 (docs/background.md), reproduced in shape."""
    import importlib.util

    from trainer.engine.workers import WorkerFailed

    src = tmp_path / "cudagraph_trees.py"
    src.write_text("def _is_key_in_tls(key):\n    return False\n\n\ndef get_obj(local, attr_name):\n"
                   "    assert _is_key_in_tls(attr_name)\n")
    spec = importlib.util.spec_from_file_location("fake_cudagraph_trees", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        mod.get_obj(None, "tree_manager_containers")
    except AssertionError as e:
        err = WorkerFailed(1, "cuda:1", e, phase="warmup")
    assert err.signature == "cudagraph-trees-tls"
    assert str(err) == "worker 1 (cuda:1) failed during warm-up: AssertionError [signature cudagraph-trees-tls]"


LEAVE = """
import atexit, sys
from trainer.exits import exit_process
atexit.register(lambda: print("finalized", flush=True))
print("done", end="")  # unflushed: exit_process flushes it
exit_process(3)
"""


@pytest.mark.parametrize("rank_env, finalized", [({}, True), ({"LOCAL_RANK": "0", "WORLD_SIZE": "2"}, False)])
def test_a_rank_leaves_without_finalization(rank_env, finalized):
    """A torchrun rank's exit skips interpreter finalization, where Gloo's threads could still free a
    collective's tensors and abort the rank after its work (SIGABRT, about one CPU run in ten); its
    output is flushed and its status kept. Outside a rank, the exit is the usual sys.exit."""
    env = {k: v for k, v in subprocess_env().items() if k not in ("LOCAL_RANK", "WORLD_SIZE")}
    p = subprocess.run([sys.executable, "-c", LEAVE], cwd=ROOT, env={**env, **rank_env}, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 3, p.stderr
    assert p.stdout == ("donefinalized\n" if finalized else "done")
