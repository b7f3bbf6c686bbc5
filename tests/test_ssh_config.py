"""OpenSSH conventions against real sshds on 127.0.0.1: an ssh_config `Host` alias with
ProxyJump through a second sshd, the ProxyJump spelling in hosts.yaml, an encrypted key held by
an ssh-agent the test starts, SHA256 fingerprints, and paramiko's logging kept out of sight."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator import inventory
from orchestrator.errors import HostKeyError, UsageError
from orchestrator.ssh.session import Session

MAIN = "from orchestrator.cli import main; main()"

def sshd_module():
    return sys.modules["dflash_tests_sshd"]      # tests/fixtures/sshd.py, loaded by conftest.py


@pytest.fixture(scope="module")
def jumpbox(tmp_path_factory):
    """A second sshd: the jump host (it also accepts the main test key and an encrypted key)."""
    server = sshd_module().SshServer.start(tmp_path_factory.mktemp("jump-sshd"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def both_known(sshd, jumpbox, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text(sshd.known_hosts.read_text() + jumpbox.known_hosts.read_text())
    return known


def authorize(server, pub: str) -> None:
    path = server.root / "authorized_keys"
    if pub not in path.read_text():
        with open(path, "a") as f:
            f.write(pub.strip() + "\n")


def cli(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-c", MAIN, *map(str, args)], capture_output=True,
                          timeout=timeout, env=env)


def write_inventory(tmp_path, text: str) -> Path:
    p = tmp_path / "hosts.yaml"
    p.write_text(text)
    return p


def test_host_alias_with_proxyjump_through_a_second_sshd(sshd, jumpbox, fakepct, both_known, tmp_path):
    fakepct.create(200)
    (fakepct.private(200) / "marker").write_text("behind the jump host\n")
    authorize(jumpbox, (Path(str(sshd.identity_file) + ".pub")).read_text())
    before = jumpbox.log_text().count("Accepted publickey")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"""\
Host pve1
    HostName {sshd.host}
    Port {sshd.port}
    User root
    IdentityFile {sshd.identity_file}
    IdentitiesOnly yes
    UserKnownHostsFile {both_known}
    ProxyJump bastion
    ConnectTimeout 7

Host bastion
    HostName {jumpbox.host}
    Port {jumpbox.port}
    IdentityFile {jumpbox.identity_file}
    UserKnownHostsFile {both_known}
""")
    inv_path = write_inventory(tmp_path, f"""\
ssh_config: {cfg}
hosts:
  pve1: {{address: pve1, pct: {fakepct.path}}}
targets:
  ct200: {{host: pve1, vmid: 200, python: {sys.executable}, workdir: /srv/ct/dflash}}
""")
    inv = inventory.load(str(inv_path))
    h = inv.hosts["pve1"]
    assert (h.address, h.port, h.user, h.jump, h.connect_timeout, h.identities_only) == \
        (sshd.host, sshd.port, "root", "bastion", 7.0, True)
    assert inv.hosts["bastion"].port == jumpbox.port
    r = cli("-i", inv_path, "exec", "ct200", "--", "cat", "/srv/ct/marker")
    assert r.returncode == 0, r.stderr
    assert r.stdout == b"behind the jump host\n"
    assert jumpbox.log_text().count("Accepted publickey") > before      # it went through the jump host


def test_dash_F_and_hosts_yaml_keys_override_the_ssh_config(sshd, fakepct, tmp_path):
    cfg = tmp_path / "other_config"
    cfg.write_text(f"Host pve1\n  HostName {sshd.host}\n  Port 1\n  User nobody\n"
                   f"  IdentityFile {sshd.identity_file}\n  UserKnownHostsFile {sshd.known_hosts}\n")
    inv_path = write_inventory(tmp_path, f"""\
hosts:
  pve1: {{address: pve1, port: {sshd.port}, user: root}}
targets:
  n: {{host: pve1, python: {sys.executable}, workdir: /tmp/dflash-n}}
""")
    r = cli("-F", cfg, "-i", inv_path, "exec", "n", "--", "echo", "ok")
    assert r.returncode == 0 and r.stdout == b"ok\n", r.stderr
    # without -F (and no ~/.ssh/config), `pve1` is just a name that does not resolve
    r = cli("-i", inv_path, "exec", "n", "--", "true", env={**os.environ, "HOME": str(tmp_path)})
    assert r.returncode == 1 and b"cannot resolve" in r.stderr and b"Traceback" not in r.stderr


def test_jump_in_proxyjump_spelling_and_several_hops(sshd, jumpbox, fakepct, both_known, make_inventory):
    authorize(jumpbox, (Path(str(sshd.identity_file) + ".pub")).read_text())
    fakepct.create(200)
    for jump in (f"root@{jumpbox.host}:{jumpbox.port}",
                 f"root@{jumpbox.host}:{jumpbox.port},{sshd.host}:{sshd.port}"):
        path = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable,
                                         "workdir": "/srv/ct/dflash"}},
                              hosts={"node": {"jump": jump, "known_hosts": str(both_known)}})
        inv = inventory.load(str(path))
        with Session(inv) as s:
            r = s.transport(inv.target("ct200")).run(["echo", "hi"])
            assert r.stdout == b"hi\n"
            assert s.connections == 1 + len(jump.split(","))


def test_a_jump_name_that_is_neither_entry_nor_address_is_refused():
    with pytest.raises(UsageError, match="names a missing host 'bastoin'"):
        inventory.parse("hosts:\n  bastion: {address: b.invalid}\n  a:\n    address: x\n    jump: bastoin\n")
    with pytest.raises(UsageError, match=r"hosts.a.jump: jump 'a b': not \[user@\]host\[:port\]"):
        inventory.parse("hosts:\n  a:\n    address: x\n    jump: 'a b,c'\n")


@pytest.fixture
def agent(tmp_path):
    """An ssh-agent of this test's own, holding a passphrase-protected key."""
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        key = tmp_path / "id_locked"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "correct horse", "-f", str(key)], check=True)
        askpass = tmp_path / "askpass.sh"
        askpass.write_text("#!/bin/sh\necho 'correct horse'\n")
        askpass.chmod(0o755)
        env = {**os.environ, "SSH_AUTH_SOCK": str(sock), "SSH_ASKPASS": str(askpass),
               "SSH_ASKPASS_REQUIRE": "force", "DISPLAY": ":0"}
        subprocess.run(["ssh-add", str(key)], env=env, check=True, capture_output=True,
                       stdin=subprocess.DEVNULL)
        yield key, {**os.environ, "SSH_AUTH_SOCK": str(sock)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def test_encrypted_key_held_by_the_agent(jumpbox, agent, tmp_path):
    key, env = agent
    authorize(jumpbox, Path(str(key) + ".pub").read_text())
    for identity in (key, Path(str(key) + ".pub")):        # the private file, or its .pub as with ssh -i
        inv_path = write_inventory(tmp_path, f"""\
hosts:
  j: {{address: {jumpbox.host}, port: {jumpbox.port}, identity_file: {identity},
       known_hosts: {jumpbox.known_hosts}, identities_only: true}}
targets:
  n: {{host: j, python: {sys.executable}, workdir: /tmp/dflash-j}}
""")
        r = cli("-i", inv_path, "exec", "n", "--", "echo", "in", env=env)
        assert r.returncode == 0 and r.stdout == b"in\n", r.stderr
    # no agent: the encrypted file alone cannot be used; one line, no traceback
    r = cli("-i", inv_path, "exec", "n", "--", "true", env={k: v for k, v in env.items() if k != "SSH_AUTH_SOCK"})
    assert r.returncode == 1 and b"authentication failed" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_changed_host_key_shows_an_openssh_fingerprint(sshd, fakepct, make_inventory):
    inv = inventory.load(str(make_inventory({"t": {"host": "node"}},
                                            hosts={"node": {"known_hosts": str(sshd.wrong_known_hosts)}})))
    pub = sshd.root / "host.pub"
    pub.write_text(sshd.host_public_key + "\n")
    expected = subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True,
                              check=True).stdout.split()[1]
    assert expected.startswith("SHA256:")
    with Session(inv) as s, pytest.raises(HostKeyError) as e:
        s.transport(inv.target("t"))
    assert f"ssh-ed25519 {expected}" in str(e.value)


def test_a_port_that_resets_after_the_banner_is_one_line_without_debug(make_inventory):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)

    def serve():
        while True:
            try:
                c, _ = server.accept()
            except OSError:
                return
            c.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
            c.recv(100)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            c.close()    # RST mid-handshake

    threading.Thread(target=serve, daemon=True).start()
    path = make_inventory({"t": {"host": "flaky", "workdir": "/tmp/x"}},
                          hosts={"flaky": {"address": "127.0.0.1", "port": server.getsockname()[1],
                                           "connect_timeout": 3}})
    try:
        r = cli("-i", path, "exec", "t", "--", "true")
        debug = cli("-i", path, "--debug", "exec", "t", "--", "true")
    finally:
        server.close()
    assert r.returncode == 1
    assert len(r.stderr.decode().strip().splitlines()) == 1, r.stderr.decode()
    assert b"Traceback" not in r.stderr and b"paramiko" not in r.stderr
    assert b"Traceback" in debug.stderr        # --debug shows what happened


def test_ssh_config_fills_only_what_hosts_yaml_leaves_out(tmp_path):
    cfg = tmp_path / "config"
    cfg.write_text("Host pve1\n  HostName 10.9.8.7\n  User ops\n  Port 2200\n  IdentityFile ~/k1\n"
                   "  IdentityFile /k2\n  ProxyJump a@j1:2022,j2\n  ConnectTimeout 4\n"
                   "Host *\n  UserKnownHostsFile /kh /kh2\n")
    inv = inventory.parse(f"ssh_config: {cfg}\nhosts:\n  pve1: {{address: pve1, port: 22}}\n", "h.yaml")
    h = inv.hosts["pve1"]
    assert (h.address, h.user, h.port, h.connect_timeout, h.known_hosts) == ("10.9.8.7", "ops", 22, 4.0, "/kh")
    assert h.key_files == (os.path.expanduser("~/k1"), "/k2")
    # a@j1:2022 then j2 reached through it, then pve1 through j2
    assert h.jump == "a@j1:2022,j2"
    j1, j2 = inv.hosts["a@j1:2022"], inv.hosts["a@j1:2022,j2"]
    assert (j1.user, j1.address, j1.port, j1.jump) == ("a", "j1", 2022, None)
    assert (j2.address, j2.port, j2.jump) == ("j2", 22, "a@j1:2022")
    assert inv.host_chain(h) == [j1, j2]
