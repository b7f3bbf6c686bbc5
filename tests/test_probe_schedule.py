"""The probe's cases side by side (trainer/probe/schedule.py): they run at once, each timed phase
runs alone (every other case, and every process under it, stopped meanwhile), a case's timeout does
not count the time it was stopped, and every case gets the one shared compile cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.probe import schedule
from trainer.probe import case_watch as watch

REPO = Path(__file__).resolve().parents[1]

# A stand-in case: ticks (a timestamp every 5 ms) into NAME.ticks through its phases; its timed phase
# waits for its turn like case.py's. With a third argument it also starts a child in a session of
# its own (as torchrun starts its ranks) that ticks into NAME-child.ticks.
FAKE = r"""
import json, os, subprocess, sys, time
from trainer.probe.case_watch import PHASE_MARK, CASE_MARK, wait_for_turn
name, out, before, child = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "child"
timed = float(sys.argv[5]) if len(sys.argv) > 5 else 0.6

def tick(seconds, who=name):
    end = time.time() + seconds
    with open(os.path.join(out, who + ".ticks"), "a") as f:
        while time.time() < end:
            f.write(repr(time.time()) + "\n"); f.flush(); time.sleep(0.005)

if child:
    code = ("import time\nend = time.time() + 30\nf = open(%r, 'a')\nwhile time.time() < end:\n"
            "    f.write(repr(time.time()) + '\\n'); f.flush(); time.sleep(0.005)\n") % (
        os.path.join(out, name + "-child.ticks"),)
    # (not on this case's pipes: a child that outlives its case would hold them open, and the parent's
    # reader would wait its 5 s for them to close; it is found and stopped as a descendant, not by them)
    kid = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    open(os.path.join(out, "child.pid"), "w").write(str(kid.pid))
print(PHASE_MARK + "compile", flush=True)
tick(before)
print(PHASE_MARK + "timed", flush=True)
wait_for_turn()
t0 = time.time(); tick(timed); t1 = time.time()
print(PHASE_MARK + "verdict", flush=True)
tick(0.3)
print(CASE_MARK + json.dumps({"ok": True, "window": [t0, t1]}), flush=True)
"""


def _ticks(path: Path) -> list[float]:
    return [float(x) for x in path.read_text().split()] if path.exists() else []


def test_cases_run_side_by_side_and_each_timed_phase_runs_alone(tmp_path):
    script = tmp_path / "fake_case.py"
    script.write_text(FAKE)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cases = {"a": (1.5, "child"), "b": (0.5, "-"), "c": (1.0, "-")}
    records = {}

    def run_one(name, control):
        before, child = cases[name]
        run = watch.run_isolated([sys.executable, str(script), name, str(tmp_path), str(before), child], 60,
                                 env=dict(env, **control.env()), control=control)
        records[name] = control.record()
        return run

    results = schedule.run_all(list(cases), 3, run_one)
    assert all(r["result"]["ok"] and r["exit_code"] == 0 for r in results.values()), results
    windows = {n: r["result"]["window"] for n, r in results.items()}
    ticks = {p.stem: _ticks(p) for p in tmp_path.glob("*.ticks")}
    assert set(ticks) == {"a", "b", "c", "a-child"}
    # side by side: the cases' first ticks all came before any case's last
    assert max(v[0] for k, v in ticks.items() if k != "a-child") < min(v[-1] for v in ticks.values())
    for name, (t0, t1) in windows.items():
        for other, (o0, o1) in windows.items():
            assert other == name or o1 <= t0 or o0 >= t1, (name, other, windows)     # no two timed at once
        for who, stamps in ticks.items():
            if not who.startswith(name):
                # nothing else ran during the timed phase: not the other cases, not a's child in its own session
                assert not [s for s in stamps if t0 + 0.02 < s < t1 - 0.02], (name, who)
    assert all(r["alone"] and r["timed_at"][1] > r["timed_at"][0] for r in records.values()), records
    assert sum(r["paused_s"] for r in records.values()) > 0.5
    os.kill(int((tmp_path / "child.pid").read_text()), 9)      # a's child, in its own session, still ticking


def test_a_stopped_case_is_not_timed_out_for_the_time_it_was_stopped(tmp_path):
    script = tmp_path / "fake_case.py"
    script.write_text(FAKE)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    ctl_long, ctl_short = {}, {}

    def run_one(name, control):
        # "slow" is stopped for the 5 s "quick" is timed; its 6 s timeout holds only its own ~3 s of work
        before, timed, timeout = {"quick": (0.1, "5", 60), "slow": (1.6, "0.6", 6)}[name]
        (ctl_long if name == "slow" else ctl_short)["c"] = control
        return watch.run_isolated([sys.executable, str(script), name, str(tmp_path), str(before), "-", timed],
                                  timeout, env=dict(env, **control.env()), control=control)

    results = schedule.run_all(["quick", "slow"], 2, run_one)
    assert not results["slow"]["timed_out"] and results["slow"]["result"]["ok"], results["slow"]["tail"]
    assert ctl_long["c"].paused_s >= 4.0 and results["slow"]["seconds"] > 6


def test_one_at_a_time_there_is_no_gate_and_the_planned_order(tmp_path):
    seen = []
    schedule.run_all([3, 1, 2], 1, lambda i, control: seen.append((i, control.env(), control.turns)))
    assert seen == [(3, {}, None), (1, {}, None), (2, {}, None)]


def test_side_by_side_the_threads_cases_start_first_dearest_first():
    cost = ("eager", "inductor", "reduce-overhead", "max-autotune-no-cudagraphs")
    plan = [(p, t, 2) for p in cost for t in ("threads", "processes")]
    order = schedule.run_order(list(range(len(plan))), plan, 4, cost)
    assert [plan[i][:2] for i in order] == [(p, t) for t in ("threads", "processes") for p in reversed(cost)]
    assert schedule.run_order([0, 1, 2], plan, 1, cost) == [0, 1, 2]


def test_every_case_gets_the_one_compile_cache_under_the_workdir(tmp_path, monkeypatch):
    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE",
              "TORCHINDUCTOR_AUTOGRAD_CACHE"):
        monkeypatch.delenv(k, raising=False)
    with schedule.compile_caches(str(tmp_path)) as env:
        assert env == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "probe-compile-cache" / "inductor"),
                       "TRITON_CACHE_DIR": str(tmp_path / "probe-compile-cache" / "triton"),
                       "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    with schedule.compile_caches(None) as env:
        folder = Path(env["TORCHINDUCTOR_CACHE_DIR"]).parent
        assert folder.is_dir()
    assert not folder.exists()          # no workdir: this probe's own, removed at its end
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    with schedule.compile_caches(str(tmp_path)) as env:
        assert "TORCHINDUCTOR_CACHE_DIR" not in env     # the caller's choice is kept
    # inductor's first use in this process exports torch's default dir: not a choice, the shared one wins
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") is None and cache_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == schedule._inductor_default()
    with schedule.compile_caches(str(tmp_path)) as env:
        assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "probe-compile-cache" / "inductor")


# ---- the real probe, on this machine ------------------------------------------------------------

def _probe(workdir: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "trainer.probe", "--threads", "2", "--steps", "2", "--timeout", "300",
           "--workdir", str(workdir), "--fresh", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_the_real_probe_side_by_side_times_each_case_alone_ddp_ranks_included(tmp_path):
    pytest.importorskip("torch")
    doc = _probe(tmp_path, "--policies", "eager", "--topologies", "threads,processes", "--jobs", "2")
    cases = {c["topology"]: c for c in doc["cases"]}
    assert doc["jobs"] == 2 and [c["outcome"] for c in cases.values()] == ["ok", "ok"], doc["cases"]
    (a0, a1), (b0, b1) = (c["schedule"]["timed_at"] for c in cases.values())
    assert (a1 <= b0 or b1 <= a0) and all(c["schedule"]["alone"] for c in cases.values()), doc["cases"]
    cache = str(tmp_path / "probe-compile-cache")
    assert {(c["caches"]["inductor"], c["caches"]["triton"]) for c in cases.values()} == {
        (f"{cache}/inductor", f"{cache}/triton")}                      # every case, the ranks' too


def test_a_probe_stopped_by_sigterm_kills_its_running_cases_and_reports_what_it_has(tmp_path):
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "trainer.probe", "--threads", "2", "--steps", "2", "--timeout", "300",
           "--workdir", str(tmp_path), "--policies", "eager,inductor"]
    mark = f"DFLASH_TEST_MARK={os.getpid()}-{time.time()}".encode()    # inherited by every case process
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, DFLASH_TEST_MARK=mark.decode().split("=", 1)[1]))
    err = []
    for line in p.stderr:                          # SIGTERM once the second case is running
        err.append(line)
        if "inductor threads x2: starting" in line:
            _wait_for_a_running_case(mark, p.pid)
            p.terminate()
            break
    out, rest = p.communicate(timeout=120)
    assert p.returncode == 0, "".join(err) + rest
    doc = json.loads(out)
    eager, inductor = doc["cases"]
    assert doc["interrupted"] and eager["outcome"] == "ok" and doc["policy"] == "eager"
    assert (inductor["outcome"], inductor["error"]) == ("timeout", "the probe was stopped during this case")
    assert len(list((tmp_path / "probe-cache").iterdir())) == 1          # eager's verdict kept, not the stopped one
    assert not _marked(mark), "a case process outlived the probe"


def _wait_for_a_running_case(mark: bytes, probe: int, cpu_s: float = 0.5, limit_s: float = 120) -> None:
    """Until a case process (marked, not the probe, `--case` in its command line: past its exec) has
    used `cpu_s` of CPU: it is running its case, long since registered with the probe."""
    deadline = time.monotonic() + limit_s
    tick = os.sysconf("SC_CLK_TCK")
    while time.monotonic() < deadline:
        for pid in _marked(mark):
            try:
                if pid == probe or b"--case" not in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                    continue
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if (int(stat[11]) + int(stat[12])) / tick >= cpu_s:    # utime + stime
                return
        time.sleep(0.05)
    raise AssertionError(f"no case process ran {cpu_s} s of CPU within {limit_s} s")


def _marked(mark: bytes) -> list[int]:
    """The processes whose environment holds `mark`."""
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and mark in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                found.append(int(name))
        except OSError:
            pass
    return found


def test_a_hung_timed_phase_lets_the_others_go_on_and_a_queued_case_keeps_its_whole_timeout(tmp_path, monkeypatch):
    # "hung" holds the turn until its 3 s timeout; "plain" (no timed phase) ends meanwhile and frees
    # its slot; "queued" starts then, beside the overrun phase, and its 1.5 s count from its start
    monkeypatch.setattr(schedule, "MAX_ALONE_S", 0.5)
    script = tmp_path / "fake_case.py"
    script.write_text(FAKE)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    records, ended = {}, {}

    def run_one(name, control):
        cmd = {"hung": [str(script), name, str(tmp_path), "0.1", "-", "30"],
               "plain": ["-c", "import time; time.sleep(1.0)"],
               "queued": [str(script), name, str(tmp_path), "0.2", "-", "0.2"]}[name]
        run = watch.run_isolated([sys.executable, *cmd], {"hung": 3, "plain": 30, "queued": 1.5}[name],
                                 env=dict(env, **control.env()), control=control)
        records[name], ended[name] = control.record(), time.time()
        return run

    results = schedule.run_all(["hung", "plain", "queued"], 2, run_one)
    assert results["hung"]["timed_out"] and not records["hung"]["alone"]
    assert results["plain"]["exit_code"] == 0
    assert not results["queued"]["timed_out"] and results["queued"]["result"]["ok"], results["queued"]
    assert _ticks(tmp_path / "queued.ticks")[0] < ended["hung"]     # it ran beside the overrun phase, not after it
    assert records["queued"]["alone"] and records["queued"]["timed_at"][0] > 3    # its own turn: after hung's end


def test_a_case_whose_process_starts_after_the_probe_was_stopped_is_killed_at_once():
    """run_all's stop halts every running case; one still in its Popen then has no pid to kill. Its
    registration kills it instead, so no case runs on past the probe."""
    ctl = schedule.Control(None, "eager threads x2", "case-0.go")
    ctl.halt()      # the stop, before the case's process existed
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        with ctl.launch() as register:
            register(proc.pid)
        assert proc.wait(timeout=120) == -9 and ctl.halted
    finally:
        proc.kill()
        proc.wait()
