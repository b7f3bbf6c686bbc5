"""The probe talks and explains: a heartbeat with the case's phase, what a failure means and how to fix
it, a rendezvous that cannot form skipped at once with its reason, no failed policy called a fallback."""
from __future__ import annotations

import os
import signal
import socket
import sys
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from trainer.probe import program  # noqa: E402
from trainer.probe import case_watch as watch
from trainer.signatures import load_catalog  # noqa: E402


def test_a_running_case_beats_with_its_phase():
    script = ("import sys, time\n"
              "for p in ('compile', 'teacher-forced', 'timed'):\n"
              f"    print({watch.PHASE_MARK!r} + p, flush=True); time.sleep(0.7)\n"
              f"print({watch.CASE_MARK!r} + '{{\"ok\": true}}', flush=True)\n")
    beats = []
    run = watch.run_isolated([sys.executable, "-c", script], 30, on_beat=lambda *b: beats.append(b), beat_s=0.25)
    assert run["result"] == {"ok": True} and run["exit_code"] == 0 and run["phase"] == "timed"
    phases = [p for p, _ in beats]
    assert {"compile", "teacher-forced", "timed"} <= set(phases)
    assert phases == sorted(phases, key=watch.PHASES.index)      # in the order the case went through them
    assert all(b[1] > a[1] for a, b in zip(beats, beats[1:]))
    assert watch.BEAT_S <= 15 and program.run_isolated is watch.run_isolated


@pytest.mark.timeout(120)   # a case not ended at its timeout, or whose processes live on, sleeps 600 s
def test_a_silent_hung_case_still_beats_until_its_timeout():
    marker = f"dflash-hung-case-{os.getpid()}"
    beats = []
    sleep = f"(exec -a {marker} sleep 600)"
    try:
        run = watch.run_isolated(["bash", "-c", f"{sleep} & {sleep}; wait"], 1.5,
                                 on_beat=lambda *b: beats.append(b), beat_s=0.4)
        assert run["timed_out"] and run["exit_code"] is None and run["phase"] == "import"
        assert len(beats) >= 2 and all(p == "import" for p, _ in beats)
        # Ended by its timeout, not by its end: both sleeps of 600 s, the foreground one and the one in
        # the background, are killed (what is left of them is at most a zombie on its way out).
        while living(marker):
            time.sleep(0.05)
    finally:
        for pid in living(marker):      # only when the test failed: what it started, by id
            os.kill(pid, signal.SIGKILL)


def living(marker: str) -> list[int]:
    """The processes whose name is `marker`, zombies aside."""
    pids = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{name}/cmdline", "rb").read()
            state = open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cmdline.split(b"\0")[0] == marker.encode() and state != "Z":
            pids.append(int(name))
    return pids


def test_a_failed_case_says_its_exception_and_the_remedy_and_names_a_missing_module():
    out = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
           "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:\n"
           "ModuleNotFoundError: No module named 'setuptools'\n\n"
           "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace\n")
    cat = load_catalog()
    sig = cat.classify(out, 1)
    assert sig == "backend-compile"
    why = watch.explain(out, sig, cat)
    assert why["exception"] == "ModuleNotFoundError: No module named 'setuptools'"
    assert why["missing_module"] == "setuptools"
    assert "`python -m pip install setuptools`" in why["remedy"] and cat.get(sig).remedy in why["remedy"]
    rec = program._case_record("inductor", "threads", 2, {"result": {"ok": False, "error": "x"}, "exit_code": 1,
                                                          "timed_out": False, "output": out, "tail": [],
                                                          "seconds": 3.0, "phase": "compile"}, cat)
    assert (rec["outcome"], rec["signature"], rec["phase"]) == ("failed", "backend-compile", "compile")
    assert rec["exception"].startswith("ModuleNotFoundError") and "setuptools" in rec["remedy"]


def test_a_rendezvous_that_cannot_form_skips_the_processes_cases_at_once(monkeypatch, capsys):
    host = socket.gethostname()

    asked = []

    def unresolvable(name, *a, **k):   # this container's name is in no resolver (no DNS query is sent)
        asked.append(name)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    def no_socket(*a, **k):            # a bind or a connect after the name failed: what would wait
        raise AssertionError("the rendezvous check opened a socket: it ends at the hostname that does not resolve")

    monkeypatch.setattr(socket, "getaddrinfo", unresolvable)
    with monkeypatch.context() as only_here:
        only_here.setattr(socket, "socket", no_socket)
        why = watch.rendezvous_problem()
    assert asked == [host]      # asked once, no retry: no wait on a resolver or a connect
    assert why.startswith(f"the hostname {host!r} does not resolve") and "/etc/hosts" in why

    ran = []
    monkeypatch.setattr(program, "_run_child", lambda *a, **k: ran.append(a[:2]) or {
        "result": {"ok": True, "step_ms": 5.0, "numerics": {}}, "exit_code": 0, "timed_out": False,
        "output": "", "tail": [], "seconds": 1.0, "phase": "timed"})
    args = SimpleNamespace(device="cpu", threads=2, policies=["eager", "inductor"], topologies=["threads", "processes"],
                           signatures=None, steps=1, timeout=60, workdir=None, expect=None, fresh=True,
                           precision="bf16", fp8_emulate=False, jobs=1)
    doc = program.run_probe(args)
    assert ran == [("eager", "threads"), ("inductor", "threads")]      # no processes case started
    assert asked == [host, host]      # one check for the probe (not one a case), its skips take no wait
    skipped = [c for c in doc["cases"] if c["topology"] == "processes"]
    assert [c["outcome"] for c in skipped] == ["skipped", "skipped"]
    assert all(c["error"].startswith("rendezvous cannot form: the hostname") for c in skipped)
    assert doc["no_working_policy"] == ["processes"]
    assert "NO WORKING POLICY in processes" in doc["processes_reason"] and "fallback" not in doc["processes_reason"]
    assert "rendezvous cannot form" in capsys.readouterr().err


def test_no_policy_that_failed_is_called_a_fallback():
    cases = [{"policy": "eager", "topology": "threads", "threads": 2, "outcome": "timeout", "step_ms": None,
              "signature": None, "error": None},
             {"policy": "inductor", "topology": "threads", "threads": 2, "outcome": "failed", "step_ms": None,
              "signature": "backend-compile", "error": None}]
    policy, reason = program.choose(cases)
    assert "fallback" not in reason and "NO WORKING POLICY in threads" in reason and "eager timeout" in reason
    assert program.no_working_policy(cases, ["threads"]) == ["threads"]


def test_a_cpu_only_probe_defaults_to_threads(monkeypatch):
    seen = []
    monkeypatch.setattr(program, "run_probe", lambda args: seen.append(args.topologies) or {})
    assert program.main(["--device", "cpu"]) == 0
    assert program.main(["--device", "cpu", "--topologies", "threads,processes"]) == 0
    assert seen == [["threads"], ["threads", "processes"]]
