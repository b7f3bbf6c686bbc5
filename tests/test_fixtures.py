"""The test infrastructure itself: the real sshd and the pct stand-in, driven by the real `ssh`.

If these fail, every SSH/pct integration test is suspect; fix these first.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

CLEAR_ENV_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def ssh_argv(sshd, *, known_hosts: Path | None = None, mux: Path | None = None) -> list[str]:
    """The real OpenSSH client, configured only from here (no ~/.ssh/config, no agent keys)."""
    argv = [
        "ssh", "-F", "/dev/null",
        "-i", str(sshd.identity_file), "-o", "IdentitiesOnly=yes",
        "-o", f"UserKnownHostsFile={known_hosts or sshd.known_hosts}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
        "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR",
        "-p", str(sshd.port),
    ]
    if mux is not None:
        # Reuse the module's master connection when it is alive; connect directly when not.
        argv += ["-o", "ControlMaster=no", "-o", f"ControlPath={mux}"]
    return argv + [f"{sshd.user}@{sshd.host}"]


def ssh(sshd, remote: str | list[str], *, input: bytes | None = None,
        known_hosts: Path | None = None, mux: Path | None = None,
        timeout: float = 20) -> subprocess.CompletedProcess:
    """Run ``remote`` on the test node with the real OpenSSH client; no pty, bytes out."""
    if not isinstance(remote, str):
        remote = shlex.join(map(str, remote))
    return subprocess.run(ssh_argv(sshd, known_hosts=known_hosts, mux=mux) + [remote],
                          input=input, capture_output=True, timeout=timeout,
                          stdin=None if input is not None else subprocess.DEVNULL)


@pytest.fixture(scope="module")
def mux(sshd):
    """One multiplexed master connection for the module: each new SSH connection costs a handshake.

    Host-key and connection-drop tests do not use it: they need connections of their own.
    """
    folder = Path(tempfile.mkdtemp(prefix="dflash-mux-"))
    path = folder / "s"
    master = subprocess.Popen(
        ssh_argv(sshd)[:-1] + ["-M", "-N", "-o", f"ControlPath={path}", "-o", "ControlPersist=no",
                               f"{sshd.user}@{sshd.host}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not path.exists() and master.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield path
    finally:
        master.terminate()
        master.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def run(sshd, mux):
    """``run(remote, input=None)``: ssh to the node over the module's master connection."""
    return functools.partial(ssh, sshd, mux=mux)


def pct(fakepct, *args) -> list[str]:
    return [str(fakepct.path), *map(str, args)]


@pytest.fixture
def ct200(fakepct):
    fakepct.create(200)
    return fakepct


# ---- the sshd itself ---------------------------------------------------------------------------

def test_sshd_runs_commands_and_verifies_host_key(sshd):
    done = ssh(sshd, "echo hello; id -u")
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"hello\n0\n"
    assert sshd.host == "127.0.0.1" and sshd.user == "root"
    assert sshd.known_hosts.read_text().startswith(f"[127.0.0.1]:{sshd.port} ssh-ed25519 ")


def test_unknown_host_key_is_refused(sshd):
    done = ssh(sshd, "true", known_hosts=sshd.known_hosts_empty)
    assert done.returncode == 255
    assert b"Host key verification failed" in done.stderr


def test_changed_host_key_is_refused(sshd):
    done = ssh(sshd, "true", known_hosts=sshd.wrong_known_hosts)
    assert done.returncode == 255
    assert b"REMOTE HOST IDENTIFICATION HAS CHANGED" in done.stderr


# ---- pct exec ----------------------------------------------------------------------------------

def test_exec_keep_env_0_gives_only_path_and_container(run, ct200):
    done = run(pct(ct200, "exec", 200, "--keep-env", 0, "--", "env"))
    assert done.returncode == 0, done.stderr
    env = dict(line.split("=", 1) for line in done.stdout.decode().splitlines())
    assert env == {"PATH": CLEAR_ENV_PATH, "container": "lxc"}


def test_exec_keep_env_1_is_the_default_and_leaks_the_session(run, ct200):
    cmd = "DFLASH_LEAK=yes " + shlex.join(pct(ct200, "exec", 200, "--", "env"))
    done = run(cmd)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.decode().splitlines()
    assert "DFLASH_LEAK=yes" in lines and "container=lxc" in lines
    assert any(line.startswith("SSH_CONNECTION=") for line in lines)

    explicit = run("DFLASH_LEAK=yes " + shlex.join(
        pct(ct200, "exec", 200, "--keep-env", 1, "--", "env")))
    assert b"DFLASH_LEAK=yes" in explicit.stdout


def test_exec_on_stopped_container(run, fakepct):
    fakepct.create(201, running=False)
    done = run(pct(fakepct, "exec", 201, "--keep-env", 0, "--", "true"))
    assert done.returncode == 255
    assert done.stderr == b"container '201' not running!\n"


def test_exec_on_unknown_container(run, fakepct):
    done = run(pct(fakepct, "exec", 999, "--", "true"))
    assert done.returncode == 255
    assert done.stderr == f"Configuration file 'nodes/{fakepct.node}/lxc/999.conf' does not exist\n".encode()
    status = run(pct(fakepct, "status", 999))
    assert status.returncode == 255 and b"999.conf' does not exist" in status.stderr


def test_exec_without_double_dash_swallows_inner_options(run, ct200):
    done = run(pct(ct200, "exec", 200, "ls", "-la", "/"))
    assert done.returncode == 255
    assert done.stderr.startswith(b"Unknown option: la\n")
    assert b"pct exec <vmid> [<extra-args>] [OPTIONS]" in done.stderr
    assert done.stdout == b""
    with_dashes = run(pct(ct200, "exec", 200, "--", "ls", "-la", "/"))
    assert with_dashes.returncode == 0, with_dashes.stderr


def test_exec_without_command(run, ct200):
    done = run(pct(ct200, "exec", 200, "--keep-env", 0, "--"))
    assert done.returncode == 255
    assert done.stderr.startswith(b"missing command")


def test_exec_exit_status_and_signals(run, ct200):
    def status_of(script):
        return run(pct(ct200, "exec", 200, "--keep-env", 0, "--", "sh", "-c", script)).returncode

    assert status_of("exit 0") == 0
    assert status_of("exit 3") == 3
    assert status_of("kill -KILL $$") == 128 + 9
    assert status_of("kill -TERM $$") == 128 + 15
    missing = run(pct(ct200, "exec", 200, "--", "no-such-command-xyz"))
    assert missing.returncode == 127
    assert b'Failed to exec "no-such-command-xyz"' in missing.stderr


def test_exec_passes_binary_stdin_through(run, ct200):
    payload = bytes(range(256)) * 1024 + os.urandom(300_000) + b"\r\n\x00\x04\x1a"
    done = run(pct(ct200, "exec", 200, "--keep-env", 0, "--", "cat"), input=payload)
    assert done.returncode == 0, done.stderr
    assert done.stdout == payload


def test_exec_keeps_stdout_and_stderr_apart(run, ct200):
    done = run(pct(ct200, "exec", 200, "--keep-env", 0, "--",
                         "sh", "-c", "echo out; echo err >&2; echo out2"))
    assert done.returncode == 0
    assert done.stdout == b"out\nout2\n"
    assert done.stderr == b"err\n"


def test_containers_do_not_see_each_others_files(run, fakepct):
    fakepct.create(200)
    fakepct.create(201)
    write = run(pct(fakepct, "exec", 200, "--keep-env", 0, "--",
                          "sh", "-c", "mkdir -p /srv/ct/dflash && echo 200 > /srv/ct/dflash/who"))
    assert write.returncode == 0, write.stderr
    assert (fakepct.private(200) / "dflash" / "who").read_text() == "200\n"
    assert fakepct.mount_point == "/srv/ct"

    other = run(pct(fakepct, "exec", 201, "--keep-env", 0, "--", "ls", "-A", "/srv/ct"))
    assert other.returncode == 0 and other.stdout == b""
    again = run(pct(fakepct, "exec", 200, "--keep-env", 0, "--", "cat", "/srv/ct/dflash/who"))
    assert again.stdout == b"200\n"
    assert not Path("/srv/ct/dflash/who").exists(), "the host must not see container files"


def test_detached_command_returns_and_stop_kills_it(run, ct200):
    marker = "dflash-fixture-marker"
    # The job outlives any wait here (600 s) and ends only by the stop below: an exec that held on to
    # it would not return (run's ssh timeout), or would return with the job gone; it returns first.
    script = f"setsid nohup bash -c 'exec -a {marker} sleep 600' >/dev/null 2>&1 </dev/null &"
    done = run(pct(ct200, "exec", 200, "--keep-env", 0, "--", "bash", "-c", script))
    assert done.returncode == 0, done.stderr

    def running():
        pids = []
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
                state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if cmdline.startswith(marker.encode()) and state != "Z":
                pids.append(int(name))
        return pids

    deadline = time.monotonic() + 60       # a wait for its exec, not a bound: the job sleeps 600 s
    while not running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(), "the detached job should be running inside the container"
    ct200.stop(200)
    assert ct200.status(200) == "stopped"
    deadline = time.monotonic() + 60
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running()
    assert run(pct(ct200, "exec", 200, "--", "true")).returncode == 255
    ct200.start(200)
    assert run(pct(ct200, "exec", 200, "--", "true")).returncode == 0


# ---- push / pull / status / list ---------------------------------------------------------------

def test_push_and_pull_one_file(run, ct200, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"\x00payload\xff" * 1000)
    done = run(pct(ct200, "push", 200, src, "/srv/ct/pushed.bin", "--perms", "640"))
    assert done.returncode == 0, done.stderr
    landed = ct200.private(200) / "pushed.bin"
    assert landed.read_bytes() == src.read_bytes()
    assert stat.S_IMODE(landed.stat().st_mode) == 0o640

    back = tmp_path / "back.bin"
    done = run(pct(ct200, "pull", 200, "/srv/ct/pushed.bin", back))
    assert done.returncode == 0, done.stderr
    assert back.read_bytes() == src.read_bytes()


def test_push_failure_inside_the_copy_still_exits_0(run, ct200, tmp_path):
    # Faithful to pct: the worker's error goes to stderr, the exit status stays 0.
    src = tmp_path / "f"
    src.write_text("x")
    done = run(pct(ct200, "push", 200, src, "/srv/ct/no/such/dir/f"))
    assert done.returncode == 0
    assert b"failed to create file: /srv/ct/no/such/dir/f" in done.stderr
    assert not (ct200.private(200) / "no").exists()


def test_push_to_stopped_container_fails(run, fakepct, tmp_path):
    fakepct.create(202, running=False)
    src = tmp_path / "f"
    src.write_text("x")
    done = run(pct(fakepct, "push", 202, src, "/srv/ct/f"))
    assert done.returncode == 255
    assert done.stderr == b"can only push files to a running CT\n"


def test_status_and_list(run, fakepct):
    empty = run(pct(fakepct, "list"))
    assert empty.returncode == 0 and empty.stdout == b""

    fakepct.create(200, name="trainer")
    fakepct.create(105, running=False)
    assert run(pct(fakepct, "status", 200)).stdout == b"status: running\n"
    assert run(pct(fakepct, "status", 105)).stdout == b"status: stopped\n"

    listing = run(pct(fakepct, "list"))
    assert listing.returncode == 0
    fmt = "%-10s %-10s %-12s %-20s\n"
    assert listing.stdout.decode() == (fmt % ("VMID", "Status", "Lock", "Name")
                                       + fmt % (105, "stopped", "", "ct105")
                                       + fmt % (200, "running", "", "trainer"))


# ---- make_inventory ----------------------------------------------------------------------------

def test_make_inventory_writes_the_documented_format(make_inventory, sshd, fakepct):
    yaml = pytest.importorskip("yaml")
    path = make_inventory(
        {"ct200": {"host": "node", "vmid": 200, "python": "/usr/bin/python3",
                   "workdir": "/srv/ct/dflash", "gpus": 0}},
        hosts={"node": {"known_hosts": None}, "bastion": {"address": "127.0.0.1"}},
        default="ct200",
    )
    doc = yaml.safe_load(path.read_text())
    assert doc["default"] == "ct200"
    node = doc["hosts"]["node"]
    assert node == {"address": "127.0.0.1", "port": sshd.port, "user": "root",
                    "identity_file": str(sshd.identity_file), "pct": str(fakepct.path)}
    assert doc["hosts"]["bastion"] == {"address": "127.0.0.1"}
    assert doc["targets"]["ct200"]["vmid"] == 200
    assert make_inventory({}) != path


# ---- dropping connections (last: it kills every live connection) ------------------------

def test_kill_connections_drops_sessions_but_keeps_listening(sshd, ct200):
    # Kills the module's master connection too: keep this test last in the file.
    argv = ssh_argv(sshd) + [shlex.join(pct(ct200, "exec", 200, "--keep-env", 0, "--", "sleep", 30))]
    before = set(sshd.children())
    client = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not set(sshd.children()) - before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(sshd.children()) - before, "no sshd child appeared for the new connection"
        time.sleep(0.3)  # let the session's command start
        killed = sshd.kill_connections()
        assert killed
        assert client.wait(timeout=10) == 255
        assert sshd.process.poll() is None, "the listener must survive"
        assert ssh(sshd, "true").returncode == 0
        assert "Starting session" in sshd.log_text() or "Accepted publickey" in sshd.log_text()
    finally:
        if client.poll() is None:
            client.kill()
        client.wait()
