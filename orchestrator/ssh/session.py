"""One SSH connection per host for the life of one dflash-ops command, and the transport that
reaches each target through it (pct for a container, env for variables)."""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator, Mapping

from orchestrator.errors import ConnectError
from orchestrator.inventory import Inventory, Target
from orchestrator.ssh.connect import tunnel_failure, where
from orchestrator.ssh.pct import PctTransport
from orchestrator.ssh.transport import EnvTransport, LocalTransport, SshTransport, Transport


class Session:
    """Opens each host at most once for the life of one dflash-ops command and reuses it for
    every step and every target on that host. Thread-safe: targets fan out in parallel."""

    def __init__(self, inventory: Inventory):
        self.inventory = inventory
        self._ssh: dict[str, SshTransport] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self.connections = 0   # how many SSH connections this command opened (benchmarks read it)
        self._opened: list[SshTransport] = []
        self._failed: dict[str, ConnectError] = {}   # hosts that could not be reached, and why

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ssh(self, host_name: str, *, fresh: bool = False) -> SshTransport:
        with self._guard:
            lock = self._locks.setdefault(host_name, threading.Lock())
        with lock:
            t = self._ssh.get(host_name)
            if t is not None and (fresh or not t.alive()):
                t.close()
                t = None
            if t is None and not fresh and host_name in self._failed:
                # Targets on one host share its failure: one connect_timeout per command, not per target.
                raise self._failed[host_name]
            if t is None:
                host = self.inventory.hosts[host_name]
                chain = self.inventory.host_chain(host)
                sock = None
                if host.jump:
                    jump = self.ssh(host.jump)
                    try:
                        sock = jump.open_tunnel(host.address, host.port)
                    except Exception as e:
                        raise ConnectError(host.name, tunnel_failure(e, jump.host, host), where(host, chain)) from e
                try:
                    t = SshTransport(host, sock=sock, chain=chain)
                except ConnectError as e:
                    self._failed[host_name] = e
                    raise
                self._failed.pop(host_name, None)
                self.connections += 1
                self._opened.append(t)
                self._ssh[host_name] = t
            return t

    @property
    def round_trips(self) -> int:
        return sum(t.runs for t in self._opened)

    def transport(self, target: Target, *, fresh: bool = False, check: bool = True,
                  env: Mapping[str, str] | None = None) -> Transport:
        """The transport that runs commands inside `target`; with `check`, a pct target's
        container state is verified first (ContainerError when stopped or unknown). Its commands
        get the host's and the target's `env:`, then `env` (later wins)."""
        if target.host is None:
            inner: Transport = LocalTransport()
            pct = "/usr/sbin/pct"
            user = os.environ.get("USER", "root")
            variables = {**target.env, **(env or {})}
        else:
            host = self.inventory.hosts[target.host]
            inner, pct, user = self.ssh(target.host, fresh=fresh), host.pct, host.user
            variables = {**host.env, **target.env, **(env or {})}
        if target.vmid is None:
            return EnvTransport(inner, variables) if variables else inner
        # A non-root user needs passwordless `sudo -n pct` (docs/background.md, pct).
        return PctTransport(inner, target.vmid, pct=pct, sudo=user != "root", target=target.name,
                            verify=check, env=variables)

    def close(self) -> None:
        for t in list(self._ssh.values()):
            t.close()
        self._ssh.clear()


@contextmanager
def owned_session(inv: Inventory, given: Session | None = None) -> Iterator[Session]:
    """The caller's Session, or one opened for this call and closed after it."""
    if given is not None:
        yield given
        return
    own = Session(inv)
    try:
        yield own
    finally:
        own.close()
