"""Reaching an SSH server as OpenSSH does: the TCP dial that waits for the server's greeting, the
keys offered (ssh-agent always asked; an identity file selects the agent's copy first), host keys
checked against known_hosts as OpenSSH reads it (knownhosts.py), fingerprints as `SHA256:...`,
and one-line reasons for failures that name `user@address:port`, the jump hosts crossed and what
to do; paramiko's own words only under `--debug` (as the chained exception). Used by SshTransport.
"""
from __future__ import annotations

import base64
import hashlib
import os
import socket
import time
from typing import Any, Sequence

from orchestrator.errors import ConnectError, HostKeyError
from orchestrator.inventory import Host, sshconfig
from orchestrator.ssh import knownhosts

_paramiko = sshconfig.paramiko


def fingerprint(key) -> str:
    """`SHA256:base64` (no padding), as OpenSSH prints a key's fingerprint."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _public_blob(path: str) -> bytes | None:
    """The public key blob of an identity file: `PATH.pub` beside it, the file itself when it is
    a `.pub` (as `ssh -i key.pub` does), else the private key when it loads without a passphrase."""
    for pub in ([path] if path.endswith(".pub") else [path + ".pub"]):
        try:
            with open(pub, encoding="utf-8") as f:
                return base64.b64decode(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    try:
        return _paramiko().PKey.from_path(path).asbytes()
    except Exception:  # noqa: BLE001 - encrypted, unreadable, unknown type: no blob to match
        return None


def auth_options(host: Host, agent_keys: Sequence) -> dict:
    """paramiko connect() options that offer keys as OpenSSH does: the agent is always asked;
    an identity file selects the agent's copy of that key first (so a passphrase key held by
    ssh-agent works), then the file itself, then (unless IdentitiesOnly) the agent's other keys;
    with no identity file, the agent's keys and then ~/.ssh/id_*."""
    files = host.key_files
    if not files:
        return {"allow_agent": True, "look_for_keys": True}
    wanted = [b for b in (_public_blob(f) for f in files) if b]
    chosen = next((k for k in agent_keys if k.asbytes() in wanted), None)
    privates = [f[:-4] if f.endswith(".pub") else f for f in files]
    privates = [f for f in privates if os.path.exists(f)]
    return {"pkey": chosen, "key_filename": privates or None,
            "allow_agent": not host.identities_only or not wanted, "look_for_keys": False}


def _agent_keys() -> tuple:
    if not os.environ.get("SSH_AUTH_SOCK"):
        return ()
    try:
        return tuple(_paramiko().Agent().get_keys())
    except Exception:  # noqa: BLE001 - a dead agent socket is no agent
        return ()


class _Silent(Exception):
    """The port accepted the connection but no SSH server spoke: retrying will not help."""


_QUICKACK = getattr(socket, "TCP_QUICKACK", None)     # Linux's


class _QuickAck(socket.socket):
    """A socket that acknowledges what it reads at once (TCP_QUICKACK after every recv; Linux
    clears the flag by itself). sshd leaves Nagle on for commands without a tty: after
    authentication it sends small messages the client does not answer (a hostkeys request, the
    authorized_keys debug lines), then holds the reply to the first channel open until those are
    acknowledged, which a delayed ACK does only when its timer fires. That wait fell on the first
    command of every connection, longer than the command itself over loopback (docs/decisions.md)."""

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data = super().recv(bufsize, flags)
        try:
            self.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)   # type: ignore[arg-type]
        except OSError:
            pass
        return data


def _dial(host: Host, deadline: float) -> socket.socket:
    """A TCP connection to the host on which the server has started to speak (an SSH server
    sends its version line first), within the deadline. Raises OSError (refused, unreachable,
    timed out) for the caller to retry, _Silent when the greeting never comes."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("timed out")
    conn = socket.create_connection((host.address, host.port), timeout=left)
    # paramiko leaves Nagle on: two small messages in a row (a channel's EOF and CLOSE, which it sends
    # together when the command's stdin was held open to its end, exec's) wait for the server's
    # delayed ACK timer, and the next command on the connection behind them. Its packets are whole sends.
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if _QUICKACK is not None:
        conn = _QuickAck(conn.family, conn.type, conn.proto, fileno=conn.detach())
    try:
        conn.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            first = conn.recv(1, socket.MSG_PEEK)
        except socket.timeout:
            raise _Silent(f"port {host.port} accepts connections but no SSH server answers") from None
        if not first:
            raise ConnectionResetError(0, "the server closed the connection before its SSH greeting")
        conn.settimeout(None)
        return conn
    except BaseException:
        conn.close()
        raise


def _known_hosts_name(host: Host) -> str:
    return host.address if host.port == 22 else f"[{host.address}]:{host.port}"


def _reason(e: BaseException | None) -> str:
    """One line for a failure, in this program's words (paramiko's are for --debug)."""
    if isinstance(e, socket.timeout):
        return "timed out"
    if isinstance(e, socket.gaierror):
        return f"cannot resolve address ({e.strerror})"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    if isinstance(e, EOFError) or "Error reading SSH protocol banner" in str(e):
        return "the server closed the connection during the SSH handshake"
    if type(e).__module__.startswith("paramiko"):
        return "the SSH handshake failed (run with --debug for the details)"
    return str(e) or type(e).__name__


CONNECT_TRIES = 3


def where(host: Host, chain: Sequence[Host] = ()) -> str:
    """`user@address:port`, and `via` the jump hosts crossed (outermost first)."""
    hops = " -> ".join(f"{h.name} ({_spec(h)})" for h in chain)
    return _spec(host) + (f" via {hops}" if hops else "")


def _spec(h: Host) -> str:
    return f"{h.user}@{h.address}:{h.port}"


class _Verify:
    """paramiko's host-key policy hook: with no keys loaded into paramiko, every server key comes
    here and is checked against the whole known_hosts (knownhosts.check)."""

    def __init__(self, entries, name: str, principal: str):
        self.entries, self.name, self.principal = entries, name, principal
        self.key = None     # the key the server presented (for the message when it is refused)

    def missing_host_key(self, client, hostname, key) -> None:
        self.key = key
        knownhosts.check(self.entries, self.name, self.principal, key)


def _ordered_transport(entries, name: str):
    """A paramiko Transport that offers host-key algorithms as OpenSSH would (knownhosts.preferred)."""
    base: Any = _paramiko().Transport       # paramiko is imported late: typed as Any

    class Ordered(base):
        @property
        def preferred_keys(self):
            return knownhosts.preferred(entries, name, base.preferred_keys.fget(self))

    return Ordered


def open_client(host: Host, chain: Sequence[Host] = (), sock=None):
    """A connected, authenticated paramiko SSHClient, or ConnectError / HostKeyError in one line.
    One time budget for reaching the server, whatever the number of tries: a host that refuses is
    tried again (it may be rebooting), one that accepts TCP and never speaks SSH is not, and
    neither may take longer than connect_timeout in all."""
    paramiko = _paramiko()
    known = host.known_hosts or os.path.expanduser("~/.ssh/known_hosts")
    entries = knownhosts.read(known)
    name = _known_hosts_name(host)
    at = where(host, chain)
    agent_keys = _agent_keys()
    auth = auth_options(host, agent_keys)
    start = time.monotonic()
    deadline = start + host.connect_timeout
    last: BaseException | None = None
    for attempt in range(CONNECT_TRIES):
        client, verify = paramiko.SSHClient(), _Verify(entries, name, host.address)
        client.set_missing_host_key_policy(verify)
        try:
            conn = sock if sock is not None else _dial(host, deadline)
            client.connect(host.address, port=host.port, username=host.user, timeout=host.connect_timeout,
                           banner_timeout=host.connect_timeout, auth_timeout=host.connect_timeout, sock=conn,
                           transport_factory=_ordered_transport(entries, name), **auth)
            return client
        except _Silent as e:
            client.close()
            raise ConnectError(host.name, f"{e} (gave up after {time.monotonic() - start:.1f} s, "
                                          f"connect_timeout {host.connect_timeout:g} s)", at) from e
        except knownhosts.Rejected as e:
            client.close()
            raise _host_key_error(host, chain, known, e, verify.key) from e
        except (paramiko.AuthenticationException, paramiko.SSHException) as e:
            if isinstance(e, paramiko.AuthenticationException) or "No authentication methods" in str(e):
                client.close()
                raise ConnectError(host.name, auth_failure(host, agent_keys), at) from e
            last = e
        except (OSError, EOFError) as e:
            last = e
        client.close()
        pause = 0.5 * 2 ** attempt   # backoff: 0.5 s, 1 s
        if sock is not None or attempt + 1 == CONNECT_TRIES or time.monotonic() + pause >= deadline:
            break   # a jump channel cannot be redialled from here; the budget is spent
        time.sleep(pause)
    raise ConnectError(host.name, f"{_reason(last)} (gave up after {time.monotonic() - start:.1f} s, "
                                  f"{attempt + 1} tries)", at) from last


def _host_key_error(host: Host, chain: Sequence[Host], known: str, e, key) -> HostKeyError:
    name = _known_hosts_name(host)
    shown = f"{key.get_name()} {fingerprint(key)}" if key is not None else "its key"
    if e.why == "revoked":
        return HostKeyError(host.name, f"host key {shown} of {name} is REVOKED in {known}; refusing to connect "
                                       f"({where(host, chain)})")
    if e.why == "changed":
        return HostKeyError(host.name, (
            f"host key for {name} CHANGED (now {shown}; {known} line {e.known.line} has another; "
            f"{where(host, chain)}); if that is "
            f"expected, remove the old entry with `ssh-keygen -R '{name}' -f {known}`"))
    return HostKeyError(host.name, f"unknown host key {shown} for {name} ({where(host, chain)}; not in {known}); "
                                   f"check its fingerprint, then trust it with {trust_command(host, chain, known)}")


def trust_command(host: Host, chain: Sequence[Host], known: str) -> str:
    """How to add the host's key to known_hosts from this machine: ssh-keyscan when the host is
    reached directly; through the jump hosts (`ssh -J`) when it is not, as only they reach it."""
    if not chain:
        return f"`ssh-keyscan -p {host.port} {host.address} >> {known}`"
    hops = ",".join(_spec(h) for h in chain)
    return (f"`ssh -J {hops} -o UserKnownHostsFile={known} -p {host.port} {host.user}@{host.address} true` "
            f"(answer yes when the fingerprint it shows is {host.name}'s)")


def auth_failure(host: Host, agent_keys: Sequence) -> str:
    """What was offered, and what to do: each identity file (missing, passphrase-protected and
    not in the agent), the agent's keys (or that there is no agent)."""
    parts, hint = [], ""
    agent_blobs = {k.asbytes() for k in agent_keys}
    for path in host.key_files:
        private = path[:-4] if path.endswith(".pub") else path
        if not os.path.exists(path) and not os.path.exists(private):
            parts.append(f"{path} (no such identity)")
        elif _public_blob(path) in agent_blobs:
            parts.append(f"{path} (held by ssh-agent)")
        elif _encrypted(private):
            parts.append(f"{path} (passphrase-protected)")
            hint = hint or (f"; {private} needs its passphrase: add it to an ssh-agent "
                            f"(`eval \"$(ssh-agent)\" && ssh-add {private}`)")
        else:
            parts.append(path)
    if not host.key_files:
        parts.append("~/.ssh/id_* (default identities)")
    if not os.environ.get("SSH_AUTH_SOCK"):
        parts.append("no ssh-agent (SSH_AUTH_SOCK is not set)")
    elif not host.identities_only or not host.key_files:
        parts.append(f"{len(agent_keys)} key(s) of ssh-agent")
    return f"authentication failed for {host.user}; tried {', '.join(parts)}{hint}"


def _encrypted(path: str) -> bool:
    """Whether the private key file needs a passphrase (OpenSSH's format names its cipher; PEM
    says ENCRYPTED), read without trying to load it."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read(1 << 16)
    except OSError:
        return False
    if "ENCRYPTED" in text:
        return True
    if "BEGIN OPENSSH PRIVATE KEY" not in text:
        return False
    body = "".join(line for line in text.splitlines() if line and not line.startswith("-----"))
    try:
        blob = base64.b64decode(body)
    except ValueError:
        return False
    magic = b"openssh-key-v1\0"
    n = int.from_bytes(blob[len(magic):len(magic) + 4], "big")
    return blob.startswith(magic) and blob[len(magic) + 4:len(magic) + 4 + n] != b"none"


def tunnel_failure(e: BaseException, jump: Host, host: Host) -> str:
    """Why a jump host could not open the channel to the next hop, without paramiko's words."""
    code = getattr(e, "code", None)
    what = {1: "it refuses to forward (administratively prohibited: AllowTcpForwarding?)",
            2: f"it could not connect to {host.address}:{host.port} (is that address reachable from {jump.name}?)",
            4: "it is out of resources"}.get(code) if isinstance(code, int) else None
    return f"jump host {jump.name} ({_spec(jump)}): {what or _reason(e)}"
