"""What the benchmarks share: the test suite's own loopback sshd and pct stand-in, outside pytest."""
from __future__ import annotations

import contextlib
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def load(name: str, path: Path):
    """Import a file by path (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def fixtures():
    """(tests/fixtures/sshd.py, tests/conftest.py) as modules: SshServer, install_fakepct."""
    return (load("bench_sshd", REPO / "tests" / "fixtures" / "sshd.py"),
            load("bench_conftest", REPO / "tests" / "conftest.py"))


def node_inventory(server, pct, targets: dict[str, int], python: str = sys.executable,
                   workdir: str = "/srv/ct/dflash") -> str:
    """hosts.yaml text: host `node` = the loopback sshd + stand-in pct, one target per container."""
    lines = [f"hosts:\n  node: {{address: 127.0.0.1, port: {server.port}, identity_file: {server.identity_file}, "
             f"known_hosts: {server.known_hosts}, pct: {pct.path}}}\ntargets:"]
    for name, vmid in targets.items():
        lines.append(f"  {name}: {{host: node, vmid: {vmid}, python: {python}, workdir: {workdir}}}")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def loopback_node(targets: dict[str, int], prefix: str = "dflash-bench-"):
    """A scratch folder with a running loopback sshd, the pct stand-in with one running container
    per target, and hosts.yaml naming them; everything is stopped and removed on exit.
    Yields .scratch, .server, .pct, .inventory (path of hosts.yaml)."""
    sshd_mod, conftest = fixtures()
    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    server = sshd_mod.SshServer.start(scratch / "sshd")
    try:
        pct = conftest.install_fakepct(scratch / "pct")
        for vmid in targets.values():
            pct.create(vmid)
        inv = scratch / "hosts.yaml"
        inv.write_text(node_inventory(server, pct, targets))
        yield SimpleNamespace(scratch=scratch, server=server, pct=pct, inventory=inv)
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
