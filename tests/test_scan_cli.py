"""`dflash-ops scan`: documented exit codes and JSON shape, on real captures."""
import json
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data"


def scan(*args):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "scan", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_fatal_capture_exits_100_and_names_it():
    # Captured on the H200 (torch 2.11), probe case reduce-overhead x 2 threads.
    r = scan(DATA / "signatures" / "cudagraph-trees-tls--h200-2.11.txt", "--json")
    assert r.returncode == 100
    hits = json.loads(r.stdout)["files"]
    [(path, found)] = hits.items()
    assert [h["signature"] for h in found] == ["cudagraph-trees-tls"]
    assert found[0]["severity"] == "fatal" and isinstance(found[0]["line"], int)


def test_clean_log_exits_0():
    r = scan(DATA / "clean_train.log")
    assert r.returncode == 0 and "no failure signatures found" in r.stdout


def test_missing_file_is_one_line():
    r = scan("/nonexistent/train.log")
    assert r.returncode in (2, 102) and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
