"""`dflash-ops export` for real: a tiny CPU run launched through the tool in a pct stand-in container
behind a real sshd on 127.0.0.1, exported and streamed back, then loaded by the reference package."""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_quick import CLI_MAIN, IDLE_RUN, copy_trainer, tiny_run_config, wait_for

from orchestrator import inventory
from orchestrator.deploy import sync as deploy
from orchestrator.runs import export

REPO = Path(__file__).resolve().parent.parent
WORKDIR = "/srv/ct/dflash"
MAIN = CLI_MAIN
TINY = tiny_run_config(block_size=4, eval_new_tokens=8, checkpoint_every=2)


@pytest.fixture
def deployed(sshd, fakepct, make_inventory, tmp_path):
    """CT 200 with the trainer deployed, no run yet."""
    src = tmp_path / "src"
    copy_trainer(src)
    fakepct.create(200)
    path = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable,
                                     "workdir": WORKDIR, "gpus": 0}})
    inv = inventory.load(str(path))
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)

    def cli(*args, timeout=180):
        return subprocess.run([sys.executable, "-c", MAIN, "-i", str(path), *map(str, args)],
                              capture_output=True, timeout=timeout, cwd=tmp_path,
                              env=dict(os.environ, DFLASH_OPS_HOME=str(tmp_path / "home")))

    r = cli("export", "ct200")
    assert r.returncode == 102 and b"no runs yet" in r.stderr, r.stderr
    assert deploy.deploy(inv, ["ct200"], source=str(src))["ct200"].ok
    return type("CT", (), dict(inv=inv, cli=staticmethod(cli), pct=fakepct, tmp=tmp_path,
                               exports=fakepct.private(200) / "dflash" / "exports"))


@pytest.fixture
def ct(deployed):
    """The same, with one succeeded 4-step run (launched with dflash-ops)."""
    r = deployed.cli("launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", deployed.tmp / "tiny.yaml",
                     "--", "--steps", "4")
    assert r.returncode == 0, r.stderr.decode()
    deployed.run = r.stdout.decode().strip()
    r = deployed.cli("logs", "ct200", deployed.run, "--follow")
    assert r.returncode == 0, r.stderr.decode()
    return deployed


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_export_streams_the_latest_succeeded_run_home_and_refuses_bad_input(ct, monkeypatch):
    dest = ct.tmp / "drafter"
    r = ct.cli("export", "ct200", "-o", dest, "--json")
    assert r.returncode == 0, r.stderr.decode()
    doc = json.loads(r.stdout)
    assert doc["run"] == ct.run and doc["step"] == 4 and doc["dtype"] == "bfloat16"
    assert doc["output"] == str(dest) and doc["target_layer_ids"] == [1, 2, 3, 4, 5]
    names = sorted(f["name"] for f in doc["files"])
    assert names == ["config.json", "dflash_ops.json", "model.safetensors"]
    assert sorted(p.name for p in dest.iterdir()) == names
    for f in doc["files"]:   # what arrived is what the target hashed
        assert (dest / f["name"]).stat().st_size == f["size"] and sha256(dest / f["name"]) == f["sha256"]
    # nothing left behind: not on the target, not beside the destination
    assert ct.exports.is_dir() and list(ct.exports.iterdir()) == []
    assert sorted(p.name for p in ct.tmp.iterdir() if p.name.startswith(".")) == []

    import torch
    from dflash.model import DFlashDraftModel

    draft, info = DFlashDraftModel.from_pretrained(str(dest), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert draft.block_size == 4 and draft.mask_token_id == 260 and draft.config.num_hidden_layers == 1
    assert next(draft.parameters()).dtype == torch.bfloat16

    # -o of /, the current folder or one holding it: refused before anything travels, even with --force
    for o, needle in (("/", "is the root folder"), (".", "is the current folder or holds it"),
                      ("..", "is the current folder or holds it")):
        r = ct.cli("export", "ct200", ct.run, "-o", o, "--force")
        err = r.stderr.decode()
        assert r.returncode == 2 and f"-o {o}: {needle}" in err and len(err.splitlines()) == 1, err
    assert list(ct.exports.iterdir()) == []
    # --force replaces an earlier export only: a folder of the user's (here a home's dotfiles) is refused
    # before anything travels and left byte for byte as it was
    home = ct.tmp / "homelike"
    (home / ".cache").mkdir(parents=True)
    (home / ".bashrc").write_text("export PATH=$PATH\n")
    (home / ".cache" / "w.whl").write_bytes(b"\0" * 100)
    (home / "config.json").write_text("{}")
    before = {p: p.read_bytes() if p.is_file() else None for p in sorted(home.rglob("*"))}
    r = ct.cli("export", "ct200", ct.run, "-o", home, "--force")
    err = r.stderr.decode()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err
    assert "holds '.bashrc', '.cache', which an export does not write" in err and "nothing was replaced" in err, err
    assert {p: p.read_bytes() if p.is_file() else None for p in sorted(home.rglob("*"))} == before
    # what killed exports left beside the destination goes with the next export there; a live writer's stays
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = ct.tmp / f".dflash-export.partial-{gone.pid}-1"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"\0" * 4096)
    live = ct.tmp / f".dflash-export.partial-{os.getpid()}-1"
    live.mkdir()

    # an existing folder is kept unless --force; an earlier checkpoint by --step; the default name
    r = ct.cli("export", "ct200", ct.run, "-o", dest)
    assert r.returncode == 2 and b"already exists (pass --force" in r.stderr and b"Traceback" not in r.stderr
    # (--target-changed-ok with the target unchanged: exported, nothing said to have changed)
    r = ct.cli("export", "ct200", ct.run, "-o", dest, "--force", "--step", "2", "--dtype", "float32",
               "--target-changed-ok", "--json")
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["step"] == 2 and json.loads(r.stdout)["running"] is False
    assert json.loads(r.stdout)["target_changed"] == []
    assert json.loads((dest / "dflash_ops.json").read_text())["step"] == 2
    assert not left.exists() and live.is_dir()
    live.rmdir()
    # a full disk here is said so, in one line, and leaves nothing (here: every file written reaches /dev/full)
    real_open = open

    def full(path, mode="r", *args, **kw):
        return real_open("/dev/full", mode) if export.PARTIAL in str(path) else real_open(path, mode, *args, **kw)

    monkeypatch.setattr(export, "open", full, raising=False)
    with pytest.raises(export.OpsError) as e:
        export.export(ct.inv, ct.inv.targets["ct200"], ct.run, output=str(ct.tmp / "full"))
    monkeypatch.undo()
    assert f"ct200: export into {ct.tmp}: disk full (No space left on device; the drafter is " in str(e.value)
    assert not (ct.tmp / "full").exists() and [p.name for p in ct.tmp.iterdir() if p.name.startswith(".")] == []
    r = ct.cli("export", "--step", "4")   # default target (the only one), default run, outside the checkout
    assert r.returncode == 0, r.stderr.decode()
    home = ct.tmp / "home" / "exports" / "ct200" / f"dflash-{ct.run}-step4"
    assert (home / "model.safetensors").is_file() and not (ct.tmp / f"dflash-{ct.run}-step4").exists()
    assert r.stdout.decode().strip() == str(home)
    assert list(ct.exports.iterdir()) == []

    # bad input: one line (Click's own option errors: its usage block), documented exit codes
    for args, code, needle in [
            (("ct200", ct.run, "--step", "3"), 2, b"--step 3: no complete checkpoint of that step"),
            (("ct200", "20200101-000000-abcdef"), 102, b"no run '20200101-000000-abcdef'"),
            (("ct200", "--dtype", "int8"), 2, b"'int8' is not one of"),
            (("nosuch",), 2, b"nosuch"),
            (("ct200", "--", "--step"), 2, b"got ct200 --step"),   # never read as an option
    ]:
        r = ct.cli("export", *args, "-o", ct.tmp / "x")
        err = r.stderr.decode()
        assert r.returncode == code and needle in r.stderr, (args, r.returncode, err)
        assert "Traceback" not in err and (len(err.strip().splitlines()) == 1 or err.startswith("Usage:")), err
    assert not (ct.tmp / "x").exists() and list(ct.exports.iterdir()) == []
    (ct.tmp / "empty").mkdir()   # an empty folder is no exception (--force exports into it below)
    r = ct.cli("export", "ct200", ct.run, "-o", ct.tmp / "empty")
    assert r.returncode == 2 and b"already exists (pass --force" in r.stderr, r.stderr
    # The target at the run's path is another one now (tiny's seed 1: same shape, other weights):
    # refused, then exported with --target-changed-ok, which travels to the trainer and says what changed.
    config = ct.pct.private(200) / "dflash" / "runs" / ct.run / "trainer-config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "target": "tiny:1"}))
    r = ct.cli("export", "ct200", ct.run, "-o", ct.tmp / "empty", "--force")
    assert r.returncode == 2 and b"target" in r.stderr and b"--target-changed-ok" in r.stderr, r.stderr
    r = ct.cli("export", "ct200", ct.run, "-o", ct.tmp / "empty", "--force", "--target-changed-ok", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["target_changed"] != [], r.stderr.decode()
    assert (ct.tmp / "empty" / "model.safetensors").is_file()


def test_a_running_run_exports_only_with_running_ok_which_says_its_step(deployed):
    # after its first checkpoint (checkpoint_every 2) the run sleeps 0.2 s before each step: it only has to
    # be running, not to keep a core busy that the exports beside it share
    r = deployed.cli("launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", deployed.tmp / "tiny.yaml",
                     *IDLE_RUN, "--", "--steps", "100000")
    assert r.returncode == 0, r.stderr.decode()
    run = r.stdout.decode().strip()
    try:
        ck = deployed.pct.private(200) / "dflash" / "runs" / run / "checkpoints" / "latest"
        wait_for(ck.is_file, timeout=120, what="the running run's first checkpoint")
        r = deployed.cli("export", "ct200", run, "-o", deployed.tmp / "d")
        err = r.stderr.decode()
        assert r.returncode == 2 and "still running (pass --running-ok" in err and len(err.splitlines()) == 1, err
        # one export, in text mode: its note (said only for a result marked running) names the step
        r = deployed.cli("export", "ct200", run, "-o", deployed.tmp / "d", "--running-ok")
        err = r.stderr.decode()
        assert r.returncode == 0 and r.stdout.decode().strip() == str(deployed.tmp / "d"), err
        said = re.search(rf"ct200: run {run} is still running: this is its checkpoint of step (\d+)\n", err)
        assert said, err
        step = int(said[1])
        assert step >= 2 and step % 2 == 0
        assert json.loads((deployed.tmp / "d" / "dflash_ops.json").read_text())["step"] == step
        assert f"run {run} step {step} exported" in err, err
    finally:
        assert deployed.cli("stop", "ct200", run).returncode == 0


def test_an_output_that_holds_the_cwd_or_a_local_workdir_is_unsafe(tmp_path, monkeypatch):
    from orchestrator.inventory import Target

    (tmp_path / "w" / "runs").mkdir(parents=True)
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    local = Target(name="local", workdir=str(tmp_path / "w"))
    remote = Target(name="ct", host="node", vmid=200, workdir=str(tmp_path / "w"))
    assert "root folder" in export.unsafe_output(Path("/"), remote)
    assert "root folder" in export.unsafe_output(Path("//"), remote)
    for o in (".", "..", str(tmp_path), "./x/.."):
        assert "current folder or holds it" in export.unsafe_output(Path(o), remote), o
    assert "holds local's workdir" in export.unsafe_output(tmp_path / "w", local)
    assert export.unsafe_output(tmp_path / "w", remote) is None          # not this machine's folder
    assert export.unsafe_output(Path("drafter"), local) is None
    assert export.unsafe_output(tmp_path / "w" / "runs" / "x", local) is None


def test_a_damaged_stream_never_reaches_the_destination(tmp_path):
    """The receiver checks sizes and hashes; a mismatch or a short stream raises, nothing is renamed."""
    good = b"hello drafter"
    head = {"ok": True, "run": "r", "step": 1,
            "files": [{"name": "a.bin", "size": len(good), "sha256": hashlib.sha256(good).hexdigest()}]}
    line = json.dumps(head).encode() + b"\n"
    for body, err in ((b"hellO drafter", "sha256 mismatch"), (good[:5], "ended after 0 of 1"),
                      (good + b"!", "bytes more")):
        recv = export._Receiver(tmp_path / f"p{len(body)}{body[:1]!r}", None, "t")
        for i in range(0, len(line + body), 3):   # in small pieces, as a stream arrives
            recv((line + body)[i:i + 3])
        recv.close()
        with pytest.raises(export.TransferError, match=err):
            recv.check()
    recv = export._Receiver(tmp_path / "ok", None, "t")
    recv(line + good)
    recv.check()
    assert (tmp_path / "ok" / "a.bin").read_bytes() == good
    with pytest.raises(export.TransferError, match="plain name"):
        export._Receiver(tmp_path / "evil", None, "t")(
            json.dumps({"ok": True, "files": [{"name": "../x", "size": 1, "sha256": ""}]}).encode() + b"\n")


def test_the_joined_runs_agent_with_export_is_python_38():
    from orchestrator.ssh import agent_call

    assert "runs.export" in agent_call.parts(agent_call.RUNS)
    ast.parse(agent_call.source(agent_call.RUNS), feature_version=(3, 8))
