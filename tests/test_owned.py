"""trainer/owned.py and trainer/files.py: a folder the user named is replaced only when it is what the
command writes (an earlier export, an earlier build), atomically, and a kill never leaves it half."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer import owned
from trainer.files import NotOurs, atomic_folder, swap_in

ROOT = Path(__file__).resolve().parent.parent


def an_export(folder: Path, step: int = 1, size: int = 64) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"step": step}))
    (folder / "model.safetensors").write_bytes(bytes([step % 256]) * size)
    (folder / owned.EXPORT_PROVENANCE).write_text(json.dumps({"run": "r", "step": step}))
    return folder


def home_like(folder: Path) -> dict[str, bytes]:
    """A folder as a user's home holds one: dotfiles, a subfolder, a file an export also writes."""
    (folder / ".cache" / "pip").mkdir(parents=True)
    (folder / ".bashrc").write_text("export PATH=$PATH\n")
    (folder / ".cache" / "pip" / "wheel.whl").write_bytes(b"\x00" * 1000)
    (folder / "config.json").write_text("{}")
    return snapshot(folder)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(folder.rglob("*"))}


def test_only_an_earlier_export_or_an_empty_folder_may_be_replaced(tmp_path):
    assert owned.not_an_export(tmp_path / "absent") is None
    (tmp_path / "empty").mkdir()
    assert owned.not_an_export(tmp_path / "empty") is None
    assert owned.not_an_export(an_export(tmp_path / "exp")) is None

    home = tmp_path / "home"
    home.mkdir()
    home_like(home)
    assert "holds '.bashrc', '.cache', 'config.json'" not in owned.not_an_export(home)    # names the aliens only
    assert "holds '.bashrc', '.cache', which an export does not write" in owned.not_an_export(home)
    # the export's own names without its record: not ours
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text("{}")
    assert "has no readable dflash_ops.json" in owned.not_an_export(tmp_path / "bare")
    # a record that is not an object, or too deep to read, is no record
    (tmp_path / "bare" / owned.EXPORT_PROVENANCE).write_text("[" * 100_000)
    assert "has no readable dflash_ops.json" in owned.not_an_export(tmp_path / "bare")
    # an export with a folder put in it, a link, a file
    sub = an_export(tmp_path / "sub")
    (sub / "model.safetensors").unlink()
    (sub / "model.safetensors").mkdir()
    assert "holds 'model.safetensors', which is not a plain file" in owned.not_an_export(sub)
    os.symlink(tmp_path / "exp", tmp_path / "link")
    assert "is a symbolic link" in owned.not_an_export(tmp_path / "link")
    (tmp_path / "file").write_text("x")
    assert "is a file" in owned.not_an_export(tmp_path / "file")


def test_a_small_target_build_replaces_only_an_earlier_build(tmp_path):
    build = tmp_path / "b"
    build.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (build / name).write_text("x")
    assert "has no readable small_lm.json" in owned.not_a_small_lm(build)
    (build / owned.SMALL_LM_REPORT).write_text(json.dumps({"recipe": {}}))
    assert owned.not_a_small_lm(build) is None
    (build / "train.py").write_text("x")
    assert "holds 'train.py'" in owned.not_a_small_lm(build)


def test_atomic_folder_refuses_before_filling_and_leaves_the_users_folder_byte_for_byte(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    before = home_like(home)
    filled = []
    with pytest.raises(NotOurs, match="nothing was replaced"):
        with atomic_folder(home, replaces=owned.not_an_export) as tmp:
            filled.append(tmp)
    assert filled == [] and snapshot(home) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]


def test_swap_in_replaces_an_earlier_export_and_removes_the_old_one(tmp_path):
    dest = an_export(tmp_path / "d", step=1)
    new = an_export(tmp_path / "new", step=2)
    swap_in(new, dest, owned.not_an_export)
    assert json.loads((dest / "config.json").read_text()) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    # a folder that became the user's between the check and the swap is still refused, the new one left
    (dest / "mine.txt").write_text("x")
    new = an_export(tmp_path / "new", step=3)
    with pytest.raises(NotOurs):
        swap_in(new, dest, owned.not_an_export)
    assert (dest / "mine.txt").read_text() == "x" and new.is_dir()


# A writer that replaces the export at `dest` again and again with a new step, until killed
REPLACER = """
import json, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from trainer import owned
from trainer.files import atomic_folder
dest = Path(sys.argv[1])
step = 2
while True:
    with atomic_folder(dest, replaces=owned.not_an_export) as tmp:
        (tmp / "config.json").write_text(json.dumps({{"step": step}}))
        (tmp / "model.safetensors").write_bytes(bytes([step % 256]) * 200_000)
        (tmp / owned.EXPORT_PROVENANCE).write_text(json.dumps({{"run": "r", "step": step}}))
    step += 1
"""


def whole(dest: Path) -> bool:
    """dest is one export, all three files of the same step."""
    step = json.loads((dest / "config.json").read_text())["step"]
    weights = (dest / "model.safetensors").read_bytes()
    return (json.loads((dest / owned.EXPORT_PROVENANCE).read_text())["step"] == step
            and set(weights) == {step % 256} and sorted(p.name for p in dest.iterdir()) == sorted(owned.EXPORT_FILES))


def test_a_writer_killed_at_any_moment_of_replacing_leaves_a_whole_export(tmp_path):
    dest = an_export(tmp_path / "d", step=1, size=200_000)
    script = REPLACER.format(root=str(ROOT))
    rng = random.Random(0)
    for _ in range(12):
        p = subprocess.Popen([sys.executable, "-c", script, str(dest)])
        time.sleep(0.15 + rng.random() * 0.3)       # past the start-up, somewhere in its replacing
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert dest.is_dir() and whole(dest)
    # what killed writers left beside it is theirs (hidden, named by their pid), never the destination
    assert all(p.name.startswith((".tmp-d-", ".old-d-")) for p in tmp_path.iterdir() if p.name != "d")


def dflash_ops(*args, cwd: Path, home: Path) -> subprocess.CompletedProcess:
    from trainer_quick import CLI_MAIN

    env = dict(os.environ, DFLASH_OPS_HOME=str(home))
    return subprocess.run([sys.executable, "-c", CLI_MAIN, *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def test_play_refuses_a_users_folder_as_the_exports_output_before_any_step(tmp_path):
    """playbooks/train.yaml exports with force: true; `--var output=~` once replaced the home folder."""
    home = tmp_path / "home"
    home.mkdir()
    before = home_like(home)
    work = tmp_path / "work"
    work.mkdir()
    r = dflash_ops("play", ROOT / "playbooks" / "train.yaml", "--var", f"output={home}", cwd=work,
                   home=tmp_path / "ops")
    assert r.returncode == 2 and r.stdout == "", r.stderr
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "train.yaml:" in err and "export.output: -o " in err and "nothing was replaced" in err, err
    assert "holds '.bashrc', '.cache', which an export does not write" in err, err
    assert snapshot(home) == before
    assert not (tmp_path / "ops" / "plays").exists() or not any((tmp_path / "ops" / "plays").rglob("*.json"))
    # an earlier export at the same place passes the check (the play would replace it)
    an_export(tmp_path / "prev")
    r = dflash_ops("play", ROOT / "playbooks" / "train.yaml", "--var", f"output={tmp_path / 'prev'}", "--dry-run",
                   cwd=work, home=tmp_path / "ops")
    assert r.returncode == 0, r.stderr
