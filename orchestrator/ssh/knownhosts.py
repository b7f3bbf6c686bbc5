"""known_hosts as OpenSSH reads it (sshd(8) "SSH_KNOWN_HOSTS FILE FORMAT"), and the check of a
server's host key against it.

Lines: `[MARKER] PATTERNS KEYTYPE BASE64 [COMMENT]`; PATTERNS are comma-separated names with `*`
and `?` wildcards and `!` negation, `[host]:port` for a port other than 22, or one hashed name
`|1|SALT|HMAC-SHA1`. `@revoked` keys are never accepted; `@cert-authority` keys sign host
certificates, accepted when the certificate is a host certificate, valid now, names this host
among its principals (or names none) and carries the CA's good signature. A line this reader does
not understand is skipped, as OpenSSH skips it. paramiko's own reader raises on any marker line.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import time
from dataclasses import dataclass
from typing import Iterable

from orchestrator.inventory import sshconfig

_paramiko = sshconfig.paramiko
CERT_SUFFIX = "-cert-v01@openssh.com"
_KEY_FIELDS = {"ssh-ed25519": 1, "ssh-rsa": 2, "ssh-dss": 4}     # public-key fields in a certificate
HOST_CERT = 2


@dataclass(frozen=True)
class Entry:
    marker: str | None           # None, "@cert-authority" or "@revoked"
    patterns: str
    keytype: str
    blob: bytes
    line: int

    def matches(self, name: str) -> bool:
        return host_matches(self.patterns, name)


class Rejected(Exception):
    """The key is revoked (`revoked`), differs from the one known (`changed`) or is not known
    (`unknown`); `known` is the entry whose key it differs from, for `changed`."""

    def __init__(self, why: str, known: Entry | None = None):
        super().__init__(why)
        self.why, self.known = why, known


def read(path: str) -> list[Entry]:
    """Every entry of the file that this reader understands; a missing file is an empty list."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse(f.read().splitlines())
    except OSError:
        return []


def parse(lines: Iterable[str]) -> list[Entry]:
    out = []
    for number, text in enumerate(lines, 1):
        fields = text.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = None
        if fields[0].startswith("@"):
            marker, fields = fields[0], fields[1:]
            if marker not in ("@cert-authority", "@revoked"):
                continue
        if len(fields) < 3:
            continue
        try:
            blob = base64.b64decode(fields[2], validate=True)
        except (binascii.Error, ValueError):
            continue
        if _blob_type(blob) != fields[1]:
            continue
        out.append(Entry(marker, fields[0], fields[1], blob, number))
    return out


def host_matches(patterns: str, name: str) -> bool:
    """OpenSSH's match_hostname: some pattern matches and no negated one does."""
    name = name.lower()
    if patterns.startswith("|1|"):
        try:
            _, _, salt, digest = patterns.split("|")
            return hmac.compare_digest(hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest(),
                                       base64.b64decode(digest))
        except (ValueError, binascii.Error):
            return False
    hit = False
    for pattern in patterns.lower().split(","):
        negated = pattern.startswith("!")
        glob = re.escape(pattern[1:] if negated else pattern).replace(r"\*", ".*").replace(r"\?", ".")
        if re.fullmatch(glob, name):
            if negated:
                return False
            hit = True
    return hit


def preferred(entries: list[Entry], name: str, offered: tuple) -> tuple:
    """The host-key algorithms in the order to offer them, as OpenSSH orders them: the types of
    the keys known for this host first; else, when a CA signs for it, certificates first."""
    plain = {e.keytype for e in entries if e.marker is None and e.matches(name)}
    plain |= {"rsa-sha2-512", "rsa-sha2-256"} if "ssh-rsa" in plain else set()
    if plain:
        return tuple(k for k in offered if k in plain) + tuple(k for k in offered if k not in plain)
    if any(e.marker == "@cert-authority" and e.matches(name) for e in entries):
        return tuple(k for k in offered if CERT_SUFFIX in k) + tuple(k for k in offered if CERT_SUFFIX not in k)
    return offered


def check(entries: list[Entry], name: str, principal: str, key) -> str:
    """Accept `key` (a paramiko key the server proved it holds) for `name` ([host]:port form),
    or raise Rejected. Returns how it was accepted: "known" or "certificate"."""
    mine = [e for e in entries if e.matches(name)]
    plain = key.asbytes()
    cert = getattr(key, "public_blob", None)
    cert = cert.key_blob if cert is not None and CERT_SUFFIX in cert.key_type else None
    if any(e.marker == "@revoked" and e.blob == plain for e in mine):
        raise Rejected("revoked")
    if cert is not None:
        signer = _certified(cert, principal)
        if signer is not None and any(e.marker == "@revoked" and e.blob == signer for e in mine):
            raise Rejected("revoked")
        if signer is not None and any(e.marker == "@cert-authority" and e.blob == signer for e in mine):
            return "certificate"
        # As OpenSSH: a certificate that is not accepted leaves its plain key to be checked.
    known = [e for e in mine if e.marker is None]
    if any(e.blob == plain for e in known):
        return "known"
    same_type = [e for e in known if e.keytype == _blob_type(plain)]
    if same_type:
        raise Rejected("changed", same_type[0])
    raise Rejected("unknown")


def _certified(cert: bytes, principal: str) -> bytes | None:
    """The CA key blob that signed `cert`, when it is a host certificate valid now for
    `principal` with a good signature; None otherwise."""
    paramiko = _paramiko()
    try:
        m = paramiko.Message(cert)
        ctype = m.get_text()
        m.get_string()                                        # nonce
        base = ctype[:-len(CERT_SUFFIX)]
        for _ in range(_KEY_FIELDS.get(base, 2)):            # ecdsa: curve name and point
            m.get_string()
        m.get_int64()                                         # serial
        kind = m.get_int()
        m.get_string()                                        # key id
        principals = paramiko.Message(m.get_string())
        names = []
        while principals.get_remainder():
            names.append(principals.get_text())
        after, before = m.get_int64(), m.get_int64()
        critical = m.get_string()
        m.get_string()                                        # extensions
        m.get_string()                                        # reserved
        signer = m.get_string()
        signed = m.get_so_far()
        signature = m.get_string()
        now = int(time.time())
        if kind != HOST_CERT or critical or not after <= now < before or (names and principal not in names):
            return None
        ca = paramiko.PKey.from_type_string(_blob_type(signer), signer)
        return signer if ca.verify_ssh_sig(signed, paramiko.Message(signature)) else None
    except Exception:  # noqa: BLE001 - a certificate this reader cannot read is not accepted
        return None


def _blob_type(blob: bytes) -> str | None:
    if len(blob) < 4:
        return None
    n = int.from_bytes(blob[:4], "big")
    try:
        return blob[4:4 + n].decode("ascii") if 0 < n <= len(blob) - 4 else None
    except UnicodeDecodeError:
        return None
