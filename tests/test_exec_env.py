"""`exec` and `env:` for real: commands through a real sshd into the pct stand-in (and on the
node for a target without vmid), driven by the `dflash-ops` CLI as a user would."""
import json
import os
import subprocess
import sys
import time

import pytest

from orchestrator import envvars, inventory
from orchestrator.deploy import sync as deploy
from orchestrator.errors import UsageError
from orchestrator.ssh.pct import pct_exec_argv

MAIN = "from orchestrator.cli import main; main()"
WORKDIR = "/srv/ct/dflash"
# A stand-in trainer: what a run's environment is, written into its log, then a clean exit.
STUB = ("import json, os\n"
        "print(json.dumps({'env': {k: os.environ.get(k) for k in "
        "('HF_HOME', 'NCCL_DEBUG', 'HF_TOKEN', 'FROM_HOST', 'container')}}), flush=True)\n")


def cli(path, *args, timeout=120):
    return subprocess.run([sys.executable, "-c", MAIN, "-i", str(path), *map(str, args)],
                          capture_output=True, timeout=timeout)


@pytest.fixture
def inv_path(sshd, fakepct, make_inventory):
    fakepct.create(200)
    fakepct.create(201)
    return make_inventory({
        "ct200": {"host": "node", "vmid": 200, "python": sys.executable, "workdir": WORKDIR,
                  "env": {"HF_HOME": "/srv/ct/hf", "NCCL_DEBUG": "WARN"}},
        "ct201": {"host": "node", "vmid": 201, "python": sys.executable, "workdir": WORKDIR},
        "node": {"host": "node", "python": sys.executable, "workdir": "/tmp/dflash-node",
                 "env": {"NCCL_DEBUG": "INFO"}},
    }, hosts={"node": {"env": {"FROM_HOST": "yes"}}})


# --- exec ------------------------------------------------------------------------------------

def test_exec_passes_the_exit_status_and_streams_separately(inv_path):
    r = cli(inv_path, "exec", "ct200", "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert r.returncode == 7
    assert r.stdout == b"out\n" and r.stderr == b"err\n"
    assert cli(inv_path, "exec", "ct200", "--", "true").returncode == 0


def test_exec_runs_in_the_container_with_only_its_env(inv_path, fakepct):
    (fakepct.private(200) / "marker").write_text("in ct200\n")
    r = cli(inv_path, "exec", "ct200", "--", "sh", "-c", "cat /srv/ct/marker; echo $HF_HOME $FROM_HOST $container")
    assert r.returncode == 0, r.stderr
    # host env, then target env; pct's own container=lxc is still there (--keep-env 0)
    assert r.stdout.decode().splitlines() == ["in ct200", "/srv/ct/hf yes lxc"]


def test_exec_command_not_found_and_not_executable(inv_path, fakepct):
    assert cli(inv_path, "exec", "ct200", "--", "no-such-command-xyz").returncode == 127
    exe = fakepct.private(200) / "noexec.sh"
    exe.write_text("#!/bin/sh\necho hi\n")
    exe.chmod(0o644)
    r = cli(inv_path, "exec", "ct200", "--", "/srv/ct/noexec.sh")
    assert r.returncode == 126
    assert b"ermission denied" in r.stderr


def test_exec_several_targets_in_parallel_with_prefixes(inv_path):
    r = cli(inv_path, "exec", "ct200", "ct201", "node", "--",
            "sh", "-c", 'echo "one $NCCL_DEBUG"; printf two; [ "$NCCL_DEBUG" != WARN ]')
    assert r.returncode == 1        # ct200 failed (exit 1)
    lines = r.stdout.decode().splitlines()
    assert sorted(lines) == sorted(["[ct200] one WARN", "[ct200] two", "[ct201] one ", "[ct201] two",
                                    "[node] one INFO", "[node] two"])
    assert "[ct200] dflash-ops: exit status 1" in r.stderr.decode()
    ok = cli(inv_path, "exec", "ct201", "node", "--", "true")
    assert ok.returncode == 0 and ok.stdout == b""


def test_exec_on_the_node_for_a_target_without_vmid(inv_path):
    r = cli(inv_path, "exec", "node", "--env", "EXTRA=1 2", "--",
            "sh", "-c", "echo $FROM_HOST $NCCL_DEBUG $EXTRA; exit 3")
    assert r.returncode == 3 and r.stdout == b"yes INFO 1 2\n"


def test_a_command_killed_by_a_signal_exits_128_plus_n_on_the_node_as_in_a_container(inv_path):
    for target in ("node", "ct200"):
        r = cli(inv_path, "exec", target, "--", "sh", "-c", "echo before; kill -TERM $$")
        assert (r.returncode, r.stdout) == (143, b"before\n"), (target, r.stderr)
    r = cli(inv_path, "exec", "node", "--", "no-such-command-xyz")
    assert r.returncode == 127


def test_exec_errors_are_one_line(inv_path, fakepct):
    fakepct.stop(201)
    r = cli(inv_path, "exec", "ct201", "--", "true")
    assert r.returncode == 1 and b"Traceback" not in r.stderr
    assert len(r.stderr.decode().strip().splitlines()) == 1 and "not running" in r.stderr.decode()
    r = cli(inv_path, "exec", "ct200", "ct201", "--", "echo", "x")
    assert r.returncode == 1 and r.stdout == b"[ct200] x\n"
    assert "[ct201] dflash-ops:" in r.stderr.decode()
    assert cli(inv_path, "exec", "ct200").returncode == 2                   # no `--` command
    assert cli(inv_path, "exec", "ct200", "--env", "BAD-NAME=1", "--", "true").returncode == 2
    assert cli(inv_path, "exec", "ct200", "--all", "--", "true").returncode == 2


def test_exec_runs_with_the_target_pythons_folder_first_on_path(inv_path, make_inventory, tmp_path):
    venv = tmp_path / "venv"                   # a venv's shape: bin/python, bin/a tool, pyvenv.cfg
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "pyvenv.cfg").write_text(f"home = {os.path.dirname(os.path.realpath(sys.executable))}\n")
    tool = venv / "bin" / "venv-tool-xyz"
    tool.write_text("#!/bin/sh\necho tool from the venv\n")
    tool.chmod(0o755)
    path = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": str(venv / "bin" / "python"),
                                     "workdir": WORKDIR, "env": {"HF_HOME": "/srv/ct/hf"}}})
    r = cli(path, "exec", "ct200", "--", "sh", "-c", 'echo "$PATH"; echo "$VIRTUAL_ENV $HF_HOME"')
    assert r.returncode == 0, r.stderr
    pct_path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"      # pct exec --keep-env 0's
    assert r.stdout.decode().splitlines() == [f"{venv}/bin:{pct_path}", f"{venv} /srv/ct/hf"]
    r = cli(path, "exec", "ct200", "--", "python", "-c", "import sys; print(sys.argv[1:])", "-V", "a b")
    assert r.returncode == 0 and r.stdout == b"['-V', 'a b']\n", r.stderr
    assert cli(path, "exec", "ct200", "--", "venv-tool-xyz").stdout == b"tool from the venv\n"


def test_exec_explains_command_not_found_and_a_command_without_dashes(inv_path):
    r = cli(inv_path, "exec", "ct200", "--", "no-such-command-xyz", "-V")
    assert r.returncode == 127      # the explanation alone: not the shell's `/usr/bin: 1: exec: ...` before it
    assert r.stderr.decode().splitlines() == [(
        f"dflash-ops: ct200: `no-such-command-xyz` not on CT 200's PATH; the target's python is {sys.executable} "
        f"(its folder {os.path.dirname(sys.executable)} was first on PATH)")]
    r = cli(inv_path, "exec", "node", "--", "/no/such/tool")      # on the node, by path: the same one line
    assert r.returncode == 127 and r.stderr.decode().splitlines() == [
        f"dflash-ops: node: `/no/such/tool` not found in node; the target's python is {sys.executable}"]
    r = cli(inv_path, "exec", "ct200", "ct201", "--", "no-such-command-xyz")
    assert r.returncode == 1 and "[ct201] dflash-ops: exit status 127: `no-such-command-xyz` not on CT 201's PATH" \
        in r.stderr.decode()
    r = cli(inv_path, "exec", "ct200", "--json", "--", "no-such-command-xyz")
    assert "`no-such-command-xyz` not on CT 200's PATH" in json.loads(r.stdout)["targets"]["ct200"]["note"]
    r = cli(inv_path, "exec", "ct200", "--", "sh", "-c", "exit 127")     # the command's own 127: no note
    assert r.returncode == 127 and r.stderr == b""
    for typed, fixed in ((["ct200", "python", "-V"], "ct200 -- python -V"),
                         (["ct200", "ct201", "--env", "A=1", "ls", "-l"], "ct200 ct201 --env A=1 -- ls -l"),
                         (["nvidia-smi", "-L"], "-- nvidia-smi -L")):
        r = cli(inv_path, "exec", *typed)
        err = r.stderr.decode()
        assert r.returncode == 2 and f"the command goes after `--`: `dflash-ops exec {fixed}`" in err, err
    r = cli(inv_path, "exec", "ct20", "ls")           # a target's typo is named as one
    assert r.returncode == 2 and "unknown target 'ct20' (did you mean" in r.stderr.decode()
    r = cli(inv_path, "exec", "--help")
    assert r.returncode == 0 and "exec [OPTIONS] TARGET... -- CMD..." in r.stdout.decode()


def test_exec_json(inv_path):
    r = cli(inv_path, "exec", "ct200", "--json", "--", "sh", "-c", "echo hi; exit 4")
    assert r.returncode == 4
    doc = json.loads(r.stdout)
    assert doc["targets"]["ct200"]["exit_code"] == 4 and doc["targets"]["ct200"]["stdout"] == "hi\n"
    r = cli(inv_path, "exec", "--all", "--json", "--", "true")
    assert r.returncode == 0 and sorted(json.loads(r.stdout)["targets"]) == ["ct200", "ct201", "node"]


# --- env -------------------------------------------------------------------------------------

def test_env_reaches_the_trainer_through_pct_and_is_recorded_masked(inv_path, fakepct, tmp_path):
    src = tmp_path / "src"
    (src / "trainer").mkdir(parents=True)
    (src / "trainer" / "__init__.py").write_text("")
    (src / "trainer" / "__main__.py").write_text(STUB)
    inv = inventory.load(str(inv_path))
    assert deploy.deploy(inv, ["ct200"], source=str(src))["ct200"].ok
    r = cli(inv_path, "launch", "ct200", "--gpus", "0", "--policy", "eager",
            "--env", "HF_TOKEN=hf_s3cret", "--env", "NCCL_DEBUG=TRACE")
    assert r.returncode == 0, r.stderr
    run = r.stdout.decode().strip()
    assert "hf_s3cret" not in r.stderr.decode() and "HF_TOKEN=***" in r.stderr.decode()
    rundir = fakepct.private(200) / "dflash" / "runs" / run
    deadline = time.monotonic() + 60
    while not (rundir / "exit.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    line = next(x for x in (rundir / "train.log").read_text().splitlines() if x.startswith('{"env"'))
    seen = json.loads(line)["env"]
    assert seen == {"HF_HOME": "/srv/ct/hf", "NCCL_DEBUG": "TRACE", "HF_TOKEN": "hf_s3cret",
                    "FROM_HOST": "yes", "container": "lxc"}
    record = json.loads((rundir / "run.json").read_text())
    assert record["user_env"] == {"FROM_HOST": "yes", "HF_HOME": "/srv/ct/hf", "NCCL_DEBUG": "TRACE",
                                  "HF_TOKEN": "***"}
    assert "hf_s3cret" not in (rundir / "run.json").read_text()


def test_env_names_are_validated_in_hosts_yaml(tmp_path):
    bad = "targets:\n  a:\n    env:\n      OK_1: x\n      2BAD: y\n"
    with pytest.raises(UsageError, match=r":5: targets.a.env.2BAD: not a variable name"):
        inventory.parse(bad, "hosts.yaml")
    good = inventory.parse("targets:\n  a:\n    env: {A: 1, B: x y}\n", "hosts.yaml")
    assert dict(good.targets["a"].env) == {"A": "1", "B": "x y"}


def test_env_is_one_argv_quoted_once():
    argv = pct_exec_argv("/usr/sbin/pct", 200, ["python", "-c", "x"], sudo=False,
                         env={"A": "1 2", "B": "$HOME"})
    assert argv == ["/usr/sbin/pct", "exec", "200", "--keep-env", "0", "--",
                    "env", "A=1 2", "B=$HOME", "python", "-c", "x"]
    assert envvars.masked({"HF_TOKEN": "x", "AWS_SECRET_ACCESS_KEY": "y", "HF_HOME": "/h"}) == \
        {"HF_TOKEN": "***", "AWS_SECRET_ACCESS_KEY": "***", "HF_HOME": "/h"}
    with pytest.raises(UsageError):
        envvars.parse_assignments(["NOEQUALS"])
    # what no command argument can carry, refused as the option's value (--env, --var) before anything runs
    with pytest.raises(UsageError, match="--env A: a value cannot contain a NUL byte"):
        envvars.parse_assignments(["A=x\x00y"])
    with pytest.raises(UsageError, match="--var A: the value is not UTF-8 text"):
        envvars.parse_assignments(["A=x\udcffy"], what="--var")
