"""The pure command-building functions: what crosses a shell is quoted once, in shell_join."""
import shlex
import subprocess

import pytest
from hypothesis import given, settings, strategies as st

from orchestrator.ssh.pct import pct_exec_argv, pct_status_argv
from orchestrator.ssh.transport import bash_argv, shell_join

ARG = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
              max_size=40)


@given(st.lists(ARG, min_size=1, max_size=6))
def test_shell_join_round_trips_through_shlex(argv):
    assert shlex.split(shell_join(argv)) == argv


@settings(max_examples=60, deadline=None)
@given(st.lists(ARG, min_size=1, max_size=5))
def test_shell_join_round_trips_through_a_real_shell(argv):
    line = shell_join(["printf", "%s\\0", *argv])
    out = subprocess.run(["sh", "-c", line], capture_output=True, check=True).stdout
    assert out.split(b"\0")[:-1] == [a.encode() for a in argv]


def test_shell_join_refuses_nul_and_empty():
    with pytest.raises(ValueError):
        shell_join(["echo", "a\x00b"])
    with pytest.raises(ValueError):
        shell_join([])


def test_pct_exec_argv_has_keep_env_0_and_the_mandatory_dashdash():
    assert pct_exec_argv("/usr/sbin/pct", 200, ["ls", "-la"], sudo=False) == [
        "/usr/sbin/pct", "exec", "200", "--keep-env", "0", "--", "ls", "-la"]


def test_non_root_gets_sudo_n():
    assert pct_exec_argv("/usr/sbin/pct", 200, ["true"], sudo=True)[:3] == ["sudo", "-n", "/usr/sbin/pct"]
    assert pct_status_argv("pct", 201, sudo=True) == ["sudo", "-n", "pct", "status", "201"]


def test_scripts_run_under_bash_c():
    assert bash_argv("echo $HOME") == ["bash", "-c", "echo $HOME"]


def test_probe_is_a_runs_agent_command_with_its_arguments_after_double_dash():
    from orchestrator.inventory import Target
    from orchestrator.probe.prober import Matrix, probe_args
    t = Target(name="t", python="/opt/py thon", workdir="/root/it's here", expect={"torch": ">=2.5"})
    args = probe_args(t, 4, Matrix(policies=("eager", "inductor")))
    assert args[:3] == ["probe", "/root/it's here", "--"]
    assert args[3:] == ["--threads", "4", "--expect", '{"torch": ">=2.5"}', "--policies", "eager,inductor"]
    # --reuse is the agent's own option (before `--`); --topologies is the probe's
    args = probe_args(t, 2, Matrix(policies=("eager",), topologies=("threads",), reuse=True))
    assert args == ["probe", "/root/it's here", "--reuse", "--", "--threads", "2", "--expect", '{"torch": ">=2.5"}',
                    "--policies", "eager", "--topologies", "threads"]
    # bf16 is the program's default: named only when it is not, with fp8's emulation after it
    args = probe_args(t, 2, Matrix(precision="fp8-lmhead", fp8_emulate=True, fresh=True))
    assert args[3:] == ["--threads", "2", "--expect", '{"torch": ">=2.5"}', "--fresh",
                        "--precision", "fp8-lmhead", "--fp8-emulate"]
    # what cannot work is refused when the matrix is made, before anything connects (exit 2)
    from orchestrator.errors import UsageError
    for bad, said in (({"fp8_emulate": True}, "--fp8-emulate goes with"), ({"precision": "fp8", "reuse": True},
                                                                          "the saved result, which is bf16's")):
        with pytest.raises(UsageError, match=said) as e:
            Matrix(**bad)
        assert e.value.exit_code == 2
