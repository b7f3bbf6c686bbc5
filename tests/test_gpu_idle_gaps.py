"""benchmarks/gpu_idle_gaps.py: idle gaps on a profiler timeline, attributed through each kernel's launch."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_idle_gaps import gap_report, load, main  # noqa: E402


def _k(name, ts, dur, corr, dev=0):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": dev, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "device": dev}}


def _launch(ts, dur, corr, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": tid, "ts": ts, "dur": dur,
            "args": {"correlation": corr}}


def _op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 100, "tid": tid, "ts": ts, "dur": dur, "args": {}}


# A timeline of 4 kernels on device 0:
#   k1 0-10, k2 10-20 (back to back), [gap 30 us: k3 launched at 45, inside optimizer > aten::norm:
#   the host was late], k3 50-60, [gap 20 us: k4 launched at 5 inside compiled, long before: a
#   device-side wait], k4 80-90.
EVENTS = [
    _op("step", 0, 100), _op("compiled", 1, 20), _launch(2, 1, 1), _launch(3, 1, 2),
    _op("optimizer", 40, 20), _op("aten::norm", 44, 5), _launch(45, 2, 3),
    _launch(5, 1, 4),
    _k("k1", 0, 10, 1), _k("k2", 10, 10, 2), _k("k3", 50, 10, 3), _k("k4", 80, 10, 4),
]


def test_gaps_are_measured_and_charged_to_the_launching_op():
    rep = gap_report(EVENTS)
    d = rep["devices"]["0"]
    assert (d["span_ms"], d["busy_ms"], d["idle_ms"], d["kernels"]) == (0.09, 0.04, 0.05, 4)
    assert rep["idle_ms_by_kind"] == {"host": 0.03, "device": 0.02}
    host = rep["longest"][0]
    assert (host["us"], host["kind"], host["before"], host["after"]) == (30, "host", "k2", "k3")
    assert (host["outer"], host["inner"]) == ("step", "aten::norm")
    dev = rep["longest"][1]
    assert (dev["us"], dev["kind"], dev["before"], dev["after"], dev["inner"]) == (20, "device", "k3", "k4", "compiled")
    assert rep["idle_ms_by_op"][0] == {"where": "host: step > aten::norm", "ms": 0.03, "gaps": 1}


def test_small_gaps_and_overlapping_streams_are_busy():
    events = [_k("a", 0, 10, 1), _k("b", 5, 20, 2), _k("c", 26, 4, 3),
              _launch(0, 1, 1), _launch(0, 1, 2), _launch(1, 1, 3)]
    rep = gap_report(events, min_gap_us=2.0)
    assert rep["gaps"] == 0 and rep["devices"]["0"]["busy_ms"] == 0.03


def test_the_command_reads_a_gzipped_trace_and_refuses_a_bad_one(tmp_path, capsys):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    assert len(load(str(path))) == len(EVENTS)
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "idle by kind" in out and "host: step > aten::norm" in out
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main([str(bad)]) == 2
    assert capsys.readouterr().err.startswith("gaps: error: cannot read")
