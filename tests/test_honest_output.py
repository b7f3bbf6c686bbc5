"""Output that does not mislead: a python that cannot be executed, a node that warns about its
locale, what deploy ships and from where (real sshd + pct stand-in)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator import inventory
from orchestrator.targets import check as targets
from orchestrator.ssh.pct import node_noise_removed

MAIN = "from orchestrator.cli import main; main()"
REPO = Path(__file__).resolve().parent.parent
PERL_LOCALE = """\
perl: warning: Setting locale failed.
perl: warning: Please check that your locale settings:
\tLANGUAGE = (unset),
\tLC_ALL = (unset),
\tLANG = "xx_YY.UTF-8"
    are supported and installed on your system.
perl: warning: Falling back to the standard locale ("C").
"""


def cli(*args, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-c", MAIN, *map(str, args)], capture_output=True,
                          timeout=timeout, cwd=cwd)


@pytest.fixture
def noisy_pct(fakepct, tmp_path):
    """pct as on a node whose locale perl lacks: the warnings first on stderr, then pct itself."""
    wrapper = tmp_path / "pct"
    wrapper.write_text(f"#!/bin/sh\nprintf '%s' '{PERL_LOCALE}' >&2\nexec {fakepct.path} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def test_locale_warnings_stay_out_of_the_container_state(sshd, fakepct, make_inventory, noisy_pct):
    fakepct.create(200)
    fakepct.create(201, running=False)
    path = make_inventory({n: {"host": "node", "vmid": v, "python": sys.executable, "workdir": "/srv/ct/dflash"}
                           for n, v in (("ct200", 200), ("ct201", 201))},
                          hosts={"node": {"pct": str(noisy_pct)}})
    checks = {c.target: c for c in targets.check(inventory.load(str(path)), ["ct200", "ct201"])}
    assert checks["ct200"].ok and checks["ct200"].container == "running"
    bad = checks["ct201"]
    assert not bad.ok and bad.container == "stopped" and "is stopped, not running" in bad.error
    assert "perl" not in bad.error and "LANG" not in bad.error
    r = cli("-i", path, "exec", "ct201", "--", "true")
    assert r.returncode == 1 and b"perl" not in r.stderr and b"is stopped" in r.stderr


def test_node_noise_removed_keeps_the_answer():
    assert node_noise_removed(PERL_LOCALE + "status: stopped\n") == "status: stopped"
    assert node_noise_removed("bash: warning: setlocale: LC_ALL: cannot change locale (xx)\nok") == "ok"


def test_a_python_that_cannot_be_executed_is_permission_denied(sshd, fakepct, make_inventory, tmp_path):
    fakepct.create(200)
    py = fakepct.private(200) / "python3"
    py.write_text("#!/bin/sh\nexit 0\n")
    py.chmod(0o644)
    path = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": "/srv/ct/python3",
                                     "workdir": "/srv/ct/dflash"}})
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.txt").write_text("x")
    r = cli("-i", path, "deploy", "ct200", "--source", src)
    assert r.returncode == 1
    assert "permission denied" in r.stdout.decode() and "not found" not in r.stdout.decode()


def test_deploy_names_its_source_and_refuses_outside_a_checkout(sshd, fakepct, make_inventory, tmp_path):
    fakepct.create(200)
    path = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable,
                                     "workdir": "/srv/ct/dflash"}})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = cli("-i", path, "deploy", "ct200", cwd=elsewhere)
    assert r.returncode == 2 and b"not a dflash-ops checkout" in r.stderr and b"--source" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (fakepct.private(200) / "dflash").exists()          # nothing was shipped
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.txt").write_text("x")
    r = cli("-i", path, "deploy", "ct200", "--source", src, cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().splitlines()[0] == f"shipping {src} (--source)"
    r = cli("-i", path, "deploy", "ct200", "--dry-run", "--json", cwd=REPO)
    assert json.loads(r.stdout)["source"] == str(REPO)


def test_the_supervisor_shows_a_short_command_line(sshd, fakepct, make_inventory, tmp_path):
    fakepct.create(200)
    path = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable,
                                     "workdir": "/srv/ct/dflash"}})
    src = tmp_path / "src"
    (src / "trainer").mkdir(parents=True)
    (src / "trainer" / "__init__.py").write_text("")
    (src / "trainer" / "__main__.py").write_text("import os, time\nprint(sorted(os.environ))\ntime.sleep(60)\n")
    assert cli("-i", path, "deploy", "ct200", "--source", src).returncode == 0
    r = cli("-i", path, "launch", "ct200", "--gpus", "0", "--policy", "eager")
    assert r.returncode == 0, r.stderr
    run = r.stdout.decode().strip()
    rundir = fakepct.private(200) / "dflash" / "runs" / run
    try:
        rec = json.loads((rundir / "run.json").read_text())
        cmdline = Path(f"/proc/{rec['supervisor_pid']}/cmdline").read_bytes()
        assert len(cmdline) < 300, cmdline[:300]
        assert b"supervise" in cmdline and b"def " not in cmdline
        status = cli("-i", path, "status", "ct200", "--json")
        assert json.loads(status.stdout)["runs"][0]["state"] == "running"
        deadline = time.monotonic() + 20
        while "'PATH'" not in (rundir / "train.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = (rundir / "train.log").read_text()
        assert "'PATH'" in log and "DFLASH_OPS_AGENT_SOURCE" not in log    # the trainer never sees it
    finally:
        stop = cli("-i", path, "stop", "ct200", run)
    assert stop.returncode == 0, stop.stderr
    assert json.loads((rundir / "exit.json").read_text())
