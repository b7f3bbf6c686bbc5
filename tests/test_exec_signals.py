"""`exec` interrupted at the controller: SIGINT, SIGTERM and SIGKILL of `dflash-ops exec` end the command
it started (its whole process group) in the container (the pct stand-in), on the node and on this
machine, through a real sshd; the controller says so in one line and exits 128+N."""
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from orchestrator.targets.exec import ENDING_GRACE_S

MAIN = "from orchestrator.cli import main; main()"
# How long the commands here would run on their own, and how long a test waits for an interrupted exec
# to end: far less than the one, so an exec that ended proves the command's own end was not waited for,
# and far more than any scheduling delay of a loaded 2-core machine, so nothing here times a fast path.
COMMAND_S = 600
ENDS_WITHIN_S = 120


@pytest.fixture
def where(fakepct, tmp_path):
    """target -> (the pid file as the command sees it, as this machine sees it)."""
    def at(target: str):
        if target.startswith("ct"):
            vmid = int(target[2:])
            return "/srv/ct/pid", fakepct.private(vmid) / "pid"
        return str(tmp_path / f"{target}.pid"), tmp_path / f"{target}.pid"
    return at


def command(pidfile: str, prelude: str = "") -> list[str]:
    """A shell that writes its pid, says `started`, and waits on a child that would outlive any test."""
    return ["sh", "-c", f"{prelude}echo $$ >{pidfile}; echo started; sleep {COMMAND_S}; echo never"]


def start(inv, *args) -> subprocess.Popen:
    # -X faulthandler: SIGABRT makes it write every thread's stack (ended() sends one to a controller
    # that did not end), so a hang says where it hangs.
    return subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", MAIN, "-i", str(inv), "exec",
                             *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def ended(proc: subprocess.Popen) -> bytes:
    """The interrupted controller's stderr once it has exited; one that has not within ENDS_WITHIN_S
    fails the test with its threads' stacks."""
    try:
        return proc.communicate(timeout=ENDS_WITHIN_S)[1]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        err = proc.communicate(timeout=30)[1]
        pytest.fail(f"the controller had not ended {ENDS_WITHIN_S} s after the signal; its stacks:\n"
                    f"{err.decode(errors='replace')}")


def wait_for(proc: subprocess.Popen, word: bytes, times: int = 1, timeout: float = 30) -> bytes:
    """stdout read until `word` has come `times` times."""
    seen, deadline = b"", time.monotonic() + timeout
    while seen.count(word) < times:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(proc.stdout.fileno(), 4096) if ready else b""
        if not chunk:
            proc.kill()
            pytest.fail(f"no {word!r} on stdout: {seen!r}, stderr {proc.communicate()[1]!r}")
        seen += chunk
    return seen


def stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else fields    # a zombie has ended; its parent has not reaped it yet


def group_of(pidfile) -> dict[int, str]:
    """Every live process of the command's process group: {pid: start time}."""
    pgid = os.getpgid(int(pidfile.read_text()))
    members = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (fields := stat(int(name))) is not None and int(fields[2]) == pgid:
            members[int(name)] = fields[19]
    return members


def left(members: dict[int, str], timeout: float) -> list[int]:
    """The members still running after up to `timeout` seconds (a pid reused since is not one)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid, started in members.items() if (f := stat(pid)) is not None and f[19] == started]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def kill_all(members: dict[int, str]) -> None:
    for pid in left(members, 0):
        os.kill(pid, signal.SIGKILL)


def running_group(pidfile) -> dict[int, str]:
    """The command's group, checked to be its own: the command, its `sleep` (which may start just after
    `started`), the shell leading it, the watcher; never the group of this test or of the node's sshd."""
    deadline = time.monotonic() + ENDS_WITHIN_S
    while len(members := group_of(pidfile)) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    pid = int(pidfile.read_text())
    assert pid in members and len(members) >= 4, members
    assert os.getpgid(pid) not in (os.getpgid(0), os.getpgid(os.getppid()))
    return members


@pytest.mark.parametrize("target, sig", [("ct200", signal.SIGINT), ("ct200", signal.SIGTERM),
                                         ("node", signal.SIGINT), ("local", signal.SIGTERM)])
def test_sigint_and_sigterm_end_the_command_and_say_so(exec_targets, where, target, sig):
    remote, local = where(target)
    proc = start(exec_targets, target, "--", *command(remote))
    members: dict[int, str] = {}
    try:
        assert wait_for(proc, b"started\n") == b"started\n"
        members = running_group(local)
        proc.send_signal(sig)
        err = ended(proc)         # the command's own end (COMMAND_S) was not waited for
        assert proc.returncode == 128 + sig, err
        assert err.decode().splitlines() == [f"dflash-ops: interrupted ({sig.name}): the command was ended on {target}"]
        assert left(members, ENDS_WITHIN_S) == []
    finally:
        proc.kill()
        kill_all(members)


@pytest.mark.parametrize("target", ["ct200", "node", "local"])
def test_sigkill_of_the_controller_ends_the_command_when_its_connection_closes(exec_targets, where, target):
    remote, local = where(target)
    proc = start(exec_targets, target, "--", *command(remote))
    members: dict[int, str] = {}
    try:
        wait_for(proc, b"started\n")
        members = running_group(local)
        proc.kill()
        proc.wait(timeout=10)
        assert left(members, ENDS_WITHIN_S) == []       # EOF on the watcher's stdin: HUP to the group
    finally:
        proc.kill()
        kill_all(members)


def test_every_target_of_several_is_ended(exec_targets, fakepct):
    proc = start(exec_targets, "ct200", "ct201", "--", *command("/srv/ct/pid"))
    members: dict[int, str] = {}
    try:
        out = wait_for(proc, b"started\n", times=2)
        assert sorted(out.decode().splitlines()) == ["[ct200] started", "[ct201] started"]
        for vmid in (200, 201):
            members.update(running_group(fakepct.private(vmid) / "pid"))
        proc.send_signal(signal.SIGINT)
        err = ended(proc)
        assert proc.returncode == 130
        assert err.decode().splitlines() == ["dflash-ops: interrupted (SIGINT): the command was ended on ct200, ct201"]
        assert left(members, ENDS_WITHIN_S) == []
    finally:
        proc.kill()
        kill_all(members)


def test_a_command_that_ignores_the_signal_is_killed_after_the_grace(exec_targets, where):
    remote, local = where("ct200")
    proc = start(exec_targets, "ct200", "--", *command(remote, prelude="trap '' INT; "))   # its sleep ignores it too
    members: dict[int, str] = {}
    try:
        wait_for(proc, b"started\n")
        members = running_group(local)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        err = ended(proc)
        took = time.monotonic() - sent
        assert proc.returncode == 130 and "the command was ended on ct200" in err.decode(), err
        assert took >= ENDING_GRACE_S - 0.5, took      # SIGKILL once the grace had passed, not at once
        assert left(members, ENDS_WITHIN_S) == []
    finally:
        proc.kill()
        kill_all(members)


def test_what_a_command_leaves_in_the_background_outlives_an_exec_that_ended_by_itself(exec_targets, where):
    remote, local = where("ct200")
    r = subprocess.run([sys.executable, "-c", MAIN, "-i", str(exec_targets), "exec", "ct200", "--", "sh", "-c",
                        f"sleep {COMMAND_S} >/dev/null 2>&1 & echo $! >{remote}; exit 3"], capture_output=True,
                       timeout=ENDS_WITHIN_S)
    assert (r.returncode, r.stderr) == (3, b"")
    pid = int(local.read_text())
    try:
        time.sleep(0.5)         # the controller has gone and its connection closed: nothing was sent
        assert stat(pid) is not None
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_target_still_connecting_is_not_started_and_not_waited_for(sshd, fakepct, make_inventory, where):
    silent = socket.socket()            # accepts, never speaks SSH: the connect waits out connect_timeout
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    fakepct.create(200)
    inv = make_inventory(
        {"ct200": {"host": "node", "vmid": 200, "python": sys.executable, "workdir": "/srv/ct/dflash"},
         "far": {"host": "far", "vmid": 300, "python": sys.executable, "workdir": "/srv/ct/dflash"}},
        hosts={"far": {"address": "127.0.0.1", "port": silent.getsockname()[1], "user": sshd.user,
                       "identity_file": str(sshd.identity_file), "known_hosts": str(sshd.known_hosts),
                       "connect_timeout": COMMAND_S}})
    remote, local = where("ct200")
    proc = start(inv, "ct200", "far", "--", *command(remote))
    members: dict[int, str] = {}
    try:
        wait_for(proc, b"started\n")
        members = running_group(local)
        proc.send_signal(signal.SIGINT)
        err = ended(proc)     # `far`'s connect would wait out connect_timeout (COMMAND_S): it was not waited for
        assert proc.returncode == 130
        assert err.decode().splitlines() == [
            "dflash-ops: interrupted (SIGINT): the command was ended on ct200; not started on far"]
        assert left(members, ENDS_WITHIN_S) == []
    finally:
        proc.kill()
        kill_all(members)
        silent.close()


@pytest.mark.parametrize("target", ["local", "node"])
def test_a_signal_that_another_thread_takes_still_ends_the_exec(exec_targets, where, target):
    """The kernel hands a process's signal to any of its threads that does not block it, and only the
    main thread runs Python's handlers: here the SIGTERM goes to the thread that reads the command's
    output (signal.pthread_kill). The main thread, waiting for the targets, must still see it (it waited
    without a timeout: the exec sat out its command, seen under load)."""
    from orchestrator.errors import Interrupted
    from orchestrator.inventory import load
    from orchestrator.targets import exec as exec_mod

    if threading.current_thread() is not threading.main_thread():    # exec's handler needs the main thread
        pytest.skip("pytest runs this test outside the main thread")
    remote, local = where(target)
    inv = load(str(exec_targets))
    tripped = threading.Event()

    def out(_target: str, data: bytes) -> None:     # runs in the thread that reads stdout
        if b"started" in data and not tripped.is_set():
            tripped.set()
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    # Without the fix the exec waits for the command (COMMAND_S): a watchdog then signals the main thread
    # itself, and the test fails saying so rather than hanging.
    rescued = threading.Event()
    main = threading.get_ident()
    watchdog = threading.Timer(ENDS_WITHIN_S / 2, lambda: (rescued.set(), signal.pthread_kill(main, signal.SIGTERM)))
    watchdog.start()
    try:
        with pytest.raises(Interrupted) as e:
            exec_mod.exec_command(inv, [inv.targets[target]], command(remote), out=out, err=lambda t, d: None)
        watchdog.cancel()
        assert not rescued.is_set(), "the exec saw the signal only once its main thread was signalled itself"
        assert tripped.is_set() and e.value.exit_code == 128 + signal.SIGTERM
        assert str(e.value) == f"interrupted (SIGTERM): the command was ended on {target}", str(e.value)
    finally:
        watchdog.cancel()
        shell = int(local.read_text()) if local.exists() else None
        deadline = time.monotonic() + ENDS_WITHIN_S
        while shell is not None and stat(shell) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        if shell is not None and stat(shell) is not None:
            os.kill(shell, signal.SIGKILL)
            pytest.fail("the command's shell outlived the interrupted exec")
