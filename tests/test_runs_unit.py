"""Pure parts of the run lifecycle: run ids, argument resolution, refusal messages, the log
stream parser, summaries and the report's PNG."""
import json
import queue
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator import inventory
from orchestrator.runs import follow, nodes, report, status, launch as runs
from orchestrator.errors import UsageError
from orchestrator.runs.options import LaunchOptions
from trainer.signatures import load_catalog

INV = inventory.parse("""
default: ct200
hosts: {pve1: {address: pve1.invalid}}
targets:
  ct200: {host: pve1, vmid: 200, gpus: 8, workdir: /root/dflash}
  ct201: {host: pve1, vmid: 201, gpus: 0}
""")


def test_run_ids_sort_by_time_and_never_collide():
    a = runs.new_run_id("ct200", now=1_700_000_000.0)
    b = runs.new_run_id("ct200", now=1_700_000_000.0)
    c = runs.new_run_id("ct200", now=1_700_000_061.0)
    assert re.fullmatch(r"20231114-221320-[0-9a-f]{6}", a)
    assert a != b and sorted([c, a]) == [a, c]


def test_target_and_run_arguments():
    assert status.split_target_run(INV, []) == (INV.targets["ct200"], "latest")
    assert status.split_target_run(INV, ["ct201"]) == (INV.targets["ct201"], "latest")
    assert status.split_target_run(INV, ["20250101-000000-abcdef"]) == (INV.targets["ct200"],
                                                                        "20250101-000000-abcdef")
    assert status.split_target_run(INV, ["ct201", "R"]) == (INV.targets["ct201"], "R")
    assert status.split_target_run(INV, ["latest"]) == (INV.targets["ct200"], "latest")
    assert status.split_target_run(INV, ["bench-123"]) == (INV.targets["ct200"], "bench-123")   # a bench-decode
    with pytest.raises(UsageError, match="unknown target 'ct20'"):
        status.split_target_run(INV, ["ct20", "R"])
    with pytest.raises(UsageError, match="unknown target 'ct2001'"):
        status.split_target_run(INV, ["ct2001"])


def test_exit_codes_as_documented():
    assert [status.exit_code_for(s) for s in ("succeeded", "failed", "running", "stopped", "lost")] == \
        [0, 100, 101, 103, 104]


def test_a_run_whose_container_went_down_under_its_follow_is_lost():
    """A follow whose stream was cut and whose container pct then calls stopped ends as the run's end: lost
    (104), one summary line that says so and what to type; status's table says the same of a lost run."""
    from orchestrator.errors import ContainerError
    from orchestrator.runs import logview
    from orchestrator.runs import run_commands as commands

    t = INV.targets["ct200"]
    e = ContainerError("ct200", 200, "went down under the command ...", state="stopped", under=137)
    end = follow._ended_with_container(t, e, {"run": "R", "offset": 10}, {"kind": "train"})
    end.update(step=7, loss=2.5)
    s = follow._summary(t, end, {}, [], 3, 10, 0, load_catalog())
    assert (s.state, s.exit_code, s.classified) == ("lost", 104, None)
    assert logview._summary_line(s).startswith(
        "ct200: run R: lost (ended with its container: CT 200 is stopped (`pct start 200`, then `dflash-ops status "
        "ct200` says how it ended and `dflash-ops launch ct200 --resume R` continues it from its last checkpoint)); "
        "steps 7; last loss 2.5")
    regen = follow._ended_with_container(t, e, {"run": "G", "offset": 0}, {"kind": "regen"})
    assert regen["kind"] == "regen" and "continues it from the rows it wrote" in regen["exit"]["reason"]
    row = {"state": "lost", "exit": {"lost": True, "container_restarted": True}}
    assert commands._state_text(row) == "lost (ended with its container)"
    assert commands._state_text({"state": "lost", "exit": {"lost": True}}) == "lost"
    assert status.job_state(["running", "lost", "succeeded"]) == "lost"


def test_refusal_messages_say_what_to_do():
    t = INV.targets["ct200"]
    assert "run `dflash-ops deploy ct200`" in runs.refusal_message(t, {"reason": "no_release"})
    assert "run `dflash-ops probe ct200`" in runs.refusal_message(t, {"reason": "no_probe"})
    busy = {"reason": "busy", "busy": {"gpu0": {}, "gpu1": {}},
            "holders": [{"run": "R1", "pid": 42}]}
    msg = runs.refusal_message(t, busy)
    assert "GPU(s) 0, 1 are in use by run R1 (pid 42)" in msg and "dflash-ops stop ct200 R1" in msg
    cpu = runs.refusal_message(t, {"reason": "busy", "busy": {"cpu": {}},
                                   "holders": [{"run": "R2", "pid": 7}]})
    assert "the CPU slot is in use by run R2" in cpu
    bench = runs.refusal_message(t, {"reason": "busy", "busy": {"gpu0": {}}, "holders": [{"run": "bench-9", "pid": 9}]})
    assert bench == ("ct200: GPU(s) 0 are in use by a bench-decode (pid 9); wait for it to end, or end it with "
                     "`dflash-ops stop ct200 bench-9`")
    assert "\n" not in msg


def test_launch_refuses_more_gpus_than_the_target_has_before_connecting():
    """An impossible request (more GPUs than the target has, an id it does not have) is bad input:
    UsageError (exit 2), as --gpu-ids out of range always was, before anything connects."""
    for opts, needle in ((LaunchOptions.build(gpus=9, compile_policy="eager"), "--gpus 9 is more than the target's 8"),
                         (LaunchOptions.build(gpus=20000), "--gpus 20000 is more than"),
                         (LaunchOptions.build(gpu_ids="-1"), "--gpu-ids -1: ct200 has GPUs 0..7"),
                         (LaunchOptions.build(gpu_ids="8"), "--gpu-ids 8: ct200 has GPUs 0..7")):
        with pytest.raises(UsageError, match=needle) as e:
            nodes.launch(INV, [INV.targets["ct200"]], opts)
        assert e.value.exit_code == 2
    with pytest.raises(UsageError, match="--gpus 1 is more than the target's 0 GPU"):
        nodes.launch(INV, [INV.targets["ct201"]], LaunchOptions.build(gpus=1))


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=400), st.lists(st.integers(min_value=1, max_value=50), max_size=20))
def test_stream_parser_counts_bytes_exactly_however_they_are_split(body, cuts):
    header = json.dumps({"run": "R", "offset": 7}).encode() + b"\n"
    data = header + body
    q: queue.Queue = queue.Queue()
    s = follow._Stream(q, 0)
    i = 0
    for n in cuts:
        s.on_stdout(data[i:i + n])
        i += n
    s.on_stdout(data[i:])
    got = _drain(q)
    assert got == body and s.offset == 7 + len(body) and s.header["run"] == "R"


def _drain(q):
    out = []
    while not q.empty():
        kind, item = q.get_nowait()
        if kind == "data":
            out.append(item)
    return b"".join(out)


def test_stream_control_lines():
    s = follow._Stream(queue.Queue(), 0)
    s.on_stderr(b'{"hb": 1.0}\n{"end": {"state": "fa')
    assert s.end is None
    s.on_stderr(b'iled"}}\nTraceback (most recent call last):\n')
    assert s.end == {"state": "failed"} and s.stderr_text == ["Traceback (most recent call last):"]


def test_summary_names_the_cause_from_lines_or_exit_status():
    cat = load_catalog()
    t = INV.targets["ct200"]
    end = {"run": "R", "state": "failed", "step": 4, "loss": 1.5, "exit": {"returncode": 139}}
    s = follow._summary(t, end, {}, [], 10, 100, 0, cat)
    assert (s.exit_code, s.classified) == (100, "segfault")
    hits = [{"line": 3, "signature": "segfault", "severity": "fatal"},
            {"line": 2, "signature": "cudagraph-trees-tls", "severity": "fatal"}]
    s = follow._summary(t, end, {"segfault": 1, "cudagraph-trees-tls": 1}, hits, 10, 100, 0, cat)
    assert s.classified == "cudagraph-trees-tls"      # the specific cause over the generic crash
    ok = follow._summary(t, {"run": "R", "state": "succeeded"}, {}, [], 1, 1, 0, cat)
    assert (ok.exit_code, ok.classified) == (0, None)


def test_report_series_and_png(tmp_path):
    metrics = [{"step": i, "loss": 5.0 - i / 10, "tokens_per_s": 100.0 + i} for i in range(1, 11)]
    metrics += [{"event": "checkpoint", "step": 10}, {"event": "eval", "step": 5, "acceptance_length": 1.5},
                {"event": "done", "step": 10, "loss": 4.0, "acceptance_length": 2.0}]
    data = report.series(metrics)
    assert len(data["loss"]) == 10 and data["tau"] == [(5, 1.5), (10, 2.0)]
    assert data["throughput_label"] == "tokens/s" and data["throughput"][0] == (1, 101.0)
    out = report.render(metrics, tmp_path / "sub" / "r.png", title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        report.render([{"event": "checkpoint"}], tmp_path / "x.png")


def test_report_gives_the_untrained_baseline_every_evals_tau_and_marks_resumes(tmp_path):
    metrics = [{"event": "eval", "step": 0, "acceptance_length": 1.01, "rounds": 50}]
    metrics += [{"step": i, "loss": 5.0 - i / 10} for i in range(1, 7)]
    metrics += [{"event": "eval", "step": 3, "acceptance_length": 1.4}, {"event": "stopped", "step": 4},
                {"event": "resume", "step": 3},               # its checkpoint was step 3: step 4 again
                {"event": "eval", "step": 3, "acceptance_length": 1.45},
                {"event": "done", "step": 6, "loss": 4.4, "acceptance_length": 1.9, "rounds": 40}]
    assert report.evals(metrics) == [{"step": 0, "tau": 1.01, "heldout_loss": None},
                                     {"step": 3, "tau": 1.45, "heldout_loss": None},
                                     {"step": 6, "tau": 1.9, "heldout_loss": None}]
    assert report.resumes(metrics) == [3]
    assert report.series(metrics)["tau"] == [(0, 1.01), (3, 1.45), (6, 1.9)]     # the curve: step 3 once
    assert report.summary_lines(metrics) == [
        "tau at each eval: untrained 1.010 -> 1.450 (step 3) -> 1.900 (step 6)",
        "tau 1.900 (40 rounds), at step 6",
        "resumed from step 3"]
    fig = report.figure(metrics)
    for ax in fig.axes[:3]:     # each step panel marks where the run continued
        assert [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == "--"] == [3]
    assert any(t.get_text() == "untrained 1.010" for t in fig.axes[1].texts)
    # a run with one eval and no baseline (an older trainer, or --no-eval-at-start): only the last eval
    assert report.summary_lines([{"event": "done", "step": 3, "acceptance_length": 2.5}]) == ["tau 2.500, at step 3"]


def test_report_gives_the_held_out_loss_at_each_eval_beside_the_training_loss():
    metrics = [{"event": "eval", "step": 0, "acceptance_length": 1.0, "heldout_loss": 5.5}]
    metrics += [{"step": i, "loss": 5.0 - i / 10} for i in range(1, 5)]
    metrics += [{"event": "eval", "step": 2, "acceptance_length": 1.3, "heldout_loss": 4.9},
                {"event": "done", "step": 4, "loss": 4.6, "acceptance_length": 1.6, "heldout_loss": 4.7}]
    assert report.series(metrics)["heldout_loss"] == [(0, 5.5), (2, 4.9), (4, 4.7)]
    assert report.summary_lines(metrics)[1] == "held-out loss at each eval: untrained 5.5000 -> 4.9000 (step 2) " \
                                               "-> 4.7000 (step 4)"
    loss_panel = report.figure(metrics).axes[0]
    held = [ln for ln in loss_panel.get_lines() if ln.get_label() == "held-out rows, at each eval"]
    assert len(held) == 1 and list(held[0].get_ydata()) == [5.5, 4.9, 4.7]


def test_report_gives_the_last_evals_tau_rounds_interval_and_a_bar_per_block_position(tmp_path):
    metrics = [{"step": i, "loss": 5.0 - i / 10} for i in range(1, 5)]
    metrics += [{"event": "eval", "step": 2, "acceptance_length": 1.5, "rounds": 40, "tau_ci95": [1.3, 1.7],
                 "accept_rate_by_position": [0.4, 0.1, 0.0]},
                {"event": "done", "step": 4, "loss": 4.6, "acceptance_length": 2.0, "rounds": 30,
                 "tau_ci95": [1.75, 2.25], "accept_rate_by_position": [0.8, 0.5, None]}]
    ev = report.last_eval(metrics)
    assert ev == {"step": 4, "tau": 2.0, "rounds": 30, "ci95": [1.75, 2.25], "by_position": [0.8, 0.5, None]}
    assert report.eval_line(ev) == ("tau 2.000 (95% 1.750-2.250, 30 rounds), at step 4; "
                                    "acceptance by block position 1..3: 0.80 0.50 -")
    fig = report.figure(metrics)
    bars = fig.axes[3]
    assert bars.get_xlabel() == "block position" and [b.get_height() for b in bars.patches] == [0.8, 0.5, 0.0]
    assert "30 rounds" in bars.get_title()
    # an older trainer's records: tau alone
    assert report.eval_line(report.last_eval([{"event": "done", "step": 3, "acceptance_length": 2.5}])) == \
        "tau 2.500, at step 3"
    # the trainer's way of writing tau, which report, specdec, the eval lines and the plots share
    from trainer.run.log import tau_text
    assert tau_text(2.0, None, 1) == "2.000 (1 round)"
    assert tau_text(1.234, (1.1, 1.4), 812, "8 held-out prompts", digits=2) == \
        "1.23 (95% 1.10-1.40, 812 rounds, 8 held-out prompts)"


# ---- a run over several nodes ------------------------------------------------------------------

def test_a_job_over_nodes_is_one_status_row_with_rank_0s_numbers():
    rows = [{"run": "r1", "target": "ct200", "state": "running", "step": None, "nodes": ["ct200", "ct300"],
             "node": {"node_rank": 1, "ranks": [1, 1], "rank0": False}},
            {"run": "r1", "target": "ct300", "state": "failed", "step": 7, "nodes": ["ct200", "ct300"],
             "node": {"node_rank": 0, "ranks": [0, 0], "rank0": True}},
            {"run": "r0", "target": "ct200", "state": "succeeded", "step": 3, "nodes": None}]
    out = status.group_rows(rows)
    assert [r["run"] for r in out] == ["r1", "r0"]
    job = out[0]
    assert (job["target"], job["state"], job["step"]) == ("ct300", "failed", 7)
    assert [(n["target"], n["state"], n["node_rank"]) for n in job["nodes"]] == [
        ("ct200", "running", 1), ("ct300", "failed", 0)]
    assert status.job_state(["succeeded", "stopped"]) == "stopped"
    assert status.job_state(["succeeded", "running"]) == "running"
    assert status.job_state(["succeeded", "succeeded"]) == "succeeded"


def test_node_lines_are_led_by_target_and_rank():
    from orchestrator.runs.logview import _prefixed

    assert _prefixed("ct300", b"[rank3]: Traceback\n") == b"[ct300/rank3] Traceback\n"
    assert _prefixed("ct200", b'{"step": 1}\n') == b'[ct200] {"step": 1}\n'
    assert _prefixed("ct200", b"[rankx]: odd\n") == b"[ct200] [rankx]: odd\n"


def test_torchruns_root_cause_is_read_from_the_log_and_the_error_file(tmp_path):
    from orchestrator.remote.runs.records import root_cause

    err = tmp_path / "error.json"
    err.write_text(json.dumps({"message": {"message": "RuntimeError: test hook\nmore",
                                           "extraInfo": {"timestamp": "1"}}}))
    log = tmp_path / "train.log"
    log.write_text("noise\nRoot Cause (first observed failure):\n[0]:\n  time      : 2026-11-30_17:00:00\n"
                   "  host      : node-b\n  rank      : 3 (local_rank: 1)\n  exitcode  : 1 (pid: 42)\n"
                   f"  error_file: {err}\n  traceback : Traceback (most recent call last):\n")
    assert root_cause(str(log)) == {"rank": 3, "exitcode": 1, "error_file": str(err),
                                    "error": "RuntimeError: test hook"}
    log.write_text("Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 0)\n"
                   "  exitcode  : -9 (pid: 7)\n  error_file: <N/A>\n"
                   "  traceback : Signal 9 (SIGKILL) received by PID 7\n")
    assert root_cause(str(log)) == {"rank": 1, "exitcode": -9, "error_file": None,
                                    "error": "Signal 9 (SIGKILL) received by PID 7"}
    log.write_text("no torchrun here\n")
    assert root_cause(str(log)) is None


def test_what_dead_agents_left_is_swept_and_nothing_else(tmp_path):
    """One sweep for every PREFIX...-PID folder an agent removes in its `finally` (uploads, removals,
    export temporaries): a dead PID's goes; a live one's, another prefix's, a name without a PID stay."""
    import os
    import subprocess
    from orchestrator.remote.runs.records import sweep_dead

    dead = subprocess.Popen(["true"])
    dead.wait()
    names = [f".upload-20261203-114700-abc123-{dead.pid}", f".upload-r1-{os.getpid()}", f".tmp-{dead.pid}",
             f".tmp-{os.getpid()}", f".rm-r1-{dead.pid}", ".upload-r1-x", "20261203-114700-abc123"]
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "file").write_text("x")
    sweep_dead(str(tmp_path), ".upload-")
    sweep_dead(str(tmp_path), ".tmp-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".upload-r1-{os.getpid()}", f".tmp-{os.getpid()}", f".rm-r1-{dead.pid}", ".upload-r1-x",
         "20261203-114700-abc123"])
    sweep_dead(str(tmp_path / "missing"), ".rm-")      # no folder: nothing to sweep, no error


def test_logs_takes_f_for_follow_as_tail_and_kubectl_do():
    from orchestrator.runs.run_commands import logs

    assert logs.make_context("logs", ["-f"]).params["follow"] is True
    assert logs.make_context("logs", ["--no-follow"]).params["follow"] is False


def test_a_log_line_nested_beyond_what_json_reads_is_text():
    """`logs` reads each line of the target's log: one nested 100,000 deep is shown as text, not an
    internal error after the log."""
    from orchestrator.runs import logview

    line = b'{"event": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert logview._json_line(line) == (b"", None)
    assert logview._json_line(b'{"event": "done"}') == (b"", {"event": "done"})
