"""OpenSSH's client configuration (`~/.ssh/config`), read with paramiko's SSHConfig.

hosts.yaml says what it says; for every key it leaves out, the `Host` block matching the host's
`address` fills in (HostName, User, Port, IdentityFile, IdentitiesOnly, ProxyJump,
UserKnownHostsFile, ConnectTimeout), as `ssh pve1` would. So `address: pve1` with a `Host pve1`
block is a complete host. Jump hosts are written as OpenSSH's ProxyJump is: a hosts.yaml entry,
`[user@]host[:port]`, or several hops separated by commas (outermost first).

The ssh_config read is `-F/--ssh-config PATH`, else the inventory's `ssh_config:`, else
`~/.ssh/config` when it exists. Resolution happens once, at load (inventory.parse); the
transport only sees finished Host values.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import threading

from orchestrator.errors import FileError
from orchestrator.inventory import yamlnodes     # the one reading of a local file's bytes

_PARAMIKO_IMPORT = threading.Lock()
SSH_KEYS = ("hostname", "user", "port", "identityfile", "identitiesonly", "proxyjump",
            "userknownhostsfile", "connecttimeout")
_HOP_RE = re.compile(r"^(?:(?P<user>[^@\s]+)@)?(?P<host>\[[^\]]+\]|[^:@\s]+)(?::(?P<port>\d+))?$")


def paramiko():
    """paramiko, imported on first use so `dflash-ops --help` stays fast, and without `invoke`.

    paramiko.config imports invoke inside a try/except, only to run `Match exec` lines of an
    ssh_config; invoke's import pulls in asyncio and unittest.mock, a large share of every
    command's start (docs/decisions.md, "deploy and SSH"). So invoke is hidden for the length of that one
    import and the entry removed again: nothing else in the process is affected, and
    paramiko.config raises its ImportError only if asked to run `Match exec` (reported as one
    line by `load`).

    paramiko's `__init__` also imports importlib.metadata (with email, zipfile and csv behind it,
    again a share of every command's start) only to read its own version for the SSH banner. That
    one call is answered from the name of paramiko's `.dist-info` folder instead, for the length of
    the import (`_metadata_stand_in`); where the folder is not found the real module is imported."""
    # Under a lock: targets connect from parallel threads, and a second thread must neither see
    # a half-imported paramiko in sys.modules nor restore `invoke` while the first imports.
    with _PARAMIKO_IMPORT:
        if "paramiko" in sys.modules:
            return sys.modules["paramiko"]
        hide = "invoke" not in sys.modules
        if hide:
            sys.modules["invoke"] = None       # makes `import invoke` raise ImportError
        stand_in = None if "importlib.metadata" in sys.modules else _metadata_stand_in()
        if stand_in is not None:
            sys.modules["importlib.metadata"] = stand_in
        try:
            import paramiko as p
        finally:
            if hide and sys.modules.get("invoke", 0) is None:
                del sys.modules["invoke"]
            if stand_in is not None and sys.modules.get("importlib.metadata") is stand_in:
                del sys.modules["importlib.metadata"]
        # paramiko's transport thread logs its own failures (with tracebacks) at ERROR; with no
        # handler configured Python prints them to stderr. Every failure reaches the user as one
        # ConnectError line instead; `--debug` configures logging and shows them.
        logging.getLogger("paramiko").addHandler(logging.NullHandler())
        return p


def _metadata_stand_in():
    """A module answering `version("paramiko")` from its installed `.dist-info` folder's name, or
    None where that folder is not beside the package (then paramiko imports the real
    importlib.metadata). Any other name, or any other attribute, is the real module's, imported
    then: nothing paramiko's import asks is answered wrongly."""
    import importlib.util
    import types

    spec = importlib.util.find_spec("paramiko")
    if spec is None or not spec.submodule_search_locations:
        return None
    site = os.path.dirname(list(spec.submodule_search_locations)[0])
    found = [n[len("paramiko-"):-len(".dist-info")] for n in os.listdir(site)
             if n.startswith("paramiko-") and n.endswith(".dist-info")]
    if len(found) != 1:
        return None
    own = found[0]

    def real():
        sys.modules.pop("importlib.metadata", None)
        import importlib.metadata
        return importlib.metadata

    def version(name: str) -> str:
        return own if name == "paramiko" else real().version(name)

    stand_in = types.ModuleType("importlib.metadata")
    stand_in.version = version
    stand_in.__getattr__ = lambda attr: getattr(real(), attr)
    return stand_in


def default_path() -> str | None:
    p = os.path.expanduser("~/.ssh/config")
    return p if os.path.exists(p) else None


class SshConfigError(Exception):
    """The ssh_config could not be read or used; the message says why."""


class SshConfig:
    """One parsed ssh_config file (or none: every lookup is empty)."""

    def __init__(self, path: str | None):
        self.path = path
        self._cfg = None
        if path is None:
            return
        try:        # a regular file of at most 1 MB (a FIFO is refused, not waited on), UTF-8
            text = yamlnodes.decode(yamlnodes.read_bytes(os.path.expanduser(path), yamlnodes.MAX_BYTES,
                                                         "larger than 1 MB"), path)
        except FileError as e:
            raise SshConfigError(str(e)) from None
        try:
            self._cfg = paramiko().SSHConfig.from_text(text)
        except Exception as e:  # noqa: BLE001 - paramiko raises ConfigParseError / ValueError
            raise SshConfigError(f"{path}: {e}") from None

    def lookup(self, alias: str) -> dict:
        """The options that apply to `alias` (lower-case keys), only those dflash-ops uses."""
        if self._cfg is None:
            return {}
        try:
            found = self._cfg.lookup(alias)
        except ImportError:
            raise SshConfigError(f"{self.path}: `Match exec` is not supported") from None
        except Exception as e:  # noqa: BLE001
            raise SshConfigError(f"{self.path}: Host {alias}: {e}") from None
        out = {k: found[k] for k in SSH_KEYS if k in found}
        if out.get("hostname") == alias:
            out.pop("hostname")   # paramiko always fills it in; only a real HostName counts
        return out

    def knows(self, alias: str) -> bool:
        """A `Host` line names this alias literally (not only through a wildcard)."""
        return self._cfg is not None and alias in self._cfg.get_hostnames()


def apply(host, explicit: set[str], cfg: SshConfig):
    """`host` with what the ssh_config says for every key hosts.yaml left out."""
    o = cfg.lookup(host.address)
    new: dict = {}
    if "hostname" in o:
        new["address"] = o["hostname"]
    if "user" in o and "user" not in explicit:
        new["user"] = o["user"]
    if "port" in o and "port" not in explicit:
        new["port"] = _number(o["port"], int, 1, 65535, "Port", host, cfg)
    if "identityfile" in o and "identity_file" not in explicit:
        files = tuple(os.path.expanduser(p) for p in o["identityfile"])
        new["identities"] = files
    if "identitiesonly" in o and "identities_only" not in explicit:
        new["identities_only"] = str(o["identitiesonly"]).lower() == "yes"
    if "userknownhostsfile" in o and "known_hosts" not in explicit:
        new["known_hosts"] = os.path.expanduser(str(o["userknownhostsfile"]).split()[0])
    if "connecttimeout" in o and "connect_timeout" not in explicit:
        new["connect_timeout"] = _number(o["connecttimeout"], float, 0.1, 3600, "ConnectTimeout", host, cfg)
    if "proxyjump" in o and "jump" not in explicit and str(o["proxyjump"]).lower() != "none":
        new["jump"] = str(o["proxyjump"])
    return dataclasses.replace(host, **new) if new else host


def _number(text, kind, low, high, key: str, host, cfg: SshConfig):
    """An ssh_config number within the range hosts.yaml gives its key; SshConfigError otherwise."""
    word = str(text).strip()
    try:
        if len(word) > 18:
            raise ValueError
        value = kind(word)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:       # nan compares false: out of range too
        raise SshConfigError(f"{cfg.path}: {key} {word[:20]!r}{'...' if len(word) > 20 else ''} (for "
                             f"{host.address}): expected a number {low:g}..{high:g}")
    return value


def parse_hop(spec: str) -> tuple[str | None, str, int | None] | None:
    """`[user@]host[:port]` -> (user, host, port); None when it is not one."""
    m = _HOP_RE.match(spec.strip())
    if not m:
        return None
    host = m.group("host").strip("[]")
    port = m.group("port")
    if port is not None and not (len(port) <= 5 and 0 < int(port) < 65536):     # digits first: no 5000-digit int()
        return None
    return m.group("user"), host, int(port) if port else None


def looks_like_address(spec: str) -> bool:
    """A jump written as an address (ProxyJump spelling) rather than a hosts.yaml name."""
    return any(c in spec for c in "@:,.")


def jump_hosts(host, hosts: dict, cfg: SshConfig, make_host, depth: int = 0) -> tuple[dict, str | None]:
    """(hosts to add, the name `host` jumps through) for `host.jump`.

    `jump: a,b` is a then b: b is reached through a, `host` through b. A hop that is not a
    hosts.yaml entry becomes a host named after its spelling (`ops@bastion:2222`; the second hop
    of `a,b` is named `a,b`), set up by the ssh_config like any host; what neither sets is taken
    from the host that names it (known_hosts, identity, connect_timeout)."""
    if not host.jump:
        return {}, None
    if depth > 8:
        raise SshConfigError(f"jump hosts of {host.name} nest more than 8 deep (a ProxyJump loop?)")
    made: dict = {}
    hops = [h.strip() for h in host.jump.split(",") if h.strip()]
    prev = None
    for i, hop in enumerate(hops):
        name = ",".join(hops[:i + 1])
        if i == 0 and hop in hosts:
            prev = hop
            continue
        parsed = parse_hop(hop)
        if parsed is None:
            raise SshConfigError(f"jump {hop[:60]!r}{'...' if len(hop) > 60 else ''}: not [user@]host[:port] "
                                 f"(a port is 1..65535)")
        user, address, port = parsed
        if hop in hosts:   # an entry as a later hop: its settings, this chain's jump
            h = dataclasses.replace(hosts[hop], name=name, jump=prev)
        else:
            h = make_host(name=name, address=address, user=user, port=port, parent=host)
            h = apply(h, {k for k, v in (("user", user), ("port", port)) if v is not None}, cfg)
            if i > 0:
                h = dataclasses.replace(h, jump=prev)
            elif h.jump:   # the first hop's own ProxyJump, as OpenSSH follows it
                more, via = jump_hosts(h, {**hosts, **made}, cfg, make_host, depth + 1)
                made.update(more)
                h = dataclasses.replace(h, jump=via)
        made[name] = h
        prev = name
    return made, prev
