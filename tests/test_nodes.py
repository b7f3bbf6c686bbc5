"""One DDP job over two Proxmox nodes, for real: two network namespaces this test creates, each a
"node" with its own sshd and pct stand-in, one container on each. The nodes reach each other only
over their own training link (the rendezvous and gloo cross it); the controller reaches each node's
sshd over a management link. Driven by the `dflash-ops` CLI as a user would.

    root namespace ── mgmt A ── node A: sshd, pct, CT 200 (training address .1 on tr0) ─┐
                   └─ mgmt B ── node B: sshd, pct, CT 300 (training address .2 on tr0) ─┴─ training link

The namespaces, servers and every process they hold are removed when the module's tests end, also
on failure. Without the right to create namespaces the tests skip, saying so.
"""
from __future__ import annotations

import json
import re
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import install_fakepct, sshd_module
from trainer_quick import CLI_MAIN, children, copy_trainer, tiny_run_config, wait_for

WORKDIR = "/srv/ct/dflash"
STEPS = 6
TINY = tiny_run_config(steps=STEPS, checksum_every=2, batch_size=4)


# ---- two nodes in network namespaces -------------------------------------------------------------

def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Node:
    def __init__(self, name: str, ns: str, mgmt: str, train: str, vmid: int):
        self.name, self.ns, self.mgmt, self.train, self.vmid = name, ns, mgmt, train, vmid
        self.sshd = None
        self.pct = None

    def private(self) -> Path:
        return self.pct.private(self.vmid)

    def rundir(self, run: str) -> Path:
        return self.private() / "dflash" / "runs" / run


def _remove_namespace(ns: str) -> None:
    """Kill whatever still runs in the namespace, then delete it (its links go with it)."""
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in done.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _free_base(first: int) -> int:
    """The first base from `first` on (in steps of 4, wrapping within 16..175) whose three subnets
    10.213.base..base+2 no link of this machine holds: a run killed before its teardown leaves its
    namespaces and links behind, and a second pair on the same subnet takes the other's traffic."""
    held = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    for k in range(40):
        base = 16 + (first - 16 + 4 * k) % 160
        if not any(f"10.213.{base + i}." in held for i in range(3)):
            return base
    return first


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """Nodes A and B (addresses 10.213.X.Y of this test's own), each with sshd and pct, CT 200 on A
    and CT 300 on B running; torn down with everything they started."""
    tag = os.getpid() % 100000
    base = _free_base(16 + (os.getpid() % 40) * 4)   # third octets base..base+2: mgmt A, mgmt B, training
    spec = [Node("pve-a", f"dfo{tag}a", f"10.213.{base}.1", f"10.213.{base + 2}.1", 200),
            Node("pve-b", f"dfo{tag}b", f"10.213.{base + 1}.1", f"10.213.{base + 2}.2", 300)]
    made: list[str] = []
    try:
        try:
            _ip("netns", "add", spec[0].ns)
        except (RuntimeError, OSError) as e:
            pytest.skip(f"cannot create network namespaces here ({e}); the multi-node tests need root")
        made.append(spec[0].ns)
        _ip("netns", "add", spec[1].ns)
        made.append(spec[1].ns)
        for i, n in enumerate(spec):
            _ip("-n", n.ns, "link", "set", "lo", "up")
            outer = f"dfo{tag}{'ab'[i]}"                    # the controller's end of the management link
            _ip("link", "add", outer, "type", "veth", "peer", "name", "mg0", "netns", n.ns)
            _ip("addr", "add", f"{n.mgmt[:-2]}.254/24", "dev", outer)
            _ip("link", "set", outer, "up")
            _ip("-n", n.ns, "addr", "add", f"{n.mgmt}/24", "dev", "mg0")
            _ip("-n", n.ns, "link", "set", "mg0", "up")
        a, b = spec
        _ip("-n", a.ns, "link", "add", "tr0", "type", "veth", "peer", "name", "tr0", "netns", b.ns)
        for n in spec:
            _ip("-n", n.ns, "addr", "add", f"{n.train}/24", "dev", "tr0")
            _ip("-n", n.ns, "link", "set", "tr0", "up")
        for n in spec:
            root = tmp_path_factory.mktemp(n.name)
            n.sshd = sshd_module.SshServer.start(root / "sshd", host=n.mgmt, netns=n.ns)
            n.pct = install_fakepct(root / "pct", node=n.name)
            n.pct.create(n.vmid)
        yield spec
    finally:
        for n in spec:
            if n.pct is not None:
                for vmid in n.pct.vmids():
                    try:
                        if n.pct.status(vmid) == "running":
                            n.pct.stop(vmid)
                    except Exception:  # noqa: BLE001 - teardown tries every container
                        pass
            if n.sshd is not None:
                n.sshd.stop()
        for ns in made:
            _remove_namespace(ns)


def inventory_doc(nodes, **target_overrides) -> dict:
    hosts, targets = {}, {}
    for n in nodes:
        hosts[n.name] = {"address": n.mgmt, "port": n.sshd.port, "user": "root",
                         "identity_file": str(n.sshd.identity_file), "known_hosts": str(n.sshd.known_hosts),
                         "pct": str(n.pct.path), "connect_timeout": 10}
        t = {"host": n.name, "vmid": n.vmid, "python": sys.executable, "workdir": WORKDIR, "gpus": 0,
             "train_address": n.train}      # gloo and NCCL are given tr0, the interface holding it
        t.update(target_overrides.get(f"ct{n.vmid}", {}))
        targets[f"ct{n.vmid}"] = {k: v for k, v in t.items() if v is not None}
    return {"hosts": hosts, "targets": targets, "groups": {"pair": [f"ct{n.vmid}" for n in nodes]}}


class Cluster:
    def __init__(self, nodes, path: Path, cfg: Path):
        self.nodes, self.path, self.cfg = nodes, path, cfg
        self.launched: list[str] = []

    def cli(self, *args, timeout: float = 180, inventory: Path | None = None):
        return subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", str(inventory or self.path),
                               *map(str, args)], capture_output=True, timeout=timeout)

    def launch(self, *args, targets: str = "pair") -> str:
        r = self.cli("launch", targets, "--topology", "processes", "--gpus", "0", "--workers", "1",
                     "--policy", "eager", "--config", self.cfg, *args)
        assert r.returncode == 0, r.stderr.decode()[-3000:]
        self.launched.append(r.stdout.decode().strip())
        return self.launched[-1]

    def ended(self, run: str) -> None:
        """`run` is shown to have ended: nothing of it is left to stop (each stop costs a connection
        to both nodes)."""
        self.launched.remove(run)

    def stop_leftovers(self) -> None:
        """Kill whatever a failed test left running, so that the next test's launch is not refused
        for a busy slot (one failure stays one)."""
        while self.launched:
            self.cli("stop", "pair", self.launched.pop(), "--force", timeout=120)

    def record(self, node, run) -> dict:
        return json.loads((node.rundir(run) / "run.json").read_text())

    def exit(self, node, run) -> dict:
        return json.loads((node.rundir(run) / "exit.json").read_text())


@pytest.fixture(scope="module")
def cluster(nodes, tmp_path_factory):
    import yaml

    from orchestrator import inventory
    from orchestrator.deploy import sync as deploy

    tmp = tmp_path_factory.mktemp("cluster")
    path = tmp / "hosts.yaml"
    path.write_text(yaml.safe_dump(inventory_doc(nodes), sort_keys=False))
    cfg = tmp / "tiny.yaml"
    cfg.write_text(TINY)
    source = copy_trainer(tmp / "src")
    res = deploy.deploy(inventory.load(str(path)), ["ct200", "ct300"], source=str(source))
    assert all(r.ok for r in res.values()), {k: r.error for k, r in res.items()}
    return Cluster(nodes, path, cfg)


@pytest.fixture(autouse=True)
def _no_run_left_behind(request):
    yield
    if "cluster" in request.fixturenames:
        request.getfixturevalue("cluster").stop_leftovers()


def reference_run(tmp: Path, cfg: Path) -> Path:
    """The same job on one node, in this process: 2 workers (threads), the same config, global batch
    and seed. Threads and torchrun processes train bit-identical weights on the CPU
    (test_trainer_topology.py), so this is the one-node run, without two more torch start-ups."""
    from trainer.exits import run
    from trainer.train import train_entry

    out = tmp / "one"
    assert run(train_entry, ["--config", str(cfg), "--out", str(out), "--gpus", "0", "--workers", "2",
                             "--compile-policy", "eager"]) == 0
    return out


def final_weights(out: Path) -> dict:
    from trainer.run import checkpoint

    return checkpoint.load(checkpoint.find_latest(out)).model


def test_two_nodes_train_one_job_to_the_weights_of_one_node(cluster, tmp_path):
    torch = pytest.importorskip("torch")
    a, b = cluster.nodes
    run = cluster.launch()
    follow = subprocess.Popen([sys.executable, "-c", CLI_MAIN, "-i", str(cluster.path), "logs", "ct200", run,
                               "--follow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        one = reference_run(tmp_path, cluster.cfg)            # meanwhile, the one-node run
        out, err = (x.decode() for x in follow.communicate(timeout=180))
    finally:
        follow.kill()
    assert follow.returncode == 0, err[-3000:]
    cluster.ended(run)
    # each node's lines, led by the node: the launchers' as [node], the ranks' as [node/rankN]
    # (rank 0's metrics included; which node runs rank 0 is the rendezvous' choice; the other
    # ranks log nothing in a healthy run)
    assert "[ct300] [trainer] topology processes: torchrun --nnodes=2" in out
    assert re.search(r'^\[ct(200|300)/rank0\] \{"step": ', out, re.M), out[-2000:]
    assert f"run {run}: succeeded on 2 nodes" in err and f"steps {STEPS}" in err, err[-2000:]
    r = cluster.cli("logs", "ct300", run, "--no-follow", "--json")     # from either node: the job
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and (doc["state"], doc["step"], doc["targets"]) == ("succeeded", STEPS, ["ct200", "ct300"])
    assert set(doc["nodes"]) == {"ct200", "ct300"} and doc["root_cause"] is None
    # one record, one lock per node; the same run id; A hosted the rendezvous
    ra, rb = cluster.record(a, run), cluster.record(b, run)
    assert ra["nodes"]["targets"] == rb["nodes"]["targets"] == ["ct200", "ct300"]
    assert "--rdzv-host" in ra["command"] and "--rdzv-host" not in rb["command"]
    assert f"{a.train}:29400" in ra["command"] and rb["user_env"] == {}
    # found in the container: the interface holding train_address, for gloo and (exactly that name) NCCL
    assert {k: rb["env"][k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")} == {
        "GLOO_SOCKET_IFNAME": "tr0", "NCCL_SOCKET_IFNAME": "=tr0"}
    # both nodes end with identical weights, the weights of the one-node run
    wa, wb, w1 = final_weights(a.rundir(run)), final_weights(b.rundir(run)), final_weights(one)
    assert wa.keys() == wb.keys() == w1.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert max(float((wa[k] - w1[k]).abs().max()) for k in wa) <= 1e-6
    # status shows the run once, with its nodes
    r = cluster.cli("status", "ct300", "--json")
    rows = [x for x in json.loads(r.stdout)["runs"] if x["run"] == run]
    assert len(rows) == 1 and rows[0]["state"] == "succeeded" and rows[0]["step"] == STEPS
    assert sorted(n["target"] for n in rows[0]["nodes"]) == ["ct200", "ct300"]
    # report reads rank 0's node, whichever target is named (export finds it the same way:
    # nodes.rank0_of; not run here, its torch start-up on the target costs seconds)
    rank0 = rows[0]["target"]
    assert rank0 in ("ct200", "ct300") and [n["node_rank"] for n in rows[0]["nodes"] if n["target"] == rank0] == [0]
    other = "ct300" if rank0 == "ct200" else "ct200"   # the node without rank 0: report must look elsewhere
    r = cluster.cli("report", other, run, "-o", tmp_path / "r.png", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["points"] >= STEPS, r.stderr.decode()
    assert json.loads(r.stdout)["target"] == rank0
    # rm from one node removes the job on both: a half left behind would be a run `logs` cannot find
    r = cluster.cli("rm", "ct300", run, "--dry-run", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and [x["run"] for x in doc["removed"]] == [run], r.stderr.decode()
    assert [(n["target"], [x["run"] for x in n["removed"]]) for n in doc["nodes"]] == [("ct200", [run])]
    assert a.rundir(run).exists() and b.rundir(run).exists()
    r = cluster.cli("rm", "ct300", run)
    out = r.stdout.decode()
    assert r.returncode == 0 and f"ct300: removed run {run}" in out
    assert f"ct200: removed the job's half of run {run}" in out
    assert not a.rundir(run).exists() and not b.rundir(run).exists()
    assert cluster.cli("logs", "ct200", run, "--no-follow").returncode == 102


def _steps(node, run) -> list[int]:
    path = node.rundir(run) / "train.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    lines = (re.sub(r"^\[rank\d+\]: ", "", line) for line in text.splitlines())  # rank 0's: `[rank0]: `
    return [json.loads(line)["step"] for line in lines if line.startswith('{"step": ')]


LONG = ["--", "--steps", "100000"]


def test_stop_ends_both_nodes_with_a_checkpoint_the_run_resumes_and_a_killed_node_fails_it(cluster):
    """One run, three acts (each launch costs seconds of start-up on both nodes): stop checkpoints on
    both; --resume continues both from that checkpoint; SIGKILL to node B's rank fails the run on both,
    the root cause named."""
    from trainer.run import checkpoint

    a, b = cluster.nodes
    run = cluster.launch(*LONG)
    wait_for(lambda: len(_steps(a, run)) >= 3, 120, "training on both nodes")
    r = cluster.cli("stop", "ct300", run)
    assert r.returncode == 0, r.stderr.decode()
    for n in (a, b):
        ex = cluster.exit(n, run)
        assert (ex["state"], ex["exit_code"]) == ("stopped", 143), ex
    sa = checkpoint.find_latest(a.rundir(run)).name
    assert sa == checkpoint.find_latest(b.rundir(run)).name        # the same checkpoint on each node
    stopped_at = int(sa.split("-")[1])
    # Node B loses its copy (a wiped disk): on --resume the ranks find that out and rank 0's
    # checkpoint travels to B; the replicas' checksums every 2 steps prove both continue alike.
    shutil.rmtree(b.rundir(run) / "checkpoints")

    r = cluster.cli("launch", "ct200", "--resume", run)                 # one node of the two: refused
    assert r.returncode == 1 and b"ran on ct200,ct300; resume it on the same target(s)" in r.stderr, r.stderr
    r = cluster.cli("launch", "pair", "--resume", run)
    assert r.returncode == 0 and r.stdout.decode().strip() == run, r.stderr.decode()
    wait_for(lambda: any(s > stopped_at + 3 for s in _steps(a, run)), 120, "the resumed run training")
    log = (a.rundir(run) / "train.log").read_text()
    assert f'{{"event": "resume", "step": {stopped_at}}}' in log
    after = log.split(f'{{"event": "resume", "step": {stopped_at}}}')[1]
    assert '{"event": "checksum", "step": ' in after and "diverged" not in after
    assert cluster.record(b, run)["attempt"] == 2

    ranks = children(cluster.record(b, run)["pid"])             # node B's launcher's rank process
    assert ranks, "node B's rank process"
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    r = cluster.cli("logs", "ct200", run, "--follow")
    err = r.stderr.decode()
    assert r.returncode == 100, err[-3000:]
    assert f"run {run}: failed on 2 nodes" in err and "first failure: ct300/rank1" in err, err[-3000:]
    assert "(signature killed)" in err or "(signature worker-failed)" in err, err[-3000:]
    assert cluster.exit(a, run)["state"] == cluster.exit(b, run)["state"] == "failed"
    assert cluster.exit(b, run)["root_cause"]["rank"] == 1
    r = cluster.cli("status", "pair", "--json")                    # nothing left running on either node
    row = next(x for x in json.loads(r.stdout)["runs"] if x["run"] == run)
    assert row["state"] == "failed" and {n["state"] for n in row["nodes"]} == {"failed"}
    cluster.ended(run)


def test_a_launch_refused_on_one_node_is_undone_on_the_other(cluster, tmp_path):
    import yaml

    a, b = cluster.nodes
    path = tmp_path / "hosts.yaml"                     # nothing deployed in CT 300's workdir here
    path.write_text(yaml.safe_dump(inventory_doc(cluster.nodes, ct300={"workdir": "/srv/ct/empty"})))
    before = set(os.listdir(a.private() / "dflash" / "runs"))
    r = cluster.cli("launch", "ct200,ct300", "--topology", "processes", "--gpus", "0", "--policy", "eager",
                    "--config", cluster.cfg, inventory=path)
    err = r.stderr.decode()
    assert r.returncode == 1 and "ct300: no release deployed" in err and "undone on ct200" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert set(os.listdir(a.private() / "dflash" / "runs")) == before         # no run left behind
    assert not list((a.private() / "dflash" / "locks").glob("*.json"))        # no lock held


def test_several_targets_need_processes_and_a_training_address(cluster, tmp_path):
    import yaml

    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump(inventory_doc(cluster.nodes, ct300={"train_address": None})))
    r = cluster.cli("launch", "pair", "--topology", "processes", "--policy", "eager", inventory=path)
    assert r.returncode == 2 and b"ct300: a launch over several targets needs `train_address:`" in r.stderr
    r = cluster.cli("launch", "pair", "--policy", "eager")
    assert r.returncode == 2 and b"add --topology processes" in r.stderr
    assert len(r.stderr.decode().strip().splitlines()) == 1


def test_a_node_whose_ranks_would_advertise_loopback_is_refused_before_anything_starts(cluster, tmp_path):
    """The node's hostname here resolves to a loopback address, as in many containers: gloo would
    advertise it to the other node. Launch names tr0 to gloo and NCCL (the other tests train through
    it); a node where that cannot work is refused in one line, and the other node undone."""
    import yaml

    a, b = cluster.nodes
    runs = a.private() / "dflash" / "runs"
    listed = lambda: set(os.listdir(runs)) if runs.exists() else set()  # noqa: E731 (none before a first run)
    wrong = {"ct300": {"env": {"GLOO_SOCKET_IFNAME": "lo"}}, "ct300 ": {"train_address": a.train[:-1] + "9"}}
    said = {"ct300": "ct300: GLOO_SOCKET_IFNAME=lo names a loopback interface",
            "ct300 ": f"ct300: train_address {a.train[:-1]}9 is not an address of this container (its addresses: "}
    for key, override in wrong.items():
        path = tmp_path / "hosts.yaml"
        path.write_text(yaml.safe_dump(inventory_doc(cluster.nodes, ct300=override)))
        before = listed()
        r = cluster.cli("launch", "pair", "--topology", "processes", "--gpus", "0", "--policy", "eager",
                        "--config", cluster.cfg, inventory=path)
        err = r.stderr.decode()
        assert r.returncode == 1 and said[key] in err and "undone on ct200" in err, err
        assert len(err.strip().splitlines()) == 1
        assert listed() == before


def test_ranks_that_cannot_meet_end_the_job_within_the_mesh_timeout(cluster, tmp_path):
    """ct200's ranks advertise their management address (GLOO_SOCKET_IFNAME=mg0, not loopback, so
    launch lets it through), which ct300 cannot reach: ct300's connect fails at once, while ct200's
    rank, waiting for ct300 to connect, is not ended by gloo's own timeout (it waited on for minutes).
    It ends as soon as ct300's failure is recorded in the job's store (at the latest at the mesh
    timeout), naming it, and `logs` ends with the first failure named."""
    import yaml

    quick = {"DFLASH_MESH_TIMEOUT_S": "15"}
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump(inventory_doc(cluster.nodes, ct300={"env": quick},
                                                 ct200={"env": {**quick, "GLOO_SOCKET_IFNAME": "mg0"}})))
    r = cluster.cli("launch", "pair", "--topology", "processes", "--gpus", "0", "--workers", "1", "--policy", "eager",
                    "--config", cluster.cfg, inventory=path)
    assert r.returncode == 0, r.stderr.decode()
    run = r.stdout.decode().strip()
    cluster.launched.append(run)
    # before, gloo's own timeout held ct200's rank for many minutes: the call's timeout would end the test
    logs = cluster.cli("logs", "ct200", run, inventory=path, timeout=170)
    out, err = logs.stdout.decode(), logs.stderr.decode()
    assert logs.returncode == 100, err[-3000:]
    cluster.ended(run)
    assert f"run {run}: failed on 2 nodes" in err and "first failure: ct300/rank1: " in err, err[-3000:]
    assert "[ct200/rank0] [trainer] rank 0: ending (exit 3): rank 1 (node 10.213." in out, out[-3000:]
