"""`export` killed at the controller mid-transfer: SIGINT, SIGTERM and SIGKILL while the folder
streams home; and its controller, agent or worker killed while the target exports or mid-transfer.

The export on the target is a stub release's trainer.export (no torch). Mid-transfer: its second file is
a FIFO the test controls: the runs agent hashes it (the test opens and closes its writing end once), sends
the header and the first file, then waits to read it again, so the transfer stands still mid-way for as
long as the test wants. Exporting: the stub waits while /srv/ct/hold is there. What must hold: exit
130 / 143 with one line, no partial folder left that looks whole (one a SIGKILL leaves is hidden, and the
next export sweeps it), the -o folder never created by a partial one, the agent on the target ended
(nothing left running in the container, no temporary folder), the next export succeeds. Through a real
sshd and the pct stand-in."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_bench_decode_remote import in_container
from trainer_quick import CLI_MAIN, wait_for

RUN = "20250101-120000-3fa9c1"
EXPORT = r'''
import argparse, json, os, time
p = argparse.ArgumentParser()
p.add_argument("--run"); p.add_argument("-o"); p.add_argument("--dtype"); p.add_argument("--step")
p.add_argument("--running-ok", action="store_true"); p.add_argument("--target-changed-ok", action="store_true")
a = p.parse_args()
os.makedirs(a.o)
if os.path.exists("/srv/ct/hold"):      # exporting until the test removes it (or kills this worker)
    with open("/srv/ct/worker.pid.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename("/srv/ct/worker.pid.tmp", "/srv/ct/worker.pid")
    while os.path.exists("/srv/ct/hold"):
        time.sleep(0.05)
with open(os.path.join(a.o, "a.bin"), "wb") as f:
    f.write(b"a" * (256 << 10))
if os.path.exists("/srv/ct/stall"):     # the agent reads b.pipe once to hash it, then again to send it
    os.mkfifo(os.path.join(a.o, "b.pipe"))
with open(os.path.join(a.o, "c.bin"), "wb") as f:
    f.write(b"c" * (256 << 10))
print(json.dumps({"step": 4, "checkpoint": "checkpoints/step-4", "mask_token_id": 1, "target_layer_ids": [1]}))
'''


@pytest.fixture
def ct(tmp_path, fakepct, make_inventory):
    """CT 200 whose workdir has a live release with the stub export and one succeeded run."""
    fakepct.create(200)
    private = fakepct.private(200)
    wd = private / "dflash"
    (wd / "releases" / "r1" / "trainer").mkdir(parents=True)
    (wd / "releases" / "r1" / "trainer" / "__init__.py").write_text("")
    (wd / "releases" / "r1" / "trainer" / "export.py").write_text(EXPORT)
    os.symlink("releases/r1", wd / "current")
    (wd / "runs" / RUN).mkdir(parents=True)
    (wd / "runs" / RUN / "run.json").write_text(json.dumps({"started_ts": 1}))
    (wd / "runs" / RUN / "exit.json").write_text(json.dumps({"state": "succeeded", "exit_code": 0}))
    inv = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable, "workdir": "/srv/ct/dflash",
                                    "gpus": 0}})
    return type("CT", (), dict(inv=inv, private=private, exports=wd / "exports", out=tmp_path / "out"))


def export(ct, tmp_path, wait=True, argv=None):
    argv = argv or [sys.executable, "-c", CLI_MAIN, "-i", str(ct.inv), "export", "ct200", RUN, "-o", str(ct.out)]
    env = dict(os.environ, DFLASH_OPS_HOME=str(tmp_path / "home"))
    if wait:
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    # SIGINT at its default, as Ctrl-C finds it (a suite run in the background ignores it)
    return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def partials(tmp_path) -> list[Path]:
    return [p for p in tmp_path.iterdir() if p.name.startswith(".dflash-export.partial-")]


def stalled(ct, tmp_path, argv=None) -> subprocess.Popen:
    """An export (argv: a command that exports) whose stream stands still after the header and a.bin
    (c.bin's file is open, empty)."""
    (ct.private / "stall").write_text("")
    proc = export(ct, tmp_path, wait=False, argv=argv)

    def fifo():
        return next(iter(ct.exports.glob(".tmp-*/draft/b.pipe")), None) if ct.exports.is_dir() else None

    def let_it_hash():
        path = wait_for(fifo, 60, "the stub export's FIFO")
        os.close(os.open(path, os.O_WRONLY))     # waits for the agent's hashing read; EOF for it at once
    opener = threading.Thread(target=let_it_hash, daemon=True)
    opener.start()
    try:
        wait_for(lambda: any((p / "c.bin").exists() for p in partials(tmp_path)) or proc.poll() is not None, 60,
                 "the transfer to reach c.bin")
        assert proc.poll() is None, proc.communicate()
        (partial,) = partials(tmp_path)
        assert (partial / "a.bin").stat().st_size == 256 << 10 and (partial / "c.bin").stat().st_size == 0
    except BaseException:
        proc.kill()
        raise
    opener.join(10)
    return proc


def nothing_left_on_the_target(ct, within: float) -> None:
    wait_for(lambda: not in_container(ct.private) and list(ct.exports.iterdir()) == [], within,
             "nothing of the export left in the container")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_export_interrupted_mid_transfer_leaves_nothing_and_the_next_one_succeeds(ct, tmp_path, sig):
    proc = stalled(ct, tmp_path)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert out == "" and err.splitlines() == [
        f"dflash-ops: ct200: export interrupted ({sig.name}): nothing written in {tmp_path}; the export on the target "
        "ended"], err
    assert partials(tmp_path) == [] and not ct.out.exists()
    nothing_left_on_the_target(ct, 5)       # already, as the controller said; a moment for /proc to agree

    (ct.private / "stall").unlink()
    r = export(ct, tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in ct.out.iterdir()) == ["a.bin", "c.bin"]
    assert partials(tmp_path) == [] and list(ct.exports.iterdir()) == []


def test_an_export_killed_mid_transfer_leaves_a_hidden_partial_the_next_one_sweeps(ct, tmp_path):
    proc = stalled(ct, tmp_path)
    proc.kill()
    proc.wait(timeout=10)
    (left,) = partials(tmp_path)    # hidden, named for its dead writer: never the -o folder
    assert left.name.startswith(f".dflash-export.partial-{proc.pid}-") and not ct.out.exists()
    nothing_left_on_the_target(ct, 20)      # the closed connection is EOF for the agent

    (ct.private / "stall").unlink()
    r = export(ct, tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in ct.out.iterdir()) == ["a.bin", "c.bin"]
    assert partials(tmp_path) == []


def exporting(ct, tmp_path) -> subprocess.Popen:
    """An export whose worker (the stub trainer.export) runs until the test removes /srv/ct/hold."""
    (ct.private / "hold").write_text("")
    proc = export(ct, tmp_path, wait=False)
    wait_for(lambda: (ct.private / "worker.pid").exists() or proc.poll() is not None, 60, "the export's worker")
    assert proc.poll() is None, proc.communicate()
    return proc


def agent_pid(ct) -> int:
    (tmp,) = ct.exports.glob(".tmp-*")      # the agent's private folder, named for it
    return int(tmp.name[len(".tmp-"):])


KILLS = [("controller", signal.SIGINT), ("controller", signal.SIGTERM), ("controller", signal.SIGKILL),
         ("agent", signal.SIGTERM), ("agent", signal.SIGKILL), ("worker", signal.SIGTERM), ("worker", signal.SIGKILL)]


CELLS = [("exporting", who, sig) for who, sig in KILLS] + \
    [("transfer", who, sig) for who, sig in KILLS if who == "agent"]


@pytest.mark.parametrize("phase, who, sig", CELLS,
                         ids=lambda v: v if isinstance(v, str) else v.name)
def test_an_export_whose_controller_agent_or_worker_is_killed_leaves_nothing_running(ct, tmp_path, phase, who, sig):
    """Each process of an export killed while the target exports (the worker runs) or mid-transfer (the
    worker has ended then: no cell; the controller: the tests above): one line from the controller (none
    when it is the one SIGKILLed), no partial folder here, no -o folder, nothing left running in the
    container; a temporary folder there only where the agent was SIGKILLed; the next export sweeps what
    is left and succeeds."""
    proc = exporting(ct, tmp_path) if phase == "exporting" else stalled(ct, tmp_path)
    try:
        agent = agent_pid(ct)
        victim = {"controller": proc.pid, "agent": agent}.get(who) or int((ct.private / "worker.pid").read_text())
        os.kill(victim, sig)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert out == "" and "Traceback" not in err, err
    if who == "controller" and sig == signal.SIGKILL:
        assert err == ""
    elif who == "controller":
        assert proc.returncode == 128 + sig and err.splitlines() == [
            f"dflash-ops: ct200: export interrupted ({sig.name}): nothing written in {tmp_path}; the export on the "
            "target ended"], err
    else:
        assert proc.returncode == 1 and len(err.splitlines()) == 1 and err.startswith("dflash-ops: ct200: "), err
        if who == "worker":
            assert f"export killed by signal {sig.value} ({sig.name}" in err, err
        else:
            how = "killed" if sig == signal.SIGKILL else "ended by SIGTERM"
            assert f"ct200: the export's agent on the target was {how} (exit {128 + sig}); nothing written in " \
                   f"{tmp_path}; its worker ended with it" in err, err
    assert not ct.out.exists()
    killed_here = who == "controller" and sig == signal.SIGKILL
    assert [p.name.startswith(f".dflash-export.partial-{proc.pid}-") for p in partials(tmp_path)] == \
        ([True] if killed_here and phase == "transfer" else [])
    wait_for(lambda: not in_container(ct.private), 20, "nothing of the export left running in the container")
    assert [p.name for p in ct.exports.iterdir()] == \
        ([f".tmp-{agent}"] if who == "agent" and sig == signal.SIGKILL else [])

    for marker in ("hold", "stall", "worker.pid"):
        (ct.private / marker).unlink(missing_ok=True)
    r = export(ct, tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in ct.out.iterdir()) == ["a.bin", "c.bin"]
    assert partials(tmp_path) == [] and list(ct.exports.iterdir()) == []


def test_a_play_interrupted_in_its_export_step_ends_the_export_on_the_target(ct, tmp_path):
    """play's `export` step holds the agent's stdin through the play's interrupt (transport.Hold) as its
    `exec` steps do: Ctrl-C mid-transfer ends the export there, leaves no partial, names the step."""
    (tmp_path / "ex.yaml").write_text(f"steps:\n  - name: bring\n    export: {{run: {RUN}, output: {ct.out}}}\n")
    argv = [sys.executable, "-c", CLI_MAIN, "-i", str(ct.inv), "play", "ex.yaml", "ct200"]
    proc = stalled(ct, tmp_path, argv)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and out == "" and "Traceback" not in err, err
    assert [line for line in err.splitlines() if not line.startswith("[ct200] ")] == [
        "dflash-ops: interrupted (SIGINT): ct200 stopped in step 'bring' (1/1), its command was ended; resume with "
        "`dflash-ops play ex.yaml ct200 --from bring`"], err
    assert partials(tmp_path) == [] and not ct.out.exists()
    nothing_left_on_the_target(ct, 5)
