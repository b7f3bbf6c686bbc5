"""Shared fixtures: a real sshd on 127.0.0.1, the pct stand-in and real LXC containers (driven through
tests/fixtures/pcts.py's handles), and inventories pointing at them.

    def test_something(sshd, fakepct, make_inventory):
        fakepct.create(200)                      # running CT 200, files under fakepct.private(200)
        inv = make_inventory({"ct200": {"host": "node", "vmid": 200,
                                        "python": sys.executable, "workdir": "/srv/ct/dflash"}})

Inside a container, /srv/ct (``fakepct.mount_point``) is that container's private folder; the rest
of the filesystem is the host's, so ``sys.executable`` works as a target's python.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import shutil
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
FAKEPCT_SRC = TESTS / "fakepct" / "pct"


def _load_fixture(name: str):
    # Loaded by path: `tests` is not a package and `fixtures` is a common top-level name.
    spec = importlib.util.spec_from_file_location(f"dflash_tests_{name}", TESTS / "fixtures" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


sshd_module = _load_fixture("sshd")
lxcnode_module = _load_fixture("lxcnode")     # real LXC containers (tests/fixtures/lxcnode.py, tests/realpct/pct)
pcts = _load_fixture("pcts")                  # the handles the tests drive them by: FakePct, LxcPct


# ---- order: the slowest files first ------------------------------------------------------------

# `make test` runs two workers, each one test file at a time, handed out in collection order
# (--dist loadfile --no-loadscope-reorder). These files take the longest, so they start first, longest
# first: a long file started last would run on while the other workers have nothing left. The order
# follows each file's measured time on the 2-core machine (docs/benchmarks.md, the suite's rows, has
# the current figures; this list's earlier ones are in this file's git history): re-measure and
# reorder when a file's cost changes much. Each line says what makes the file long.
SLOW_FILES = (
    "test_real_containers.py",      # real LXC containers (longer on a loaded machine; building the base, once)
    "test_probe_program.py",        # the probe's policy x topology matrix, inductor compiled cold
    "test_bench_decode_remote.py",  # bench-decode through the agent, and its kill sequence
    "test_runs_lifecycle.py",       # runs launched, resumed, stopped and removed through the real sshd
    "test_play_remote.py",          # playbooks against the real sshd, torch installed into a venv
    "test_nodes.py",                # one job over two namespaced nodes, each with its sshd
    "test_probe_schedule.py",       # timed stand-in cases side by side
    "test_export_remote.py",        # export streamed from a trained run
    "test_launch_gate.py",          # the pipeline gate's runs, then the run, through the real sshd
    "test_controller_signals.py",   # launch/regen/follow interrupted, a private sshd killed and restarted
    "test_trainer_topology.py",     # threads against torchrun ranks
    "test_launch_safety.py",        # launches whose agent is killed; reconnects
    "test_gate.py",                 # the pipeline gate: trainer, export and three decoders, for real
    "test_job_ends_as_one.py",      # two-node jobs over loopback gloo, each failure ended
    "test_probe_remote.py",         # the probe through the runs agent
    "test_numerics.py",             # compiled steps against eager (after the probe: its inductor graphs)
    "test_trainer_e2e.py",          # the trainer end to end
    "test_export_signals.py",       # exports interrupted at each side
    "test_small_target.py",         # the small real target, regen and specdec
    "test_trainer_run.py",          # trainer runs in this process and as programs
    "test_tensorboard.py",          # a run's event files brought home, a real TensorBoard serving them
    "test_regen_remote.py",         # regen launched as a run
    "test_train_step_bench.py",     # the train-step benchmark
    "test_transport_ssh.py",        # the ssh transport against the real sshd, silent hosts included
    "test_export_parity.py",        # an export against the reference implementation
    "test_distill.py",              # two trainer runs, a trace
    "test_muon.py",                 # torchrun against threads, two runs
    "test_deploy_reliability.py",   # deploy under concurrency, damage and full disks
    "test_logs_terminal.py",        # logs followed on a terminal
    "test_dpace.py",                # a trainer run, a trace
    "test_trainer_kernels.py",      # FlexAttention compiles
    "test_deploy.py",               # deploys through the real sshd
)


# ---- one inductor cache for the suite ------------------------------------------------------------

# Every process of the suite (pytest's workers and what they start, the probe's cases among them: the
# probe keeps a cache folder it is given) compiles into one inductor cache: a graph compiled once is a
# cache hit for every later process that compiles it. test_numerics trains at the probe's CPU shape, so
# its compiled runs find the graphs that test_probe_program's probe compiled (SLOW_FILES starts the probe
# first, numerics after it on a worker). Before, the probe compiled into its own workdir and numerics into
# torch's default folder: the same cold compile twice in every session. The folder is kept, as torch's
# default one is (a later session on this machine finds its graphs; a fresh machine compiles each once);
# inductor keys what it caches by the graph, the torch build and its config. A TORCHINDUCTOR_CACHE_DIR
# set by the caller is kept.
COMPILE_CACHE_ENV = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


def pytest_configure(config):
    # A suite started in the background by a non-interactive shell (`make test &`, a CI step's `&`)
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it: the tests of
    # Ctrl-C (exec's, play's, a Hold's) would send SIGINT to processes that ignore it and wait for
    # ever. A handler here is reset to the default in every program the tests start.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:   # xdist's workers inherit the controller's
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                             f"dflash-ops-tests-inductor-{os.getuid()}")
    for key, value in COMPILE_CACHE_ENV.items():
        os.environ.setdefault(key, value)


# ---- signal dispositions: each test leaves them as it found them ---------------------------------

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@pytest.fixture(autouse=True)
def _signal_dispositions(request):
    """A test that runs a program's main in this process (a launcher, an agent's verb) may leave a
    signal ignored, handled or blocked in it; every program a later test of this worker starts would
    inherit that. Restored after each test, and said as a warning naming the test."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    yield
    changed = [s.name for s in SIGNALS if signal.getsignal(s) is not saved[s] and saved[s] is not None]
    if signal.pthread_sigmask(signal.SIG_BLOCK, ()) != mask:
        changed.append("the signal mask")
    if changed:
        for s in SIGNALS:
            if saved[s] is not None:
                signal.signal(s, saved[s])
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        warnings.warn(f"{request.node.nodeid} left {', '.join(changed)} changed in the test process (restored)")


# ---- the quick room ----------------------------------------------------------------------------

# `make check` (README) runs the tests marked `quick` here: every test of a file outside SLOW_FILES that
# starts no sshd, pct stand-in or real container and is not marked slow, plus one real-sshd smoke of
# deploy -> launch -> follow. What it leaves to `make test`: the remote lifecycle, signals and
# reconnects against the real sshd, the probe's compiles, the trainer's end-to-end runs.
HEAVY_FIXTURES = {"sshd", "fakepct", "make_inventory", "lxcpct", "make_lxc_inventory", "smoke_target"}
HEAVY_FILES = ("test_trainer_run.py", "test_heartbeat.py", "test_cpu_shards.py", "test_export_provenance.py",
               "test_export_parity.py", "test_fp8.py", "test_export_speculators.py", "test_cpu_capabilities.py",
               "test_real_containers.py", "test_drafter_bench.py", "test_rank_mesh.py", "test_flex_bench.py",
               "test_gemm_bench.py", "test_gate.py")
HEAVY_NAMES = ("compile", "inductor")     # a test that compiles: too long for the quick room
QUICK_SMOKE = "test_runs_lifecycle.py::test_launch_detaches_then_logs_follow_to_success"
# Early in SLOW_FILES for their long tests, whose short ones (no sshd, no container) stay in the quick room.
QUICK_TOO = ("test_launch_gate.py", "test_transport_ssh.py")


def quick(item) -> bool:
    if item.nodeid.endswith(QUICK_SMOKE):
        return True
    return ((item.path.name not in SLOW_FILES or item.path.name in QUICK_TOO) and item.path.name not in HEAVY_FILES
            and not any(word in item.name for word in HEAVY_NAMES)
            and not HEAVY_FIXTURES & set(getattr(item, "fixturenames", ()))
            and item.get_closest_marker("slow") is None and item.get_closest_marker("lxc") is None)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))    # stable: the rest keep their order
    for item in items:
        if quick(item):
            item.add_marker(pytest.mark.quick)


# ---- sshd ------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def sshd():
    """A real OpenSSH server on 127.0.0.1 (see tests/fixtures/sshd.py for the attributes).

    Session-scoped: tests that drop connections with ``sshd.kill_connections()`` leave the
    listener running for the next test.
    """
    root = Path(tempfile.mkdtemp(prefix="dflash-sshd-"))
    server, error = None, None
    try:
        server = sshd_module.SshServer.start(root)
    except Exception as e:  # noqa: BLE001 - any failure here means "no sshd", said once, clearly
        error = f"{type(e).__name__}: {e}"
    if server is None:
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(f"could not start the test sshd on 127.0.0.1 ({error})", pytrace=False)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


# ---- pct stand-in ----------------------------------------------------------------------------

def install_fakepct(dest: Path, node: str = "pve1") -> pcts.FakePct:
    """Copy the stand-in into ``dest`` with its pct.json and a shebang for this interpreter."""
    dest.mkdir(parents=True, exist_ok=True)
    state = dest / "state"
    state.mkdir(exist_ok=True)
    exe = dest / "pct"
    lxcnode_module.pinned_script(FAKEPCT_SRC, exe)
    (dest / "pct.json").write_text(json.dumps({"root": str(state), "node": node}))
    os.makedirs("/srv/ct", exist_ok=True)
    return pcts.FakePct(path=exe, root=state, node=node)


@pytest.fixture
def fakepct(tmp_path_factory):
    """A pct stand-in with no containers; torn down with every process its containers started."""
    pct = install_fakepct(tmp_path_factory.mktemp("fakepct"))
    try:
        yield pct
    finally:
        for vmid in pct.vmids():
            try:
                if pct.status(vmid) == "running":
                    pct.stop(vmid)
            except Exception:  # noqa: BLE001 - teardown must try every container
                pass


# ---- inventories -----------------------------------------------------------------------------

def _plain(value):
    """Paths become strings so the inventory is plain YAML."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _yaml_dump(data: dict) -> str:
    data = _plain(data)
    try:
        import yaml
    except ImportError:  # JSON is YAML too; only the line numbers in error messages differ
        return json.dumps(data, indent=2) + "\n"
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


@pytest.fixture(scope="session")
def trainer_source(tmp_path_factory):
    """Only the trainer package, copied once per session: what a run needs, quick to deploy."""
    from trainer_quick import copy_trainer

    return copy_trainer(tmp_path_factory.mktemp("trainer-src"))


@pytest.fixture
def deployed_ct200(fakepct, make_inventory, trainer_source):
    """Factory: ``deployed_ct200(gpus=0) -> Path`` of a hosts.yaml naming CT 200 (the stand-in pct, this
    python, /srv/ct/dflash) with the trainer deployed there."""
    def make(gpus: int = 0) -> Path:
        from orchestrator import inventory
        from orchestrator.deploy import sync as deploy

        fakepct.create(200)
        path = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable,
                                         "workdir": "/srv/ct/dflash", "gpus": gpus}})
        res = deploy.deploy(inventory.load(str(path)), ["ct200"], source=str(trainer_source))["ct200"]
        assert res.ok, res.error
        return path

    return make


@pytest.fixture
def make_inventory(tmp_path, sshd, fakepct):
    """Factory: ``make_inventory(targets, hosts=None, default=None) -> Path`` of a hosts.yaml.

    A host ``node`` is predefined (the test sshd + the stand-in pct). ``hosts`` adds entries or
    overrides keys of ``node``; a key set to None is dropped (e.g. {"node": {"known_hosts": None}}).
    """
    counter = [0]

    def make(targets: dict, hosts: dict | None = None, default: str | None = None) -> Path:
        all_hosts = {
            "node": {
                "address": sshd.host,
                "port": sshd.port,
                "user": sshd.user,
                "identity_file": str(sshd.identity_file),
                "known_hosts": str(sshd.known_hosts),
                "pct": str(fakepct.path),
            }
        }
        for name, entry in (hosts or {}).items():
            merged = {**all_hosts.get(name, {}), **entry}
            all_hosts[name] = {k: v for k, v in merged.items() if v is not None}
        doc = {}
        if default is not None:
            doc["default"] = default
        doc["hosts"] = all_hosts
        doc["targets"] = targets
        counter[0] += 1
        path = tmp_path / ("hosts.yaml" if counter[0] == 1 else f"hosts-{counter[0]}.yaml")
        path.write_text(_yaml_dump(doc))
        return path

    return make


@pytest.fixture
def exec_targets(sshd, fakepct, make_inventory):
    """An inventory of two containers (ct200, ct201) and the node itself, over the real sshd, for exec."""
    fakepct.create(200)
    fakepct.create(201)
    return make_inventory({
        "ct200": {"host": "node", "vmid": 200, "python": sys.executable, "workdir": "/srv/ct/dflash"},
        "ct201": {"host": "node", "vmid": 201, "python": sys.executable, "workdir": "/srv/ct/dflash"},
        "node": {"host": "node", "python": sys.executable, "workdir": "/tmp/dflash-node"},
    })


@pytest.fixture
def wd(tmp_path):
    """A runs-agent workdir whose one live release's trainer is a stub (tests/runs_agent_stub.py)."""
    from runs_agent_stub import kill_leftovers, make_workdir

    path = make_workdir(tmp_path)
    yield path
    kill_leftovers(path)


# ---- the small real target, built once --------------------------------------------------------

@pytest.fixture(scope="session")
def smoke_target(tmp_path_factory):
    """(DFLASH_OPS_CACHE folder, the small real target at its `smoke` size in it: trainer/run/small_target.py),
    built once for the whole session: both xdist workers use one folder beside their own tmp folders,
    and small_lm.ensure's lock makes a second caller wait for the first's build instead of building it
    again (test_small_target and test_regen_remote each built their own before). Built in this process
    on one torch thread, as test_small_target's deterministic-build check builds it."""
    import torch

    from trainer.run import small_target as small_lm

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "dflash-ops-cache"
    root.mkdir(exist_ok=True)
    old_cache, old_threads = os.environ.get("DFLASH_OPS_CACHE"), torch.get_num_threads()
    os.environ["DFLASH_OPS_CACHE"] = str(root)
    torch.set_num_threads(1)
    try:
        folder = small_lm.ensure("smoke", log=lambda s: None)
    finally:
        torch.set_num_threads(old_threads)
        if old_cache is None:
            os.environ.pop("DFLASH_OPS_CACHE", None)
        else:
            os.environ["DFLASH_OPS_CACHE"] = old_cache
    return root, folder


# ---- real LXC containers (tests/fixtures/lxcnode.py, tests/realpct/pct) ----------------------

@pytest.fixture(scope="session")
def lxc_base(request):
    """The cached base rootfs (built the first time on this machine, with progress lines on the terminal).
    A machine where LXC cannot run is one clear failure line, never a skip."""
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def log(line: str) -> None:
        if capture is not None:
            with capture.global_and_fixture_disabled():
                print(line, file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    error = None
    try:
        base = lxcnode_module.ensure_base(log)
        lxcnode_module.probe_start(base)
    except lxcnode_module.LxcUnavailable as e:
        error = str(e)
    if error is not None:      # outside the except: no chained traceback, the one line alone
        pytest.fail(f"real containers unavailable: {error}", pytrace=False)
    return base


def _lxcpct(tmp_path_factory, lxc_base):
    root = Path(tempfile.mkdtemp(prefix="dflash-lxc-"))
    node = lxcnode_module.LxcNode.create(root, lxc_base)
    try:
        yield pcts.LxcPct(node)
    finally:
        node.destroy_all()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def lxcpct(tmp_path_factory, lxc_base):
    """Real LXC containers behind a pct with pve-container's semantics (tests/realpct/pct); FakePct's
    interface plus ``shutdown``. Every container is destroyed afterwards."""
    yield from _lxcpct(tmp_path_factory, lxc_base)


@pytest.fixture(scope="module")
def lxcpct_module(tmp_path_factory, lxc_base):
    """``lxcpct`` shared by a module's tests (containers are slow to set up; reuse one where state allows)."""
    yield from _lxcpct(tmp_path_factory, lxc_base)


def lxc_inventory_writer(folder: Path, sshd, pct_path: Path):
    """``make(targets, hosts=None, default=None) -> Path``: make_inventory's factory over the real sshd
    and a real-container pct; a target without ``python`` gets the container venv's."""
    counter = [0]

    def make(targets: dict, hosts: dict | None = None, default: str | None = None) -> Path:
        all_hosts = {"node": {"address": sshd.host, "port": sshd.port, "user": sshd.user,
                              "identity_file": str(sshd.identity_file), "known_hosts": str(sshd.known_hosts),
                              "pct": str(pct_path)}}
        for name, entry in (hosts or {}).items():
            merged = {**all_hosts.get(name, {}), **entry}
            all_hosts[name] = {k: v for k, v in merged.items() if v is not None}
        targets = {name: ({"python": lxcnode_module.VENV_PYTHON, **t} if "vmid" in t else t)
                   for name, t in targets.items()}
        doc = {"default": default} if default is not None else {}
        doc.update(hosts=all_hosts, targets=targets)
        counter[0] += 1
        path = Path(folder) / ("hosts.yaml" if counter[0] == 1 else f"hosts-{counter[0]}.yaml")
        path.write_text(_yaml_dump(doc))
        return path

    return make


@pytest.fixture
def make_lxc_inventory(tmp_path, sshd, lxcpct):
    """make_inventory over real containers: host ``node`` is the test sshd + ``lxcpct``'s pct."""
    return lxc_inventory_writer(tmp_path, sshd, lxcpct.path)
