"""scripts/detach.sh: device work longer than one call, as a detached driver that calls poll."""
from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sh(*args: str, out: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/detach.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={"PATH": "/usr/bin:/bin", "OUT": str(out)})


def test_a_driver_outlives_its_start_and_polls_bring_back_its_output(tmp_path):
    d, out = tmp_path / "d", tmp_path / "ret"
    out.mkdir()
    go = tmp_path / "go"
    start = _sh("start", str(d), "bash", "-c",
                f'until [ -f {go} ]; do sleep 0.1; done; echo made > "$OUT/f.txt"; echo done; exit 3', out=out)
    assert start.returncode == 0 and "started in" in start.stdout, start.stderr
    assert (d / "src" / "scripts" / "detach.sh").is_file() and not (d / "src" / ".venv").exists()
    early = _sh("poll", str(d), "0", out=out)
    assert early.returncode == 0 and "still running" in early.stdout
    go.touch()
    late = _sh("poll", str(d), "30", out=out)
    assert late.returncode == 3 and "done" in late.stdout and "ended, rc 3" in late.stdout
    with tarfile.open(out / "detached.tgz") as t:
        assert t.extractfile("out/f.txt").read() == b"made\n"
    again = _sh("start", str(d), "true", out=out)
    assert again.returncode == 2 and "started there already" in again.stderr


def test_bad_input_gets_one_line_and_exit_2(tmp_path):
    for args, said in ((("start", "rel/dir", "true"), "absolute path"),
                       (("start", str(ROOT / "x"), "true"), "outside the tree"),
                       (("poll", str(tmp_path), "soon"), "whole number"),
                       (("stop", str(tmp_path)), "unknown command"),
                       ((), "usage")):
        p = _sh(*args, out=tmp_path)
        assert p.returncode == 2 and said in p.stderr and len(p.stderr.strip().splitlines()) == 1, (args, p.stderr)
