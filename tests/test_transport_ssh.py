"""Transports against a real OpenSSH server on 127.0.0.1 and the pct stand-in."""
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from orchestrator import inventory
from orchestrator.errors import ConnectError, ContainerError, HostKeyError
from orchestrator.ssh.session import Session
from orchestrator.ssh.hold import Hold
from orchestrator.ssh.pct import PctTransport
from orchestrator.ssh.transport import LocalTransport

ARG = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
              max_size=30)
PRINT_ARGS = 'for a in "$@"; do printf "%s\\0" "$a"; done'


@pytest.fixture
def ct(sshd, fakepct, make_inventory):
    fakepct.create(200)
    inv = inventory.load(str(make_inventory({"ct200": {
        "host": "node", "vmid": 200, "python": sys.executable, "workdir": "/srv/ct/dflash"}})))
    with Session(inv) as s:
        yield s, inv.target("ct200")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=st.lists(ARG, min_size=1, max_size=5))
def test_argv_arrives_byte_exact_through_ssh_pct_bash(ct, argv):
    session, target = ct
    t = session.transport(target, check=False)
    r = t.run(["bash", "-c", PRINT_ARGS, "bash", *argv])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split(b"\0")[:-1] == [a.encode() for a in argv]


def test_awkward_argv_examples(ct):
    session, target = ct
    t = session.transport(target)
    argv = ["-la", "--keep-env", "$HOME", "`id`", "a'b\"c", "line1\nline2", "ünï©ødé ✓", "", " ", "*", "--"]
    r = t.run(["bash", "-c", PRINT_ARGS, "bash", *argv])
    assert r.stdout.split(b"\0")[:-1] == [a.encode() for a in argv]


def test_binary_stdin_and_separate_streams(ct):
    session, target = ct
    t = session.transport(target)
    blob = bytes(range(256)) * 4096 + b"\r\n\x00\x1b[0m\x04"
    r = t.run(["cat"], stdin=blob)
    assert r.exit_code == 0 and r.stdout == blob
    r = t.script("echo out; echo err >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr) == (7, b"out\n", b"err\n")


def test_streaming_sinks_and_signal_exit(ct):
    session, target = ct
    t = session.transport(target)
    got = []
    r = t.script("for i in 1 2 3; do echo $i; done; kill -TERM $$", stdout=got.append)
    assert b"".join(got) == b"1\n2\n3\n" and r.stdout == b""
    assert r.exit_code == 128 + 15


def test_a_command_killed_by_a_signal_on_the_node_exits_128_plus_n_as_in_a_container(ct):
    """sshd reports a command killed by a signal as an exit-signal, which paramiko drops: every
    command over ssh, not one feature's, must still come back as 128+N (no 255)."""
    session, _ = ct
    node = session.ssh("node")
    for sig, script in ((15, "echo before; kill -TERM $$"), (9, "kill -KILL $$")):
        r = node.run(["sh", "-c", script])
        assert r.exit_code == 128 + sig, (sig, r)
        assert r.stderr == b"", r   # the waiting shell's own words (`Killed`) are not the command's output
    r = node.run(["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert (r.exit_code, r.stdout, r.stderr) == (7, b"out\n", b"err\n")
    r = node.run(["no-such-command-xyz"])
    assert r.exit_code == 127 and b"no-such-command-xyz" in r.stderr, r
    assert node.run(["sh", "-c", "echo hi >&3"]).exit_code != 0     # the shell's fd 3 is not the command's


def test_keep_env_0_environment_only(ct):
    session, target = ct
    r = session.transport(target).run(["env"])
    env = dict(line.split("=", 1) for line in r.stdout.decode().splitlines())
    assert env.get("container") == "lxc"
    assert "HOME" not in env and "SSH_CONNECTION" not in env


def test_one_connection_for_many_steps(ct):
    session, target = ct
    for _ in range(5):
        session.transport(target).run(["true"])
    assert session.connections == 1


def test_the_connection_sends_without_nagle_and_acknowledges_what_it_reads_at_once(ct):
    """sshd holds the first channel's confirmation until its post-authentication messages are
    acknowledged: a delayed ACK made every command's first step slower (docs/benchmarks.md §12 has the
    figure). After each read the socket asks Linux for an immediate ACK again."""
    import socket

    session, target = ct
    assert session.transport(target).run(["true"]).exit_code == 0
    sock = session.ssh(target.host).transport.sock
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    sock.recv(0)
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 1


def test_stopped_and_unknown_containers_are_clear_errors(sshd, fakepct, make_inventory):
    fakepct.create(200, running=False)
    inv = inventory.load(str(make_inventory({
        "stopped": {"host": "node", "vmid": 200}, "missing": {"host": "node", "vmid": 999}})))
    with Session(inv) as s:
        with pytest.raises(ContainerError, match="is stopped, not running; start it with `pct start 200`"):
            s.transport(inv.target("stopped")).run(["true"])
        with pytest.raises(ContainerError, match="999.conf' does not exist"):
            s.transport(inv.target("missing")).run(["true"])
        with pytest.raises(ContainerError, match="is stopped"):
            s.transport(inv.target("stopped"), check=False).check()
        # Without the status check, pct's own exit status 255 and message come through.
        t = s.transport(inv.target("stopped"), check=False)
        r = t.run(["true"])
        assert r.exit_code == 255 and b"not running" in r.stderr


def test_unknown_host_key_is_refused_with_how_to_trust(sshd, fakepct, make_inventory):
    before = sshd.known_hosts_empty.read_text()
    inv = inventory.load(str(make_inventory({"t": {"host": "node"}},
                                            hosts={"node": {"known_hosts": str(sshd.known_hosts_empty)}})))
    with Session(inv) as s, pytest.raises(HostKeyError) as e:
        s.transport(inv.target("t"))
    assert "unknown host key" in str(e.value) and "ssh-keyscan -p" in str(e.value)
    assert sshd.known_hosts_empty.read_text() == before   # nothing was auto-accepted


def test_changed_host_key_is_refused(sshd, fakepct, make_inventory):
    inv = inventory.load(str(make_inventory({"t": {"host": "node"}},
                                            hosts={"node": {"known_hosts": str(sshd.wrong_known_hosts)}})))
    with Session(inv) as s, pytest.raises(HostKeyError, match="CHANGED"):
        s.transport(inv.target("t"))


def test_refused_port_retries_then_one_line_error(sshd, fakepct, make_inventory):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    inv = inventory.load(str(make_inventory({"t": {"host": "node"}}, hosts={"node": {"port": port}})))
    with Session(inv) as s, pytest.raises(ConnectError, match="cannot connect"):
        s.transport(inv.target("t"))


def test_jump_host_gateway(sshd, fakepct, make_inventory):
    fakepct.create(201)
    (fakepct.private(201) / "marker").write_text("201")
    inv = inventory.load(str(make_inventory(
        {"t": {"host": "inner", "vmid": 201}},
        hosts={"inner": {"address": "127.0.0.1", "port": sshd.port, "identity_file": str(sshd.identity_file),
                         "known_hosts": str(sshd.known_hosts), "pct": str(fakepct.path), "jump": "node"}})))
    with Session(inv) as s:
        r = s.transport(inv.target("t")).run(["cat", "/srv/ct/marker"])
        assert r.stdout == b"201"
        assert s.connections == 2   # the jump host and the node behind it, once each


def test_dropped_connection_is_redialled_by_the_session(ct, sshd):
    session, target = ct
    assert session.transport(target).run(["true"]).ok
    dropped = session.ssh("node")           # the connection in use
    assert sshd.kill_connections()
    import time
    # until the client has seen it closed (at once here); session.ssh() must not be what is polled:
    # it redials a closed connection, so it always answers alive (the wait then lasted the 10 s)
    deadline = time.time() + 10
    while dropped.alive() and time.time() < deadline:
        time.sleep(0.05)
    assert not dropped.alive()
    assert session.transport(target).run(["true"]).ok
    assert session.connections == 2 and session.ssh("node") is not dropped


def test_local_transport_behaves_like_ssh(tmp_path):
    t = LocalTransport()
    blob = bytes(range(256)) * 10
    assert t.run(["cat"], stdin=blob).stdout == blob
    r = t.script("echo e >&2; exit 3")
    assert (r.exit_code, r.stderr) == (3, b"e\n")
    assert t.run(["definitely-not-a-command-xyz"]).exit_code == 127


def test_pct_on_the_local_node(fakepct):
    fakepct.create(300)
    t = PctTransport(LocalTransport(), 300, pct=str(fakepct.path))
    t.check()
    assert t.run(["printenv", "container"]).stdout == b"lxc\n"


def test_a_commands_own_255_is_not_mistaken_for_pct_refusing(ct):
    session, target = ct
    # The first command on a fresh transport carries the container check; the command exiting 255
    # on a running container must come back as its own status, with its own stderr.
    r = session.transport(target).script("echo mine >&2; exit 255")
    assert (r.exit_code, r.stderr) == (255, b"mine\n")


def test_stopped_container_while_streaming_stderr(sshd, fakepct, make_inventory):
    fakepct.create(202, running=False)
    inv = inventory.load(str(make_inventory({"t": {"host": "node", "vmid": 202}})))
    seen = []
    with Session(inv) as s, pytest.raises(ContainerError, match="is stopped"):
        s.transport(inv.target("t")).run(["true"], stderr=seen.append)
    assert b"dflash-ops pct-status" not in b"".join(seen)


@pytest.mark.parametrize("where", ["local", "ssh"])
def test_a_sink_that_raises_stops_the_command_and_reaches_the_caller(where, ct):
    session, target = ct
    t = LocalTransport() if where == "local" else session.transport(target)

    def closed_reader(data):
        raise BrokenPipeError("reader went away")

    with pytest.raises(BrokenPipeError):
        t.run(["sh", "-c", "while :; do echo y; done"], stdout=closed_reader, timeout=30)


@pytest.mark.parametrize("where", ["local", "ssh"])
def test_a_held_stdin_stays_open_while_the_command_runs_and_an_interrupt_hangs_up_first(where, ct):
    """Hold, bench-decode's line to its agent: its data, then no EOF while the command runs, so EOF means the
    caller is gone; the caller's KeyboardInterrupt (a real SIGINT while it waits) sends EOF first and waits
    for the command's end."""
    import os
    import signal

    session, target = ct
    t = LocalTransport() if where == "local" else session.transport(target)
    # reads the 3 bytes sent, then says whether EOF follows within 0.5 s
    probe = [sys.executable, "-c", "import os, select; os.read(0, 3); r = select.select([0], [], [], 0.5)[0]; "
             "print('eof' if r and not os.read(0, 1) else 'open')"]
    assert t.run(probe, stdin=b"abc").stdout == b"eof\n"
    assert t.run(probe, stdin=Hold(b"abc")).stdout == b"open\n"

    hold, seen = Hold(b"abc", grace_s=30), []
    ends = [sys.executable, "-c", "import os, time; os.read(0, 3); print('ready', flush=True); os.read(0, 1); "
            "time.sleep(0.3); print('ended')"]

    def out(data: bytes) -> None:
        """The command's output; Ctrl-C once it runs and has read its data (not after a guessed delay: a
        loaded machine may not have started it yet, and a hold ended first never starts it)."""
        seen.append(data)
        if b"".join(seen) == b"ready\n":
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        t.run(ends, stdin=hold, stdout=out)
    assert hold.ended is True and b"".join(seen) == b"ready\nended\n"


def test_a_host_that_never_speaks_ssh_fails_fast_in_one_line(sshd, fakepct, make_inventory, tmp_path):
    """Two targets on a host that accepts TCP and never says a word: one connection for the host, not
    tried again (a silent server stays silent) nor once a target, each target's one line naming why.
    The connections are counted where the kernel queues them (the listen backlog): none is lost to an
    accept that had not run yet, and none is left out because the client already gave up on it."""
    import re
    import socket
    import subprocess

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)               # the kernel accepts the TCP handshake; nobody reads or writes
    path = make_inventory({"a": {"host": "silent", "workdir": "/tmp/x"}, "b": {"host": "silent", "workdir": "/tmp/y"}},
                          hosts={"silent": {"address": "127.0.0.1", "port": server.getsockname()[1],
                                            "connect_timeout": 2}})
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.txt").write_text("x")
    accepted = []
    try:
        r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "-i", str(path), "deploy", "a", "b",
                            "--source", str(src)], capture_output=True, text=True, timeout=60)
        server.setblocking(False)
        while True:
            try:
                accepted.append(server.accept()[0])
            except BlockingIOError:
                break
    finally:
        server.close()
        for c in accepted:
            c.close()
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert len(accepted) == 1, (len(accepted), r.stdout)     # one 2 s budget for the host: one connection
    out = r.stdout + r.stderr
    assert "Traceback" not in out and "paramiko" not in out.lower() and "Exception" not in out, out
    for name in ("a", "b"):
        lines = [line for line in r.stdout.splitlines() if line.startswith(f"{name}: ")]
        assert len(lines) == 1, r.stdout
        assert ("silent: cannot connect to root@127.0.0.1:" in lines[0]
                and "accepts connections but no SSH server answers" in lines[0]
                # the seconds it measured: a loaded machine may say 2.1
                and re.search(r"\(gave up after \d+\.\d s, connect_timeout 2 s\)", lines[0])), lines[0]


def test_tell_all_tells_every_hold_once_within_one_deadline_through_a_second_ctrl_c():
    """exec's and play's interrupt: every command told, in order, even when a Ctrl-C pressed again lands
    inside a telling (that hold is told again: end() is idempotent); a hold whose command is still being
    started (its lock held) answers RUNNING at the shared deadline rather than blocking the others."""
    import threading
    import time

    from orchestrator.ssh.hold import tell_all

    class Interrupted(Hold):
        cut = True

        def end(self, line, timeout=5):
            if self.cut:
                self.cut = False
                raise KeyboardInterrupt
            return super().end(line, timeout)

    sent = []
    running, waiting, cut, starting = Hold(), Hold(), Interrupted(), Hold()
    assert running.begin(lambda: None, sent.append) and cut.begin(lambda: None, sent.append)
    starting.lock.acquire()     # begin() under way on a silent connection
    got: list = []
    try:
        # `starting`'s lock stays held until the finally: a tell_all that waited on it would never return
        teller = threading.Thread(target=lambda: got.append(
            tell_all([running, waiting, cut, starting], "INT", time.monotonic() + 0.3)), daemon=True)
        teller.start()
        teller.join(30)
        assert not teller.is_alive(), "tell_all waited on a hold whose start is under way"
    finally:
        starting.lock.release()
    states = got[0]
    assert states == [Hold.RUNNING, Hold.WAITING, Hold.RUNNING, Hold.RUNNING]
    assert sent == [b"INT\n", b"INT\n"] and not cut.cut
    assert not waiting.begin(lambda: sent.append(b"started"), sent.append)   # told before it began: never starts
    assert tell_all([running], "TERM", time.monotonic() + 1) == [Hold.RUNNING] and len(sent) == 2   # once


def test_a_container_stopped_under_a_command_is_said_so_not_as_its_own_137(fakepct):
    """lxc-attach exits 137 when a hard stop (`pct stop`) kills the command with the whole container: the
    checked exec asks `pct status` and says the container went down under it (ContainerError, `under`); a
    command's own SIGKILL in a running container is its own 137. tests/test_real_containers.py: the same on
    real containers, under a follow, a bench-decode and a deploy."""
    fakepct.create(301)
    pct = str(fakepct.path)
    r = PctTransport(LocalTransport(), 301, pct=pct, verify=True).run(["sh", "-c", "kill -9 $$"])
    assert r.exit_code == 137
    with pytest.raises(ContainerError) as e:
        PctTransport(LocalTransport(), 301, pct=pct, verify=True).run(["sh", "-c", f"{pct} stop 301; sleep 30"])
    assert (e.value.state, e.value.under) == ("stopped", 137)
    assert str(e.value) == ("301: container 301: went down under the command (exit 137, killed by SIGKILL) and is "
                            "stopped; start it with `pct start 301`")
