"""known_hosts as OpenSSH reads it, and SSH errors that say where and what to do, against real
sshds on 127.0.0.1: markers for other hosts, hashed and wildcard entries, an @revoked key, host
certificates signed by an @cert-authority (a second sshd with a HostCertificate), a jump host
(the test sshd crossed twice), a missing or passphrase-protected identity."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator import inventory
from orchestrator.errors import ConnectError, HostKeyError
from orchestrator.ssh import knownhosts
from orchestrator.ssh.session import Session

MAIN = "from orchestrator.cli import main; main()"


def sshd_module():
    return sys.modules["dflash_tests_sshd"]      # tests/fixtures/sshd.py, loaded by conftest.py


def cli(*args, env=None, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", MAIN, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def keygen(path: Path, passphrase: str = "") -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-C", "", "-f", str(path)], check=True)
    return " ".join(Path(str(path) + ".pub").read_text().split()[:2])


def connect(make_inventory, known: Path, **host):
    inv = inventory.load(str(make_inventory({"t": {"host": "node"}},
                                            hosts={"node": {"known_hosts": str(known), **host}})))
    with Session(inv) as s:
        return s.ssh("node").client.get_transport().host_key_type


# --- known_hosts ---------------------------------------------------------------------------------

def test_markers_garbage_and_other_hosts_lines_are_skipped_not_fatal(sshd, make_inventory, tmp_path):
    other = keygen(tmp_path / "other")
    known = tmp_path / "known_hosts"
    known.write_text("\n".join([
        "# a comment", "",
        f"@cert-authority *.example.com {other}",
        f"@revoked other.example.com {other}",
        f"@unknown-marker [{sshd.host}]:{sshd.port} {other}",
        "justonefield",
        f"[{sshd.host}]:{sshd.port} ssh-ed25519 !!!not-base64!!!",
        f"[{sshd.host}]:{sshd.port} ssh-rsa {other.split()[1]}",          # type and key disagree
        f"|1|bad|hash {other}",
        f"[{sshd.host}]:{sshd.port} {sshd.host_public_key} a comment",
    ]) + "\n")
    assert connect(make_inventory, known) == "ssh-ed25519"
    r = cli("-i", make_inventory({"t": {"host": "node", "workdir": "/tmp/x"}},
                                 hosts={"node": {"known_hosts": str(known)}}), "exec", "t", "--", "echo", "ok")
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr


def test_hashed_and_wildcard_entries_match_negation_excludes(sshd, make_inventory, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text(f"[{sshd.host}]:{sshd.port} {sshd.host_public_key}\n")
    subprocess.run(["ssh-keygen", "-H", "-f", str(known)], check=True, capture_output=True)
    assert known.read_text().startswith("|1|")
    assert connect(make_inventory, known) == "ssh-ed25519"
    known.write_text(f"[127.0.0.?]:{sshd.port},other {sshd.host_public_key}\n")
    assert connect(make_inventory, known) == "ssh-ed25519"
    known.write_text(f"[127.0.0.*]:*,![{sshd.host}]:{sshd.port} {sshd.host_public_key}\n")
    with pytest.raises(HostKeyError, match="unknown host key"):
        connect(make_inventory, known)


def test_a_revoked_key_is_refused_even_when_also_listed(sshd, make_inventory, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text(f"[{sshd.host}]:{sshd.port} {sshd.host_public_key}\n"
                     f"@revoked * {sshd.host_public_key}\n")
    with pytest.raises(HostKeyError, match=r"host key ssh-ed25519 SHA256:\S+ of \[127.0.0.1\]:\d+ is REVOKED"):
        connect(make_inventory, known)


def test_host_matching_is_openssh_s():
    assert knownhosts.host_matches("a,b.example.com", "B.example.com")
    assert knownhosts.host_matches("*.example.com,!bad.example.com", "good.example.com")
    assert not knownhosts.host_matches("*.example.com,!bad.example.com", "bad.example.com")
    assert knownhosts.host_matches("[h]:2222", "[h]:2222") and not knownhosts.host_matches("[h]:2222", "h")
    assert not knownhosts.host_matches("[h]:2222", "[h]:22222")


@pytest.fixture(scope="module")
def certd(tmp_path_factory):
    """A second sshd whose host key carries a certificate signed by a CA of this test's."""
    root = tmp_path_factory.mktemp("cert-sshd")
    server = sshd_module().SshServer.start(root)
    ca = root / "ca"
    ca_pub = keygen(ca)
    server.ca, server.ca_pub = ca, ca_pub
    server.sign = lambda principal: _sign_and_reload(server, principal)
    with open(root / "sshd_config", "a") as f:
        f.write(f"HostCertificate {root / 'ssh_host_ed25519_key-cert.pub'}\n")
    server.sign(server.host)
    try:
        yield server
    finally:
        server.stop()


def _sign_and_reload(server, principal: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-s", str(server.ca), "-I", "dflash-test-host", "-h", "-n", principal,
                    "-V", "-5m:+1h", str(server.root / "ssh_host_ed25519_key.pub")], check=True, capture_output=True)
    before = server.log_text().count("Server listening")
    server.process.send_signal(signal.SIGHUP)                  # sshd re-reads its config and keys
    deadline = time.monotonic() + 10
    while server.log_text().count("Server listening") == before and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_host_certificate_signed_by_a_known_ca_is_accepted(certd, make_inventory, tmp_path):
    known = tmp_path / "known_hosts"
    other_ca = keygen(tmp_path / "other_ca")
    hosts = {"address": certd.host, "port": certd.port, "identity_file": str(certd.identity_file)}
    known.write_text(f"@cert-authority [{certd.host}]:{certd.port} {certd.ca_pub}\n")
    assert connect(make_inventory, known, **hosts) == "ssh-ed25519-cert-v01@openssh.com"
    known.write_text(f"@cert-authority [{certd.host}]:{certd.port} {other_ca}\n")     # another CA signed it
    with pytest.raises(HostKeyError, match="unknown host key"):
        connect(make_inventory, known, **hosts)
    known.write_text(f"@cert-authority * {certd.ca_pub}\n@revoked * {certd.ca_pub}\n")
    with pytest.raises(HostKeyError, match="REVOKED"):
        connect(make_inventory, known, **hosts)
    certd.sign("someone-else.example.com")                     # a certificate for another host
    try:
        known.write_text(f"@cert-authority * {certd.ca_pub}\n")
        with pytest.raises(HostKeyError, match="unknown host key"):
            connect(make_inventory, known, **hosts)
    finally:
        certd.sign(certd.host)


# --- errors that say where and what to do --------------------------------------------------------

def one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 1, (r.stdout, r.stderr)
    out = (r.stdout + r.stderr).strip()
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in out and "paramiko" not in out.lower() and "Exception" not in out, out
    assert "Connect failed" not in out and "No authentication methods" not in out, out
    return out


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refused_port_names_user_host_and_port(sshd, make_inventory):
    port = free_port()
    path = make_inventory({"t": {"host": "node", "workdir": "/tmp/x"}}, hosts={"node": {"port": port}})
    out = one_line(cli("-i", path, "exec", "t", "--", "true"))
    assert f"node: cannot connect to root@127.0.0.1:{port}: Connection refused" in out


def test_behind_a_jump_host_the_hop_chain_and_the_jumps_words(sshd, make_inventory):
    port = free_port()
    path = make_inventory({"t": {"host": "inner", "workdir": "/tmp/x"}}, hosts={"inner": {
        "address": "127.0.0.1", "port": port, "identity_file": str(sshd.identity_file),
        "known_hosts": str(sshd.known_hosts), "jump": "node"}})
    out = one_line(cli("-i", path, "exec", "t", "--", "true"))
    assert (f"inner: cannot connect to root@127.0.0.1:{port} via node (root@127.0.0.1:{sshd.port}): jump host "
            f"node (root@127.0.0.1:{sshd.port}): it could not connect to 127.0.0.1:{port} "
            f"(is that address reachable from node?)") in out, out
    debug = cli("-i", path, "--debug", "exec", "t", "--", "true")
    assert "Connect failed" in debug.stderr                    # paramiko's own words: with --debug only


def test_unknown_key_behind_a_jump_host_is_trusted_through_the_jump(sshd, make_inventory):
    path = make_inventory({"t": {"host": "inner", "workdir": "/tmp/x"}}, hosts={"inner": {
        "address": "127.0.0.1", "port": sshd.port, "identity_file": str(sshd.identity_file),
        "known_hosts": str(sshd.known_hosts_empty), "jump": "node"}})
    out = one_line(cli("-i", path, "exec", "t", "--", "true"))
    assert "unknown host key ssh-ed25519 SHA256:" in out and f"for [127.0.0.1]:{sshd.port}" in out
    assert (f"`ssh -J root@127.0.0.1:{sshd.port} -o UserKnownHostsFile={sshd.known_hosts_empty} "
            f"-p {sshd.port} root@127.0.0.1 true`") in out, out
    assert "ssh-keyscan" not in out                            # this machine may not reach the node


def test_a_missing_identity_file_is_named(sshd, make_inventory, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    missing = tmp_path / "no-such-key"
    path = make_inventory({"t": {"host": "node", "workdir": "/tmp/x"}},
                          hosts={"node": {"identity_file": str(missing)}})
    out = one_line(cli("-i", path, "exec", "t", "--", "true", env=env))
    assert (f"node: cannot connect to root@127.0.0.1:{sshd.port}: authentication failed for root; tried "
            f"{missing} (no such identity), no ssh-agent (SSH_AUTH_SOCK is not set)") in out, out


def test_a_passphrase_key_without_an_agent_says_ssh_add(sshd, make_inventory, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    key = tmp_path / "id_locked"
    keygen(key, "correct horse")
    path = make_inventory({"t": {"host": "node", "workdir": "/tmp/x"}}, hosts={"node": {"identity_file": str(key)}})
    out = one_line(cli("-i", path, "exec", "t", "--", "true", env=env))
    assert f"tried {key} (passphrase-protected)" in out, out
    assert f'add it to an ssh-agent (`eval "$(ssh-agent)" && ssh-add {key}`)' in out, out


def test_the_session_raises_connect_error_naming_where_it_dialled(sshd, make_inventory):
    port = free_port()
    inv = inventory.load(str(make_inventory({"t": {"host": "node"}}, hosts={"node": {"port": port}})))
    with Session(inv) as s, pytest.raises(ConnectError) as e:
        s.transport(inv.target("t"))
    assert str(e.value).startswith(f"node: cannot connect to root@127.0.0.1:{port}: "), str(e.value)
