"""The release agent's start, which is most of what a no-change deploy costs on the target: it runs
under `python -S` (a target's .pth files are never run for it) and imports only what the manifest
needs, yet finds the installed packages where a plain start would."""
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from orchestrator import inventory
from orchestrator.deploy import sync as deploy
from orchestrator.inventory import Target
from orchestrator.ssh import agent_call
from orchestrator.ssh.session import Session

WORKDIR = "/srv/ct/dflash"


def test_the_release_agent_starts_without_site_and_the_runs_agent_with_it():
    t = Target(name="t", python="/py")
    assert agent_call.argv(t, agent_call.RELEASE, ["manifest", "/w"])[:3] == ["/py", "-S", "-c"]
    assert agent_call.argv(t, agent_call.RUNS, ["status", "/w"])[:2] == ["/py", "-c"]


def _venv(tmp_path: Path) -> tuple[Path, Path]:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    return py, Path(purelib)


def test_under_S_installed_packages_are_found_without_running_pth_files(tmp_path):
    # A target's venv: alpha installed in site-packages, beta only on a path that a .pth file adds,
    # and a .pth file that runs code (it leaves a mark).
    py, site_packages = _venv(tmp_path)
    (site_packages / "alpha-1.0.dist-info").mkdir()
    extra = tmp_path / "extra"
    (extra / "beta-2.0.dist-info").mkdir(parents=True)
    (site_packages / "extra.pth").write_text(f"{extra}\n")
    mark = tmp_path / "pth-ran"
    (site_packages / "zz-mark.pth").write_text(f"import os; open({str(mark)!r}, 'a').close()\n")

    source = agent_call.source(agent_call.RELEASE)
    code = (source[:source.index("def main(")] + "\nout = [dist_version('alpha'), os.path.exists(" + repr(str(mark))
            + "), 'importlib.metadata' in sys.modules]\nout += [dist_version('beta'), os.path.exists("
            + repr(str(mark)) + "), sorted(d for d in dists() if d[:5] in ('alpha', 'beta-'))]\n"
            + "print(json.dumps(out))")
    r = subprocess.run([str(py), *agent_call.OPTIONS[agent_call.RELEASE], "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    # alpha: found with no .pth file run and no importlib.metadata; beta: only once the .pth
    # files ran, as a plain start runs them; install-deps' list sees both
    assert json.loads(r.stdout) == ["1.0", False, False, "2.0", True, ["alpha-1.0", "beta-2.0"]]
    mark.unlink()
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60)
    assert json.loads(r.stdout) == ["1.0", True, False, "2.0", True, ["alpha-1.0", "beta-2.0"]]


def test_a_no_change_manifest_through_sshd_imports_only_what_it_needs(sshd, fakepct, make_inventory, tmp_path):
    fakepct.create(200)
    inv = inventory.load(str(make_inventory(
        {"ct200": {"host": "node", "vmid": 200, "python": sys.executable, "workdir": WORKDIR}})))
    tree = tmp_path / "src"
    for i in range(20):
        (tree / f"pkg{i % 4}").mkdir(parents=True, exist_ok=True)
        (tree / f"pkg{i % 4}" / f"mod_{i}.py").write_text(f"VALUE = {i}\n")
    first = deploy.deploy(inv, ["ct200"], source=str(tree))["ct200"]
    assert first.ok, first.error

    # The agent's own argv, with a line after its reply that says what the process imported.
    target = inv.targets["ct200"]
    argv = agent_call.argv(target, agent_call.RELEASE, ["manifest", WORKDIR, "--tidy"])
    unwanted = ["platform", "shutil", "tarfile", "hashlib", "importlib.metadata", "subprocess"]
    argv[argv.index("-c") + 1] += (f"\nprint(json.dumps([sys.flags.no_site, [m for m in {unwanted!r} "
                                   "if m in sys.modules]]))")
    with Session(inv) as s:
        r = s.transport(target).run(argv)
    assert r.exit_code == 0, r.stderr
    *_, reply, imported = r.stdout.decode().splitlines()
    doc = json.loads(reply)
    assert doc["release"] == first.release and len(doc["manifest"]) == 20 and doc["damaged"] == []
    assert doc["torch"] == metadata.version("torch") and doc["python"] == sys.version.split()[0]
    assert json.loads(imported) == [1, []]


def test_the_cli_leaves_its_objects_to_the_os_at_exit():
    # The interpreter's last collections over paramiko's and cryptography's objects were about a
    # tenth of a no-change deploy: main() freezes them at exit (atexit runs last-in first-out,
    # so this check, registered before main, runs after main's).
    code = ("import atexit, gc, sys; from orchestrator import cli\n"
            "atexit.register(lambda: sys.stderr.write('frozen %d\\n' % (gc.get_freeze_count() > 0)))\n"
            "cli.main(['--help'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Usage:" in r.stdout and r.stderr.strip().endswith("frozen 1"), r.stderr
