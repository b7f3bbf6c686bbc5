"""`play` interrupted at the controller while a step's command runs in the container: Ctrl-C
(SIGINT) and SIGTERM end that command (its whole process group, as `exec` does), the play exits 130 / 143
with one line naming the target and step where it stopped; SIGKILL ends it too (the closed connection);
each way its player's lock is free, its record holds the steps that ended, and `--from` resumes there.
Through a real sshd and the pct stand-in."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_exec_signals import left, running_group
from trainer_quick import CLI_MAIN

# the second step waits (a `sleep` that would outlive any test) unless /srv/ct/go is there
SLOW = """\
steps:
  - name: first
    exec: {shell: "echo one >> /srv/ct/log"}
  - name: slow
    exec: {shell: "test -f /srv/ct/go || { echo $$ > /srv/ct/pid; echo started > /srv/ct/started; sleep 60; }"}
  - name: last
    exec: {shell: "echo three >> /srv/ct/log"}
"""


@pytest.fixture
def setup(tmp_path, fakepct, make_inventory):
    fakepct.create(200)
    inv = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable,
                                    "workdir": "/srv/ct/dflash"}})
    (tmp_path / "slow.yaml").write_text(SLOW)
    return inv, fakepct.private(200)


def play(tmp_path, inv, *args, wait=True):
    argv = [sys.executable, "-c", CLI_MAIN, "-i", str(inv), "play", "slow.yaml", "ct200", *args]
    env = dict(os.environ, DFLASH_OPS_HOME=str(tmp_path))
    if wait:
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    # SIGINT at its default, as Ctrl-C finds it (a suite run in the background ignores it)
    return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def kill_all(members: dict[int, str]) -> None:
    """What a failed test left of the step's command (a member may end meanwhile: the test's own race)."""
    for pid in left(members, 0):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def lock_is_free(record) -> bool:
    fd = os.open(record.with_name(f".{record.stem}.lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_an_interrupted_play_ends_its_steps_command_says_where_and_resumes(tmp_path, setup, sig):
    """SIGKILL: nothing said; the closed connection is EOF for the command's watcher, which ends its group."""
    inv, ct = setup
    proc = play(tmp_path, inv, wait=False)
    members: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 60
        while not (ct / "started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the play never reached its second step"
            time.sleep(0.05)
        members = running_group(ct / "pid")    # the step's command: its shell, its sleep, the watcher
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)     # the step's sleep 60 was not waited out
        still = left(members, 3)        # nothing of the step's command runs on in the container
    finally:
        proc.kill()
        kill_all(members)
    assert still == []
    assert out == "" and "Traceback" not in err, (out, err)
    mine = [line for line in err.splitlines() if not line.startswith("[ct200] ")]
    if sig == signal.SIGKILL:
        assert proc.returncode == -sig and mine == [], err
    else:
        assert proc.returncode == 128 + sig, err
        assert mine == [f"dflash-ops: interrupted ({sig.name}): ct200 stopped in step 'slow' (2/3), its command "
                        f"was ended; resume with `dflash-ops play slow.yaml ct200 --from slow`"], err
    (record,) = (tmp_path / "plays").glob("slow-*/ct200.json")
    assert lock_is_free(record)
    assert list(json.loads(record.read_text())["results"]) == ["first"]     # the step that ended, only
    assert [q.name for q in record.parent.iterdir() if q.name.startswith(".ct200.json.")] == []

    (ct / "go").write_text("")
    r = play(tmp_path, inv, "--from", "slow")
    assert r.returncode == 0, r.stderr
    assert (ct / "log").read_text() == "one\nthree\n"      # the first step ran once, the last once
    assert list(json.loads(record.read_text())["results"]) == ["first", "slow", "last"]


def test_the_line_names_where_each_target_stopped(tmp_path, setup, fakepct, make_inventory):
    """Two targets: one interrupted in its slow step, one whose play had ended (its go marker there)."""
    _, ct = setup
    fakepct.create(201)
    (fakepct.private(201) / "go").write_text("")
    inv = make_inventory({name: {"host": "node", "vmid": vmid, "python": sys.executable, "workdir": "/srv/ct/dflash"}
                          for name, vmid in (("ct200", 200), ("ct201", 201))})
    argv = [sys.executable, "-c", CLI_MAIN, "-i", str(inv), "play", "slow.yaml", "ct200", "ct201"]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=dict(os.environ, DFLASH_OPS_HOME=str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def ended_201() -> bool:
        try:
            (record,) = (tmp_path / "plays").glob("slow-*/ct201.json")
            return "last" in json.loads(record.read_text())["results"]
        except ValueError:      # no record yet (unpacking), or one being replaced
            return False
    members: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 60
        while not ((ct / "started").exists() and ended_201()):
            assert proc.poll() is None and time.monotonic() < deadline, "the plays never got there"
            time.sleep(0.05)
        members = running_group(ct / "pid")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        still = left(members, 3)
    finally:
        proc.kill()
        kill_all(members)
    assert still == []
    assert proc.returncode == 130, err
    assert [line for line in err.splitlines() if not line.startswith("[ct20")] == [
        "dflash-ops: interrupted (SIGINT): ct200 stopped in step 'slow' (2/3), its command was ended; resume with "
        "`dflash-ops play slow.yaml ct200 --from slow`; ct201 had ended"], err
