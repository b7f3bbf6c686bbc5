"""Reaching an SSH server as OpenSSH does: the TCP dial that waits for the server's greeting, the
keys offered (ssh-agent always asked; an identity file selects the agent's copy first), host-key
fingerprints as `SHA256:...`, and one-line reasons for failures. Used by SshTransport.
"""
from __future__ import annotations

import base64
import hashlib
import os
import socket
import time
from typing import Sequence

from orchestrator.inventory import Host, sshconfig

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


def _dial(host: Host, deadline: float) -> socket.socket:
    """A TCP connection to the host on which the server has started to speak (an SSH server
    sends its version line first), within the deadline. Raises OSError (refused, unreachable,
    timed out) for the caller to retry, _Silent when the greeting never comes."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("timed out")
    conn = socket.create_connection((host.address, host.port), timeout=left)
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


def _reason(e: BaseException) -> str:
    if isinstance(e, socket.timeout):
        return "timed out"
    if isinstance(e, socket.gaierror):
        return f"cannot resolve address ({e.strerror})"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__
