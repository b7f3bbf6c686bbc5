"""What a newcomer meets in the first hour, from the checkout: a misspelled command gets a "did you
mean", the shipped example inventory is not read by default (nothing reaches its machines), and
`scan` of a missing file exits with the code the README lists."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trainer_quick import CLI_MAIN

REPO = Path(__file__).resolve().parent.parent


def dflash_ops(*args, cwd=REPO, home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_OPS_INVENTORY"}
    env["DFLASH_OPS_HOME"] = str(home)
    return subprocess.run([sys.executable, "-c", CLI_MAIN, *map(str, args)], capture_output=True, text=True,
                          timeout=60, cwd=cwd, env=env)


def test_a_misspelled_command_is_one_line_with_did_you_mean(tmp_path):
    for typed, want in (("stauts", "did you mean 'status'?"), ("log", "did you mean 'logs'?"),
                        ("frobnicate", "commands: bench-decode, deploy,")):
        r = dflash_ops(typed, home=tmp_path)
        assert r.returncode == 2 and f"No such command '{typed}' ({want}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_the_checkout_reads_no_example_inventory_so_only_local_is_there(tmp_path):
    r = dflash_ops("targets", "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [t["target"] for t in json.loads(r.stdout)["targets"]] == ["local"]
    r = dflash_ops("-i", "hosts.example.yaml", "targets", "--json", home=tmp_path)
    assert r.returncode == 0 and "ct200" in r.stdout, r.stderr


def test_scan_of_a_missing_file_exits_102_as_the_readme_says(tmp_path):
    r = dflash_ops("scan", tmp_path / "missing.log", home=tmp_path)
    assert r.returncode == 102 and "no such file" in r.stderr
    assert "`scan`: 100 a fatal signature was found, 102 no such file." in (REPO / "README.md").read_text()


def test_rm_of_an_unknown_run_says_only_that(tmp_path):
    """It printed `local: freed 0 bytes` before its error."""
    r = dflash_ops("rm", "local", "nope", home=tmp_path)
    assert r.returncode == 102 and r.stdout == "", r.stdout
    assert r.stderr == "dflash-ops: local: no run 'nope' (see `dflash-ops status local`)\n", r.stderr
