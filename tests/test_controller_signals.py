"""The controller (`dflash-ops`) interrupted, through a real sshd into the pct stand-in: Ctrl-C,
SIGTERM and SIGKILL of a `launch` while its agent stands at a point of the launch sequence (held there
by DFLASH_OPS_AGENT_FAULTS=pause_at=POINT:PATH) and of a `logs --follow`; the sshd itself
killed under a follow and under an exec; `rm` of a running run and of an id with `../`. Each checks the
target afterwards: processes, slot locks, leftovers, and that the next command works."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_exec_signals import kill_all, left, running_group
from test_follow_agent_killed import agent_of
from trainer_quick import CLI_MAIN, wait_for

from orchestrator import inventory
from orchestrator.deploy import sync as deploy

WORKDIR = "/srv/ct/dflash"
# A stand-in trainer that trains until it is stopped (test_launch_safety.py's).
STUB = "import json, time\nfor i in range(1, 10**6):\n    print(json.dumps({'step': i}), flush=True); time.sleep(.05)\n"
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
IDS = ["SIGINT", "SIGTERM", "SIGKILL"]


def cli(path, *args, timeout=120):
    return subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", str(path), *map(str, args)], capture_output=True,
                          timeout=timeout)


def start(path, *args) -> subprocess.Popen:
    """`dflash-ops -i PATH ARGS` in the background, SIGINT at its default as Ctrl-C finds it."""
    return subprocess.Popen([sys.executable, "-c", CLI_MAIN, "-i", str(path), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def deployed(make_inventory, fakepct, tmp_path, hosts=None) -> Path:
    fakepct.create(200)
    path = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable, "workdir": WORKDIR}},
                          hosts=hosts)
    src = tmp_path / "src"
    (src / "trainer").mkdir(parents=True, exist_ok=True)
    (src / "trainer" / "__init__.py").write_text("")
    (src / "trainer" / "__main__.py").write_text(STUB)
    res = deploy.deploy(inventory.load(str(path)), ["ct200"], source=str(src))["ct200"]
    assert res.ok, res.error
    return path


@pytest.fixture
def inv_path(sshd, fakepct, make_inventory, tmp_path):
    return deployed(make_inventory, fakepct, tmp_path)


def runs_of(path) -> list[dict]:
    r = cli(path, "status", "ct200", "--json")
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)["runs"]


def launch(path, *args):
    return cli(path, "launch", "ct200", "--gpus", "0", "--policy", "eager", *args)


def launch_agents(gate: Path) -> list[int]:
    """The live runs agents (and pct's exec of them) of the launch whose fault names `gate`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if argv.endswith(b"\0launch\0" + WORKDIR.encode() + b"\0") and str(gate).encode() in env \
                and state not in "ZX":
            found.append(int(pid))
    return found


def stop_all(path) -> None:
    for row in runs_of(path):
        if row["state"] == "running":
            assert cli(path, "stop", "ct200", row["run"], "--force").returncode == 0


# ---- launch interrupted at the controller -----------------------------------------------------------

@pytest.mark.parametrize("sig, point", [(signal.SIGINT, "launch.claimed"), (signal.SIGTERM, "launch.held"),
                                        (signal.SIGKILL, "launch.claimed")], ids=IDS)
def test_a_launch_interrupted_at_its_controller_leaves_a_run_that_runs_or_none(inv_path, fakepct, tmp_path,
                                                                             point, sig):
    """launch.claimed: the slot is held by the agent, nothing started; launch.held: the run runs, its
    reply not yet sent. The controller is interrupted there, then the agent goes on (without anyone to
    reply to): afterwards the run runs and ends properly (stop), or nothing runs; no lock stays held by a
    dead process (the next launch takes the slot), no upload or agent is left, and the next launch works."""
    gate = tmp_path / "gate"
    proc = start(inv_path, "launch", "ct200", "--gpus", "0", "--policy", "eager",
                 "--env", f"DFLASH_OPS_AGENT_FAULTS=pause_at={point}:{gate}")
    try:
        wait_for(lambda: gate.exists() or proc.poll() is not None, 60, "the agent to reach " + point)
        assert proc.poll() is None, proc.communicate()
        assert launch_agents(gate)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        gate.unlink(missing_ok=True)                # the agent goes on
    err = err.decode()
    assert "Traceback" not in err, err
    said = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGKILL: -9}[sig]
    assert proc.returncode == said, (proc.returncode, err)
    wait_for(lambda: not launch_agents(gate), 60, "the launch's agent to end")
    rows = runs_of(inv_path)
    assert len(rows) == 1 and rows[0]["state"] == "running", rows       # the launch went through
    run = rows[0]["run"]
    if sig != signal.SIGKILL:      # said in one line: which run, and how to see or stop it
        assert err.strip().splitlines() == [
            f"dflash-ops: ct200: launch interrupted ({sig.name}): run {run} may have started there; "
            f"`dflash-ops status ct200 {run}` says, `dflash-ops stop ct200 {run}` stops it"], err
    else:
        assert err == "", err
    busy = launch(inv_path)                          # its slot is held by the live run
    assert busy.returncode == 1 and f"in use by run {run}" in busy.stderr.decode(), busy.stderr
    stopped = cli(inv_path, "stop", "ct200", run)
    assert stopped.returncode == 0 and b"stopped" in stopped.stdout, stopped.stderr
    assert not list((fakepct.private(200) / "dflash" / "runs").glob(".upload-*"))
    again = launch(inv_path)
    assert again.returncode == 0, again.stderr.decode()
    stop_all(inv_path)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_a_regen_interrupted_mid_upload_starts_nothing_and_leaves_no_upload(inv_path, fakepct, tmp_path, sig):
    """Ctrl-C while the prompts travel (the agent holds a first MiB of 2): the controller closes its
    connection at once (it waited for the whole upload and the launch before), the agent ends at the short
    stream, nothing was started, no upload folder stays; the next regen works. SIGKILL: the same, silently."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i:06d} " + "x" * 100}) + "\n" for i in range(20_000)))
    gate = tmp_path / "gate"
    regen = ["regen", "ct200", "--prompts", prompts, "--model", "/models/unused", "--gpus", "0"]
    proc = start(inv_path, *regen, "--env", f"DFLASH_OPS_AGENT_FAULTS=pause_at=upload.receiving:{gate}")
    try:
        wait_for(lambda: gate.exists() or proc.poll() is not None, 60, "the upload's first MiB")
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        gate.unlink(missing_ok=True)
    err = err.decode()
    if sig == signal.SIGKILL:
        assert (proc.returncode, err) == (-9, ""), err
    else:
        assert proc.returncode == 130 and len(err.strip().splitlines()) == 1, err
        assert "ct200: launch interrupted (SIGINT): run " in err and "may have started there" in err, err
    wait_for(lambda: not launch_agents(gate), 60, "the launch's agent to end")
    runs = fakepct.private(200) / "dflash" / "runs"
    assert runs_of(inv_path) == [] and not list(runs.glob(".upload-*")), list(runs.iterdir())
    r = cli(inv_path, *regen)
    assert r.returncode == 0, r.stderr.decode()
    stop_all(inv_path)


# ---- logs --follow interrupted ----------------------------------------------------------------------

def test_a_follow_interrupted_leaves_the_run_running_and_no_follow_agent(inv_path):
    r = launch(inv_path)
    assert r.returncode == 0, r.stderr.decode()
    run = r.stdout.decode().strip()
    try:
        for sig in SIGNALS:
            proc = start(inv_path, "logs", "ct200", run)
            try:
                wait_for(lambda: proc.stdout.readline().startswith(b'{"step"'), 60, "a line of the log")
                follower = wait_for(lambda: agent_of(run), 30, "the follow agent on the target")
                proc.send_signal(sig)
                _, err = proc.communicate(timeout=30)
            finally:
                proc.kill()
            err = err.decode()
            assert "Traceback" not in err, err
            assert proc.returncode == {signal.SIGKILL: -9}.get(sig, 128 + sig), (sig, proc.returncode, err)
            if sig != signal.SIGKILL:
                assert err.strip().splitlines()[-1] == (
                    f"dflash-ops: stopped following; run {run} goes on (ct200): `dflash-ops logs ct200 {run}` "
                    f"follows it again, `dflash-ops stop ct200 {run}` stops it"), err
            wait_for(lambda: agent_of(run) != follower, 30, "the follow agent to end")
            assert [(x["run"], x["state"]) for x in runs_of(inv_path)] == [(run, "running")]
        now = cli(inv_path, "logs", "ct200", run, "--no-follow", "--tail", "1")
        assert now.returncode == 101 and now.stdout.startswith(b'{"step"'), now
    finally:
        stop_all(inv_path)


# ---- rm of what it must not remove ------------------------------------------------------------------

def test_rm_refuses_a_running_run_and_an_id_that_is_a_path(inv_path, fakepct):
    wd = fakepct.private(200) / "dflash"
    (wd / "x").mkdir()
    (wd / "x" / "run.json").write_text("{}")        # what `runs/../x` would name, were it taken as a run
    r = launch(inv_path)
    assert r.returncode == 0, r.stderr.decode()
    run = r.stdout.decode().strip()
    try:
        for bad in (["../x"], ["../../dflash/x"], ["/srv/ct/dflash/x"], ["--", "--force"], ["..", "x"]):
            r = cli(inv_path, "rm", "ct200", *bad)
            err = r.stderr.decode()
            assert r.returncode == 2 and len(err.strip().splitlines()) == 1 and "is not a run id" in err, (bad, err)
        r = cli(inv_path, "rm", "ct200", run)
        err = r.stderr.decode()
        assert r.returncode == 1 and f"run {run} is running; not removed" in err and "Traceback" not in err, err
        assert (wd / "x" / "run.json").exists() and (wd / "runs" / run / "run.json").exists()
        assert [(x["run"], x["state"]) for x in runs_of(inv_path)] == [(run, "running")]
    finally:
        stop_all(inv_path)


# ---- the node's sshd killed under a follow and an exec ----------------------------------------------

@pytest.fixture
def own_sshd(tmp_path):
    """An sshd of this test alone (the session's serves every other test): killed and started again."""
    sshd_module = sys.modules["dflash_tests_sshd"]      # tests/fixtures/sshd.py, loaded by conftest.py
    server = sshd_module.SshServer.start(tmp_path / "own-sshd")
    try:
        yield server
    finally:
        server.stop()


def kill_sshd(server) -> None:
    """SIGKILL the whole sshd: every connection's and the listener."""
    server.kill_connections()
    server.process.kill()
    server.process.wait()


def restart_sshd(server) -> None:
    """The same sshd again: its config, port and host key (the inventory's known_hosts still holds)."""
    sshd_module = sys.modules["dflash_tests_sshd"]
    proc = subprocess.Popen([sshd_module.SSHD, "-D", "-e", "-f", str(server.root / "sshd_config")],
                            stdin=subprocess.DEVNULL, stdout=server._log_file, stderr=subprocess.STDOUT,
                            start_new_session=True)
    server.process = proc
    assert sshd_module._wait_listening(proc, server.port, 20), server.log_text()[-2000:]


def through(own_sshd, make_inventory, fakepct, tmp_path) -> Path:
    return deployed(make_inventory, fakepct, tmp_path, hosts={"node": {
        "port": own_sshd.port, "identity_file": str(own_sshd.identity_file), "known_hosts": str(own_sshd.known_hosts),
        "connect_timeout": 2}})


def test_sshd_killed_under_an_exec_ends_its_command_and_says_so(own_sshd, make_inventory, fakepct, tmp_path):
    inv = through(own_sshd, make_inventory, fakepct, tmp_path)
    pidfile = fakepct.private(200) / "pid"
    proc = start(inv, "exec", "ct200", "--", "sh", "-c", "echo $$ >/srv/ct/pid; echo started; sleep 60; echo never")
    members: dict[int, str] = {}
    try:
        assert proc.stdout.readline() == b"started\n"
        members = running_group(pidfile)
        kill_sshd(own_sshd)
        out, err = proc.communicate(timeout=60)
        err = err.decode()
        assert proc.returncode == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert err.strip() == "dflash-ops: node: connection dropped", err
        assert left(members, 10) == []      # EOF on the watcher's stdin: the group ended (SIGHUP, then SIGKILL)
    finally:
        proc.kill()
        kill_all(members)
    restart_sshd(own_sshd)
    r = cli(inv, "exec", "ct200", "--", "echo", "again")
    assert (r.returncode, r.stdout) == (0, b"again\n"), r.stderr


def test_sshd_killed_under_a_follow_ends_its_agent_and_the_follow_resumes(own_sshd, make_inventory, fakepct,
                                                                          tmp_path):
    inv = through(own_sshd, make_inventory, fakepct, tmp_path)
    r = launch(inv)
    assert r.returncode == 0, r.stderr.decode()
    run = r.stdout.decode().strip()
    try:
        proc = start(inv, "logs", "ct200", run)
        try:
            wait_for(lambda: proc.stdout.readline().startswith(b'{"step"'), 60, "a line of the log")
            follower = wait_for(lambda: agent_of(run), 30, "the follow agent on the target")
            kill_sshd(own_sshd)
            wait_for(lambda: agent_of(run) != follower, 30, "the follow agent to end with its connection")
            time.sleep(1)                   # a reconnect attempt or two against no sshd
            assert proc.poll() is None
            restart_sshd(own_sshd)
            wait_for(lambda: agent_of(run), 60, "the follow to resume")
            assert cli(inv, "stop", "ct200", run).returncode == 0
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        err = err.decode()
        assert proc.returncode == 103 and "Traceback" not in err, err
        assert f"ct200: run {run}: stopped (SIGTERM)" in err and "connection lost 1 time(s)" in err, err
        assert err.startswith("dflash-ops: connection lost (node: connection dropped); reconnecting in "), err
    finally:
        stop_all(inv)
