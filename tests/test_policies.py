"""Compile policies: names, auto resolution from probe.json, per-thread config, real compiles on CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from trainer import cores, policies
from trainer.policies import POLICY_NAMES, PolicyError

from tolerance import assert_close


def in_thread(fn):
    """Run fn in a fresh threading.Thread (as a trainer worker would); re-raise what it raised."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_names_and_cuda_needs():
    assert POLICY_NAMES == ("eager", "inductor", "max-autotune-no-cudagraphs", "reduce-overhead",
                            "cudagraphs-no-trees")
    assert [p for p in POLICY_NAMES if policies.needs_cuda(p)] == ["reduce-overhead", "cudagraphs-no-trees"]
    with pytest.raises(PolicyError, match="unknown compile policy 'fast'"):
        policies.needs_cuda("fast")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_describe_never_mode_and_options_together(name):
    d = policies.describe(name)
    assert d["name"] == name and d["needs_cuda"] == policies.needs_cuda(name) and d["notes"]
    assert not (d["mode"] and d["options"]), "torch refuses mode= with options="
    json.dumps(d)


def test_describe_recipes():
    assert policies.describe("cudagraphs-no-trees")["options"] == {"triton.cudagraphs": True,
                                                                    "triton.cudagraph_trees": False}
    assert policies.describe("reduce-overhead")["mode"] == "reduce-overhead"
    assert policies.describe("max-autotune-no-cudagraphs")["mode"] == "max-autotune-no-cudagraphs"
    assert policies.describe("eager")["mode"] is None


def test_torch_version_parsing():
    assert policies.torch_version("2.13.0+cpu") == (2, 13)
    assert policies.torch_version("2.12.0a0+git1a2b3c") == (2, 12)
    assert policies.torch_version("2.5.1") == (2, 5)
    assert policies.torch_version() == policies.torch_version(torch.__version__)
    with pytest.raises(ValueError):
        policies.torch_version("nightly")


# ---- resolve --------------------------------------------------------------------------------

def test_resolve_named_policy_needs_no_workdir():
    assert policies.resolve("inductor", None) == "inductor"
    with pytest.raises(PolicyError, match="unknown compile policy"):
        policies.resolve("turbo", None)


def test_resolve_auto_without_probe_result(tmp_path):
    with pytest.raises(PolicyError) as e:
        policies.resolve("auto", str(tmp_path))
    assert str(e.value) == f"no probe result in {tmp_path}: run `dflash-ops probe`"
    with pytest.raises(PolicyError, match="run `dflash-ops probe`"):
        policies.resolve("auto", None)


def test_resolve_auto_reads_probe_json(tmp_path):
    (tmp_path / "probe.json").write_text(json.dumps({"policy": "inductor", "torch": torch.__version__,
                                                     "reason": "r", "result": {}, "history": []}))
    assert policies.resolve("auto", str(tmp_path)) == "inductor"
    assert policies.resolve("auto", str(tmp_path), "processes") == "inductor"   # an older probe.json


def test_resolve_auto_for_processes_takes_the_main_thread_choice(tmp_path):
    (tmp_path / "probe.json").write_text(json.dumps({"policy": "inductor", "processes_policy": "reduce-overhead",
                                                     "torch": torch.__version__}))
    assert policies.resolve("auto", str(tmp_path)) == "inductor"
    assert policies.resolve("auto", str(tmp_path), "processes") == "reduce-overhead"


def _probed(tmp_path, cases, policy="inductor"):
    (tmp_path / "probe.json").write_text(json.dumps({"policy": policy, "torch": torch.__version__,
                                                     "result": {"cases": cases}}))
    return str(tmp_path)


def _case(policy, topology, step_ms, first_step_s):
    return {"policy": policy, "topology": topology, "threads": 1, "outcome": "ok", "step_ms": step_ms,
            "first_step_s": first_step_s}


# CPU-like figures: inductor's compile costs minutes to save a fraction of a second a step
CPU_CASES = [_case("eager", "threads", 400.0, 0.5), _case("inductor", "threads", 300.0, 211.7),
             _case("eager", "main", 390.0, 0.4), _case("inductor", "main", 290.0, 150.0)]


def test_auto_takes_eager_for_a_run_shorter_than_the_compile_payback(tmp_path):
    workdir = _probed(tmp_path, CPU_CASES)
    policy, why = policies.resolve_for_run("auto", workdir, "threads", steps=50)
    assert policy == "eager"          # (211.7 - 0.5) s / 0.1 s a step = 2,112 steps to pay back
    assert why == ("auto: eager, not the probe's inductor: this run's 50 steps are fewer than the 2,112 its "
                   "211.2 s compile takes to pay back (300.00 against eager's 400.00 ms a step in the probe); "
                   "--compile-policy inductor compiles anyway")
    assert policies.resolve_for_run("auto", workdir, "threads", steps=5000) == ("inductor", None)
    assert policies.resolve_for_run("auto", workdir, "processes", steps=2200) == ("inductor", None)  # main's cases
    assert policies.resolve_for_run("inductor", workdir, "threads", steps=50) == ("inductor", None)  # named: as is
    assert policies.resolve("auto", workdir) == "inductor"       # no run length: the probe's choice


def test_auto_keeps_the_probes_choice_without_figures_and_refuses_a_compile_that_never_pays(tmp_path):
    assert policies.resolve_for_run("auto", _probed(tmp_path, []), "threads", steps=10) == ("inductor", None)
    slower = [_case("eager", "threads", 100.0, 0.1), _case("inductor", "threads", 120.0, 30.0)]
    policy, why = policies.resolve_for_run("auto", _probed(tmp_path, slower), "threads", steps=10**6)
    assert policy == "eager" and "its 29.9 s compile never pays back (120.00 against eager's 100.00" in why
    assert policies.weigh({}, "eager", "threads", 10) == ("eager", None)


@pytest.mark.parametrize("content, needle", [
    ("{not json", "unreadable probe result"),
    (json.dumps({"policy": "warp-speed"}), "not a known policy"),
    (json.dumps({"policy": "inductor", "torch": "2.0.0"}), "probed with torch 2.0.0"),
])
def test_resolve_auto_refuses_a_bad_or_stale_result(tmp_path, content, needle):
    (tmp_path / "probe.json").write_text(content)
    with pytest.raises(PolicyError, match=needle):
        policies.resolve("auto", str(tmp_path))


# ---- configure_thread -----------------------------------------------------------------------

def _limits():
    import torch._dynamo.config as c
    name = "recompile_limit" if hasattr(c, "recompile_limit") else "cache_size_limit"
    acc = "accumulated_recompile_limit" if hasattr(c, "accumulated_recompile_limit") else "accumulated_cache_size_limit"
    return getattr(c, name), getattr(c, acc)


def test_configure_thread_raises_limits_in_the_calling_thread_idempotently():
    def work():
        policies.configure_thread(8)
        first = _limits()
        policies.configure_thread(8)
        policies.configure_thread(2)          # never lowers
        return first, _limits()

    first, again = in_thread(work)
    assert first == again
    assert first[0] >= 64 and first[1] >= 8 * 256


@pytest.mark.skipif(policies.torch_version() < (2, 12), reason="config is process-global before 2.12")
def test_config_is_per_thread_from_2_12():
    """pytorch#186537: what the main thread sets is not seen by a worker, hence configure_thread
    in every worker."""
    import torch._dynamo.config as c
    with c.patch(recompile_limit=99):
        assert in_thread(lambda: _limits()[0]) != 99
    before = _limits()
    in_thread(lambda: policies.configure_thread(8))
    assert _limits() == before                 # and a worker's setting stays in the worker


# ---- compile_module / step_begin ------------------------------------------------------------

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.nn.functional.silu(self.a(x))).pow(2).mean()


def test_eager_returns_the_module_itself():
    m = Tiny()
    assert policies.compile_module(m, "eager") is m


def test_inductor_compiles_and_trains_in_a_worker_thread():
    torch.manual_seed(0)
    ref, model = Tiny(), Tiny()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(5, 8)

    def work():
        policies.configure_thread(2)
        fn = policies.compile_module(model, "inductor", n_devices=2)
        assert fn is not model
        policies.step_begin("inductor")
        loss = fn(x)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = in_thread(work)
    ref_loss = ref(x)
    ref_loss.backward()
    chain = 8 + 16 + 4 * 5  # the two layers, the mean over 4 x 5 outputs
    assert_close(loss, ref_loss.detach(), n=chain)
    for g, p in zip(grads, ref.parameters()):
        assert_close(g, p.grad, n=2 * chain + 5)  # forward, back, and the sum over the 5 rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
@pytest.mark.parametrize("name", ["reduce-overhead", "cudagraphs-no-trees"])
def test_cuda_policies_refuse_without_a_gpu(name):
    with pytest.raises(PolicyError, match="needs a GPU"):
        policies.compile_module(Tiny(), name)


@pytest.mark.parametrize("name, expected", [
    ("inductor", {}),
    ("max-autotune-no-cudagraphs", {"mode": "max-autotune-no-cudagraphs"}),
    ("reduce-overhead", {"mode": "reduce-overhead"}),
    ("cudagraphs-no-trees", {"options": {"triton.cudagraphs": True, "triton.cudagraph_trees": False}}),
])
def test_compile_arguments(monkeypatch, name, expected):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda module, **kw: calls.append(kw) or ("compiled", module))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    m = Tiny()
    assert policies.compile_module(m, name) == ("compiled", m)
    assert calls == [expected]


def test_step_begin_marks_only_for_trees(monkeypatch):
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    for name in POLICY_NAMES:
        policies.step_begin(name)
    assert marks == [1]


def test_importing_policies_needs_no_torch():
    import subprocess
    import sys
    from pathlib import Path
    code = ("import sys, trainer.policies as p, trainer.cores as c; p.describe('inductor'); "
            "p.resolve('eager', None); c.free_cores(); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                   check=True, timeout=60)


def test_share_cpu_gives_each_worker_its_share_of_the_cores(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        n = len(os.sched_getaffinity(0))
        assert cores.share_cpu(2) == max(1, n // 2) == torch.get_num_threads()
        assert cores.share_cpu(64) == 1 == torch.get_num_threads()
        assert cores.share_cpu(1) == n
        monkeypatch.setenv("OMP_NUM_THREADS", "1")        # the user's word wins
        torch.set_num_threads(1)
        assert cores.share_cpu(1) == 1
    finally:
        torch.set_num_threads(before)


def test_a_training_run_takes_the_threads_asked_for_else_one_per_cpu_worker_alone_or_a_share(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert cores.training_threads(3, 1) is None and torch.get_num_threads() == 3     # asked: on the CPU
        assert cores.training_threads(2, 0) is None and torch.get_num_threads() == 2     # and on GPUs
        said = cores.training_threads(0, 1)
        assert torch.get_num_threads() == 1 and said and "--cpu-threads N asks for more" in said
        torch.set_num_threads(5)
        assert cores.training_threads(0, 0) is None and torch.get_num_threads() == 5     # GPUs: torch's default
        assert cores.training_threads(0, 64) is None and torch.get_num_threads() == 1    # a share of the cores
    finally:
        torch.set_num_threads(before)


def test_max_autotune_is_probed_only_when_named():
    """Its first compile autotunes for minutes (> 190 s on one H200), longer than every other case
    together: the default cases leave it out, and --policies still takes it."""
    chosen = policies.chosen
    assert chosen(None) == ["eager", "inductor", "reduce-overhead", "cudagraphs-no-trees"]
    assert chosen("max-autotune-no-cudagraphs, eager") == ["max-autotune-no-cudagraphs", "eager"]
    with pytest.raises(ValueError, match="unknown warp"):
        chosen("eager,warp")


# ---- CPU threads of the one-process jobs ----------------------------------------------------

def test_free_cores_are_the_cores_less_the_busy_ones_and_at_least_one():
    assert cores.free_cores(busy=0.2, n_cores=2) == 2
    assert cores.free_cores(busy=1.4, n_cores=4) == 3
    assert cores.free_cores(busy=2.0, n_cores=2) == 1      # a loaded laptop: one thread, not two spinning
    assert cores.free_cores(busy=0.0, n_cores=1) == 1


def test_busy_cores_are_the_busy_share_of_the_window_not_the_minutes_mean():
    # /proc/stat's cpu line: user nice system idle iowait irq softirq steal (ticks, all cpus summed)
    a = [1000, 0, 500, 9000, 100, 0, 10, 0]
    assert cores.busy_between(a, [1100, 0, 600, 9100, 100, 0, 10, 0], 2) == pytest.approx(4 / 3)
    assert cores.busy_between(a, [1000, 0, 500, 9200, 100, 0, 10, 0], 2) == 0.0   # idle: a quiet machine
    assert cores.busy_between(a, [1000, 0, 500, 9100, 200, 0, 10, 100], 2) == pytest.approx(2 / 3)  # steal busy,
    assert cores.busy_between(a, a, 2) is None                                                      # iowait free


def test_busy_cores_counts_a_spinning_process_beside_it():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert cores.busy_cores(0.5) >= 0.7
    finally:
        spin.kill()
        spin.wait()


def test_the_build_and_regen_entries_turn_spin_waiting_off_before_torch_loads(tmp_path):
    code = ("import os, sys; import trainer.small_lm, trainer.regen; "
            "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                       cwd=str(Path(__file__).resolve().parents[1]))
    assert r.returncode == 0 and r.stdout.split() == ["PASSIVE", "True"], r.stderr
