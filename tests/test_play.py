"""Playbooks: what is refused before anything runs (file:line, exit 2), templates and assertions
(pure functions), and a failing step through the real sshd + pct stand-in: it stops its target
only, is named, and `--from` resumes there."""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_quick import CLI_MAIN

from orchestrator.play import playbook as pb
from orchestrator.play import templating as tpl
from orchestrator.errors import FileError, UsageError

REPO = Path(__file__).resolve().parent.parent


def dflash_ops(*args, cwd=None, home=None, timeout=120) -> subprocess.CompletedProcess:
    env = dict(os.environ, **({"DFLASH_OPS_HOME": str(home)} if home else {}))
    return subprocess.run([sys.executable, "-c", CLI_MAIN, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


# --- refused before anything runs ----------------------------------------------------------------

GOOD = """\
vars:
  config: a.yaml
steps:
  - name: deploy
    deploy: {}
  - name: launch
    launch: {config: "{{ config }}", gpus: "{{ gpus }}"}
  - name: follow
    logs: {run: "{{ steps.launch.run }}"}
"""


@pytest.mark.parametrize("old, new, line, message", [
    ("    deploy: {}", "    deplyo: {}", 5, "steps[0].deplyo: unknown action (did you mean 'deploy'?)"),
    ("{config: ", "{confg: ", 7, "steps[1].launch.confg: unknown option (did you mean 'config'?)"),
    ('"{{ config }}"', '"{{ cofnig }}"', 7,
     "steps[1].launch.config: unknown variable 'cofnig' (did you mean 'config'?)"),
    ("steps.launch.run", "steps.follow.run", 9,
     "steps[2].logs.run: {{ steps.follow.run }}: 'follow' is not an earlier step"),
    ("  - name: follow", "  - name: launch", 8, "steps[2].name: duplicate step name (first on line 6)"),
    ('gpus: "{{ gpus }}"', "gpus: many", 7, "steps[1].launch.gpus: expected a whole number, got 'many'"),
    ("    logs: {run", "    exec: {}\n    logs: {run", 8, "steps[2]: a step is one action: it has exec, logs"),
    ("  config: a.yaml", "  config: [a, b]", 2, "vars.config: expected a string, number or true/false, got a list"),
    ("  config: a.yaml", "  config: a.yaml\n  torch: null", 3, "vars.torch: required: pass --var torch=VALUE"),
    ("deploy: {}", "deploy: {]", 5, "not valid YAML"),
])
def test_a_malformed_playbook_is_one_line_naming_file_line_and_key(tmp_path, old, new, line, message):
    path = tmp_path / "bad.yaml"
    assert old in GOOD
    path.write_text(GOOD.replace(old, new, 1))
    with pytest.raises(FileError) as e:
        pb.load(str(path))
    assert str(e.value).startswith(f"{path}:{line}: ") and message in str(e.value), str(e.value)


def test_the_cli_exits_2_with_file_line_and_no_traceback(tmp_path):
    (tmp_path / "bad.yaml").write_text(GOOD.replace("deploy: {}", "deploy: {sauce: .}"))
    r = dflash_ops("play", "bad.yaml", cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("dflash-ops: bad.yaml:5: steps[0].deploy.sauce: unknown option (did you mean 'source'?) "
                        "(options of deploy: source, install_deps, verify)\n")
    (tmp_path / "good.yaml").write_text(GOOD)
    r = dflash_ops("play", "good.yaml", "--var", "confg=b.yaml", cwd=tmp_path)
    assert r.returncode == 2 and "--var confg: good.yaml has no variable 'confg' (did you mean 'config'?)" in r.stderr
    # a variable's value is checked where it is used, on every target, before anything runs
    r = dflash_ops("play", "good.yaml", "--var", "gpus=many", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == ("dflash-ops: good.yaml:7: steps[1].launch.gpus: expected a whole "
                                              "number, got 'many' (on local)\n")
    r = dflash_ops("play", "good.yaml", "--from", "folow", cwd=tmp_path)
    assert r.returncode == 2 and "--from folow: no such step" in r.stderr and "did you mean 'follow'" in r.stderr
    assert "Traceback" not in r.stderr


VARS = """\
vars:
  msg: hi
  n: 0
  ids: null
steps:
  - name: first
    exec: {command: [touch, "{{ playbook_dir }}/ran"]}
  - name: say
    exec: {command: [echo, "{{ msg }}"]}
  - name: launch
    launch: {gpus: "{{ n }}"}
  - name: exactly
    launch: {gpu_ids: "{{ ids }}"}
  - name: wait
    wait-for: {timeout: "{{ msg }}"}
"""


@pytest.mark.parametrize("var, needle", [
    (b"msg={{ steps.first.value }}", "--var msg: {{ steps.first.value }} reads a step's result, which no variable can"),
    (b"msg={{ nope }}", "--var msg: unknown variable 'nope'"),
    (b"msg={{ 1+1 }}", "--var msg: {{ 1+1 }}: not a template"),
    (b"msg=a\xffb", "--var msg: the value is not UTF-8 text: 'a\\udcffb'"),
    (b"n=20000", "play.yaml:11: steps[2].launch.gpus: --gpus 20000 is more than the target's 1 GPU(s) "
                 "(hosts.yaml `gpus:`) (on t)"),
    (b"n=" + b"9" * 5000, "play.yaml:11: steps[2].launch.gpus: a whole number of 5000 digits (at most 18) (on t)"),
    (b"ids=-1", "play.yaml:13: steps[3].launch.gpu_ids: --gpu-ids -1: t has GPUs 0..0 (hosts.yaml `gpus:`) (on t)"),
    (b"ids=1", "play.yaml:13: steps[3].launch.gpu_ids: --gpu-ids 1: t has GPUs 0..0"),
    (b"msg=1e999", "play.yaml:15: steps[4].wait-for.timeout: '1e999': a number is 0 or between 1e-12 and 1e+18"),
    (b"msg=nan", "play.yaml:15: steps[4].wait-for.timeout: 'nan': a number is 0 or between"),
], ids=["reads-a-step", "unknown-variable", "not-a-template", "not-utf8", "more-gpus", "5000-digits", "gpu-id-minus-1",
        "gpu-id-absent", "inf", "nan"])
def test_every_var_problem_is_exit_2_before_any_step_runs(tmp_path, var, needle):
    """A --var that reads a step's result, names no variable, is not UTF-8, or asks a launch for
    GPUs the target does not have (or a number without bounds): one line, exit 2, and the first
    step (which would touch a file) never ran."""
    (tmp_path / "hosts.yaml").write_text("targets:\n  t: {gpus: 1}\n")
    (tmp_path / "play.yaml").write_text(VARS)
    args = [b"ids=0", b"msg=5"] + [var]
    r = subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", "hosts.yaml", "play", "play.yaml", "t",
                        *(x for a in args for x in (b"--var", a))], capture_output=True, cwd=tmp_path, timeout=120,
                       env=dict(os.environ, DFLASH_OPS_HOME=str(tmp_path)))
    err = r.stderr.decode()
    assert r.returncode == 2 and err.startswith("dflash-ops: ") and needle in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "ran").exists()
    # the same vars, well-formed: the pre-check passes (--dry-run runs nothing)
    r = subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", "hosts.yaml", "play", "play.yaml", "t", "--dry-run",
                        "--var", "ids=0", "--var", "msg=5", "--var", "n=1"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120, env=dict(os.environ, DFLASH_OPS_HOME=str(tmp_path)))
    assert r.returncode == 0, r.stderr


def test_the_shipped_playbooks_load_and_dry_run_shows_what_would_run(tmp_path):
    with pytest.raises(FileError, match=r"bootstrap.yaml:\d+: vars.torch: required"):
        pb.load(str(REPO / "playbooks" / "bootstrap.yaml"))
    assert pb.load(str(REPO / "playbooks" / "bootstrap.yaml"), {"torch": "2.7.1"}).names == [
        "find-python", "venv", "torch", "deploy", "probe"]
    r = dflash_ops("play", REPO / "playbooks" / "train.yaml", "--dry-run", "--var", "trainer_args=--steps 5 --lr 1e-3",
                   "--from", "launch", cwd=tmp_path, home=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("local: would run 4 step(s) (from launch)\n  launch (launch)\n")
    assert '    args: ["--steps", "5", "--lr", "1e-3"]' in out and "    run: <steps.launch.run>" in out
    assert "    output: \n" in out and "deploy (deploy)" not in out    # empty: export's own default folder
    assert "    gate: true\n" in out                # the pipeline gate before the run, by default (a var: true)


# --- templates and assertions (pure) -------------------------------------------------------------

def test_templates_keep_types_splice_words_and_quote_in_shell():
    ctx = tpl.Context({"gpus": 8, "args": "--steps 5 --name 'a b'", "python": "/srv/venv/bin/python",
                      "odd": "x; rm -rf /", "out": "dflash-{{ target }}", "target": "ct200"},
                     results={"launch": {"run": "r1", "slots": ["gpu0", "gpu1"]}})
    assert tpl.render("{{ gpus }}", ctx) == 8
    assert tpl.render("gpus={{ gpus }}", ctx) == "gpus=8"
    assert tpl.render(["--x", "{{ args | words }}"], ctx) == ["--x", "--steps", "5", "--name", "a b"]
    assert tpl.render("{{ python | dirname | dirname }}", ctx) == "/srv/venv"
    assert tpl.render("{{ out }}", ctx) == "dflash-ct200"                       # variables inside variables
    assert tpl.render("{{ steps.launch.slots.1 }}", ctx) == "gpu1"
    assert tpl.render("echo {{ odd }} {{ args | words }}", ctx, shell=True) == \
        "echo 'x; rm -rf /' --steps 5 --name 'a b'"
    with pytest.raises(tpl.Missing, match="step 'probe' has no result"):
        tpl.render("{{ steps.probe.policy }}", ctx)
    with pytest.raises(tpl.Missing, match="has no 'pid'"):
        tpl.render("{{ steps.launch.pid }}", ctx)
    with pytest.raises(UsageError, match="refers to itself"):
        tpl.render("{{ a }}", tpl.Context({"a": "{{ b }}", "b": "{{ a }}"}))


HOSTILE = ["$(touch MARK)", "`touch MARK`", "'; touch MARK; '", '"; touch MARK; "', "a\\", "x\ny", "it's \"$HOME\""]


@pytest.mark.parametrize("script, want", [
    ("printf %s {{ v }}", "{v}"),                          # a word of its own
    ('printf %s "<{{ v }}>"', "<{v}>"),                    # inside "...": $ ` \ " escaped
    ("printf %s '<{{ v }}>'", "<{v}>"),                    # inside '...': each ' closed and reopened
    ('printf %s "$(printf %s {{ v }})"', "{v}"),           # $( ) inside "...": a plain word again
    ("# {{ v }}\nprintf %s {{ v }}", "{v}"),               # a comment, then a word
])
def test_a_value_lands_in_the_script_as_literal_text_wherever_its_template_stands(tmp_path, script, want):
    """bash runs each rendered script: the value comes out as written, and nothing in it runs."""
    for value in HOSTILE:
        text = tpl.render(script, tpl.Context({"v": value}), shell=True)
        r = subprocess.run(["bash", "-c", text], cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout == want.format(v=value), (value, text, r)
        assert not (tmp_path / "MARK").exists(), (value, text)


@pytest.mark.parametrize("script, where", [
    ("cat <<EOF\n{{ v }}\nEOF", "a here-document"), ("printf %s $'{{ v }}'", "$'...'")])
def test_a_template_where_no_quoting_is_safe_is_refused_naming_the_way_that_is(script, where):
    with pytest.raises(UsageError, match=f"inside {re.escape(where)} cannot be quoted safely; pass the value as "
                                         "exec's `env:`"):
        tpl.render(script, tpl.Context({"v": "x"}), shell=True)


@pytest.mark.parametrize("test, want, passed", [
    ("equals", "succeeded", True), ("equals", "failed", False), ("not_equals", "failed", True),
    ("in", ["stopped", "succeeded"], True), ("exists", True, True), ("exists", False, False),
])
def test_assert_on_a_key_of_a_result(test, want, passed):
    ok, what = tpl.check_assert({"step": "follow", "that": "state", test: want}, {"state": "succeeded"})
    assert ok is passed and "state" in what


def test_assert_compares_numbers_written_as_text():
    result = {"tau": 1.8, "hits": [{"line": 3}]}
    assert tpl.check_assert({"step": "f", "that": "tau", "greater_than": "1.5"}, result)[0]
    assert not tpl.check_assert({"step": "f", "that": "tau", "less_than": 1}, result)[0]
    assert tpl.check_assert({"step": "f", "that": "hits.0.line", "equals": "3"}, result)[0]
    assert tpl.check_assert({"step": "f", "that": "loss", "greater_than": 0}, result) == (False, "f has no 'loss'")


# --- a failing step, through the real sshd and pct stand-in --------------------------------------

FLAKY = """\
steps:
  - name: count
    exec: {shell: "echo ran >> /srv/ct/count; echo {{ target }}"}
  - name: needs-marker
    exec: {shell: "test -f /srv/ct/marker || { echo 'no marker in {{ target }}' >&2; exit 3; }"}
  - name: echo
    exec: {command: [echo, "{{ steps.count.value }}"], changes: false}
  - name: check
    assert: {step: echo, that: value, equals: "{{ target }}"}
"""


def test_a_failing_step_stops_its_target_only_is_named_and_from_resumes_there(tmp_path, fakepct, make_inventory):
    for vmid in (200, 201):
        fakepct.create(vmid)
    (fakepct.private(201) / "marker").write_text("")
    inv = make_inventory({name: {"host": "node", "vmid": vmid, "python": sys.executable, "workdir": "/srv/ct/dflash"}
                          for name, vmid in (("ct200", 200), ("ct201", 201))})
    (tmp_path / "flaky.yaml").write_text(FLAKY)
    r = dflash_ops("-i", inv, "play", "flaky.yaml", "ct200", "ct201", "--json", cwd=tmp_path, home=tmp_path)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)["targets"]
    assert doc["ct200"]["failed_step"] == "needs-marker"
    assert doc["ct200"]["error"] == "ct200: exited 3: no marker in ct200"
    assert [s["status"] for s in doc["ct200"]["steps"]] == ["changed", "failed", "not_run", "not_run"]
    assert doc["ct201"]["ok"] and [s["status"] for s in doc["ct201"]["steps"]] == ["changed", "changed", "ok", "ok"]
    assert "dflash-ops: failed on 1 target(s): ct200" in r.stderr

    (fakepct.private(200) / "marker").write_text("")
    r = dflash_ops("-i", inv, "play", "flaky.yaml", "ct200", "--from", "needs-marker", cwd=tmp_path, home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[1].split()[:4] == ["ct200", "count", "exec", "skipped"]
    assert r.stdout.rstrip().endswith("ct200: ok, 1 step(s) changed something: needs-marker")
    # the first step ran once; its recorded result stood in for it (`echo` printed the target)
    assert (fakepct.private(200) / "count").read_text() == "ran\n"
    assert "[ct200] step 3/4 echo (exec)\n[ct200] ct200\n" in r.stderr


def test_variables_file_then_target_keys_then_var():
    from orchestrator.inventory import Target
    from orchestrator.play.player import variables

    book = pb.parse("vars: {gpus: 1, config: a.yaml, out: 'x-{{ target }}'}\nsteps:\n  - name: s\n    deploy: {}\n",
                    "p.yaml", {"config": "b.yaml"})
    v = variables(book, Target(name="ct200", host="pve1", vmid=200, gpus=8, workdir="/w"), {"config": "b.yaml"})
    assert (v["gpus"], v["config"], v["vmid"], v["workdir"], v["target"]) == (8, "b.yaml", 200, "/w", "ct200")
    assert tpl.render("{{ out }}", tpl.Context(v)) == "x-ct200"
    assert v["playbook_dir"] == os.getcwd()


def test_wait_for_a_run_that_is_not_there_fails_its_step(tmp_path, fakepct, make_inventory):
    fakepct.create(200)
    inv = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable,
                                    "workdir": "/srv/ct/dflash"}})
    (tmp_path / "wait.yaml").write_text("steps:\n  - name: wait\n"
                                        "    wait-for: {state: [succeeded, stopped], timeout: 5}\n")
    r = dflash_ops("-i", inv, "play", "wait.yaml", "--json", cwd=tmp_path, home=tmp_path)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)["targets"]["ct200"]
    assert doc["failed_step"] == "wait" and "no runs yet in /srv/ct/dflash/runs" in doc["error"]


SLOW = """\
steps:
  - name: first
    exec: {shell: "echo one >> /srv/ct/log"}
  - name: slow
    exec: {shell: "echo started > /srv/ct/started; while ! test -f /srv/ct/go; do sleep 0.1; done"}
  - name: last
    exec: {shell: "echo three >> /srv/ct/log"}
"""


def test_one_player_per_playbook_and_target_and_a_killed_play_resumes_from_its_record(
        tmp_path, fakepct, make_inventory):
    """A second play of the same playbook on the same target is refused while the first runs; the first
    SIGKILLed in its second step leaves the first step's result recorded, no temporary, and no lock: the
    next play goes ahead, and `--from slow` resumes there without running the first step again."""
    import signal
    import time

    fakepct.create(200)
    inv = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable,
                                    "workdir": "/srv/ct/dflash"}})
    (tmp_path / "slow.yaml").write_text(SLOW)
    ct = fakepct.private(200)
    p = subprocess.Popen([sys.executable, "-c", CLI_MAIN, "-i", str(inv), "play", "slow.yaml", "ct200"], cwd=tmp_path,
                         env=dict(os.environ, DFLASH_OPS_HOME=str(tmp_path)), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (ct / "started").exists():
            assert p.poll() is None and time.monotonic() < deadline, "the play never reached its second step"
            time.sleep(0.1)
        r = dflash_ops("-i", inv, "play", "slow.yaml", "ct200", cwd=tmp_path, home=tmp_path)
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
        assert f"ct200: slow.yaml is being played there already (pid {p.pid}, since " in r.stderr
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    (record,) = (tmp_path / "plays").glob("slow-*/ct200.json")
    assert list(json.loads(record.read_text())["results"]) == ["first"]
    assert [q.name for q in record.parent.iterdir() if q.name.startswith(".ct200.json.")] == []
    (ct / "go").write_text("")
    r = dflash_ops("-i", inv, "play", "slow.yaml", "ct200", "--from", "slow", cwd=tmp_path, home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (ct / "log").read_text() == "one\nthree\n"      # the first step ran once, the last once
    assert list(json.loads(record.read_text())["results"]) == ["first", "slow", "last"]


def test_a_playbook_of_many_steps_loads_in_time_linear_in_its_steps(tmp_path):
    """Every step once rebuilt the set of the names before it, so loading grew with the square of the
    steps (docs/benchmarks.md). A ratio of CPU times, not a wall-clock bound: 10x the steps must cost well
    under 100x (quadratic)."""
    import time

    def book(n: int) -> str:
        path = tmp_path / f"b{n}.yaml"
        step = "  - name: s{i}\n    exec: {{command: [echo, '{{{{ steps.s{p}.value }}}}']}}\n"
        path.write_text("steps:\n  - name: s0\n    exec: {command: [echo, x]}\n"
                        + "".join(step.format(i=i, p=i - 1) for i in range(1, n)))
        return str(path)

    small, large = book(1000), book(10000)
    t0 = time.process_time()
    assert len(pb.load(small).steps) == 1000
    t1 = time.process_time()
    assert len(pb.load(large).steps) == 10000
    t2 = time.process_time()
    assert (t2 - t1) < 30 * max(t1 - t0, 0.01), (t1 - t0, t2 - t1)
