"""`dflash-ops bench-decode` for real: a 4-step run against `tiny` (its byte tokenizer has a chat template)
trained on chat rows through the tool in a pct stand-in container behind a real sshd on 127.0.0.1,
then its drafter decoding there against the target alone: on the rows the run held out, and on a
prompts file sent from here; the slot it holds while it measures; refusals in one line with their
exit codes; nothing left on the target; a measurement that ends with its controller however that ends,
shown by status and ended by stop."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from pathlib import Path

import pytest
from trainer_quick import CLI_MAIN, IDLE_RUN, copy_trainer, tiny_run_config, wait_for

from orchestrator import inventory
from orchestrator.deploy import sync as deploy
from trainer import procs

WORKDIR = "/srv/ct/dflash"
CODE = [("def add(a, b):\n", "    return a + b\n"), ("import os\n", "import sys\nimport re\n"),
        ("class Point:\n", "    def __init__(self, x, y):\n        self.x = x\n"),
        ("for i in range(3):\n", "    print(i)\n"),
        ("while True:\n", "    break\n"), ("x = [1, 2, 3]\n", "y = [a * 2 for a in x]\n"),
        ("def main():\n", "    pass\n"), ("with open(path) as f:\n", "    data = f.read()\n")]


@pytest.fixture
def ct(sshd, fakepct, make_inventory, tmp_path):
    """CT 200 with the trainer deployed and one succeeded 4-step `tiny` run on 8 chat rows, 2 held out."""
    src = copy_trainer(tmp_path / "src")
    fakepct.create(200)
    ct200 = {"host": "node", "vmid": 200, "python": sys.executable, "workdir": WORKDIR, "gpus": 0,
             "env": {"OMP_NUM_THREADS": "1"}}
    # the same container as if it had one GPU (slot gpu0; no CUDA here, so specdec runs on the CPU)
    gpu1 = {**ct200, "gpus": 1}
    differ = {**gpu1, "env": {"OMP_NUM_THREADS": "1", "DFLASH_TRAINER_FAULTS": "specdec_differ=0"}}
    path = make_inventory({"ct200": ct200, "gpu1": gpu1, "differ": differ}, default="ct200")
    assert deploy.deploy(inventory.load(str(path)), ["ct200"], source=str(src))["ct200"].ok
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n" for q, a in CODE))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(tiny_run_config(data=data, block_size=4, eval_prompts=2, eval_new_tokens=8, checkpoint_every=2))

    def cli(*args, timeout=180, wait=True):
        argv = [sys.executable, "-c", CLI_MAIN, "-i", str(path), *map(str, args)]
        if not wait:    # SIGINT at its default, as Ctrl-C finds it (conftest.py sees to that in the background too)
            return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
        return subprocess.run(argv, capture_output=True, timeout=timeout, cwd=tmp_path)

    private = fakepct.private(200) / "dflash"
    return type("CT", (), dict(cli=staticmethod(cli), cfg=cfg, tmp=tmp_path, exports=private / "exports",
                               private=private,
                               locks=lambda: sorted(p.name for p in (private / "locks").glob("*.json"))))


def one_line(r, code: int, needle: str) -> None:
    err = r.stderr.decode()
    assert r.returncode == code and needle in err, (r.returncode, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_bench_decode_measures_a_trained_run_on_its_held_out_rows_or_a_file_and_refuses_bad_input(ct):
    one_line(ct.cli("bench-decode", "ct200", "20990101-000000-abcdef"), 102, "no run '20990101-000000-abcdef'")
    bad = ct.tmp / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"messages": [{"role": "gpt"}]}) + "\n")
    one_line(ct.cli("bench-decode", "ct200", "--prompts", bad), 2, f"{bad}:2: each turn needs a role")
    one_line(ct.cli("bench-decode", "ct200", "--prompts", ct.tmp / "missing.jsonl"), 2, "no such file")

    r = ct.cli("launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", ct.cfg, "--", "--steps", "4")
    assert r.returncode == 0, r.stderr.decode()
    run = r.stdout.decode().strip()
    assert ct.cli("logs", "ct200", run, "--follow").returncode == 0
    r = ct.cli("bench-decode", "ct200", "--max-new-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr.decode()
    doc = json.loads(r.stdout)
    assert doc["target"] == "ct200" and doc["run"] == run and doc["step"] == 4
    assert doc["prompts_source"] == "held-out" and doc["prompts"] == 2 and doc["lossless"] is True
    assert doc["tau"] >= 1 and doc["tokens"] > 0 and doc["speedup"] > 0 and doc["rounds"] > 0
    assert r.stderr == b"" and doc["notes"] == []      # --json: the document alone, nothing to warn of
    assert ct.exports.is_dir() and list(ct.exports.iterdir()) == []     # the temporary folder is gone
    assert doc["gpu"] is None and ct.locks() == []     # it held the CPU slot while it measured, and let it go

    prompts = ct.tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n\n"
                       + json.dumps({"prompt": "import os\n"}) + "\n" + json.dumps({"prompt": "x = 1\n"}) + "\n")
    r = ct.cli("bench-decode", "ct200", run, "--prompts", prompts, "--max-new-tokens", "8", "--limit", "2",
               "--step", "2")
    assert r.returncode == 0, r.stderr.decode()
    err = r.stderr.decode().splitlines()
    assert [line.split(":")[1] for line in err if line.startswith("specdec: prompt ")] == [" prompt 1/2",
                                                                                        " prompt 2/2"], err
    out = r.stdout.decode().strip()
    assert out.startswith(f"ct200: run {run} step 2: lossless (2/2 equal to the target alone); 2 prompts ({prompts}")
    assert "tau " in out and "tokens/s alone" in out and "against the target alone, both graphs" in out, out
    assert list(ct.exports.iterdir()) == []

    # a run still running holds the CPU slot: nothing to measure on there, its holder named
    r = ct.cli("launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", ct.cfg, *IDLE_RUN,
               "--", "--steps", "100000")
    assert r.returncode == 0, r.stderr.decode()
    running = r.stdout.decode().strip()
    try:
        ck = ct.exports.parent / "runs" / running / "checkpoints" / "latest"
        wait_for(ck.is_file, timeout=120, what="the running run's first checkpoint")
        busy = f"no free CPU slot to measure on: the CPU slot by run {running}"
        one_line(ct.cli("bench-decode", "ct200", run), 1, busy)
        one_line(ct.cli("bench-decode", "differ", run, "--gpu", "1"), 2, "--gpu 1: differ has GPUs 0..0")

        # GPU 0 is free; specdec's reference decode of prompt 0 changed by a test hook: exit 1, said last
        r = ct.cli("bench-decode", "differ", run, "--max-new-tokens", "4", "--limit", "1")
        err = r.stderr.decode().strip().splitlines()
        assert f"bench-decode: run {running} is running here too: the timings share the machine with it" in err, err
        assert r.returncode == 1 and "Traceback" not in r.stderr.decode() and r.stdout == b"", err
        assert err[-1].startswith(f"dflash-ops: differ: run {run}: prompt 0: ") and err[-1].endswith("NOT lossless")
        assert list(ct.exports.iterdir()) == [] and ct.locks() == ["cpu.json"]      # the running run's

        # the running run itself: only with --running-ok, on a GPU it does not hold, not named as running beside
        # itself; and the target at its path another one now (tiny's seed 1, same shapes): as export, only when told
        one_line(ct.cli("bench-decode", "gpu1", running), 2, "still running (pass --running-ok")
        config = ct.private / "runs" / running / "trainer-config.json"     # read at --resume only, not while it runs
        config.write_text(json.dumps({**json.loads(config.read_text()), "target": "tiny:1"}))
        one_line(ct.cli("bench-decode", "gpu1", running, "--running-ok", "--limit", "1"), 2, "--target-changed-ok")
        # 16 new tokens: tau_for_2x is None where the prompt's forward outweighs the decode (room <= 0 in
        # decode_model.tau_for); at 4 a loaded machine's timings made it so (seen under -n 2)
        r = ct.cli("bench-decode", "gpu1", running, "--running-ok", "--target-changed-ok", "--max-new-tokens", "16",
                   "--limit", "1", "--json")
        assert r.returncode == 0, r.stderr.decode()
        doc = json.loads(r.stdout)
        assert doc["running"] is True and doc["step"] >= 2 and doc["gpu"] == "0" and doc["notes"] == [], doc
        assert doc["model"] == "tiny:1" and doc["cost_model"]["tau_for_2x"] > 0, doc
    finally:
        assert ct.cli("stop", "ct200", running).returncode == 0
    assert ct.locks() == []

    ends_with_its_controller(ct, run)

    prompts = ct.tmp / "one.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n")
    r = ct.cli("regen", "ct200", "--prompts", prompts, "--model", "tiny", "--gpus", "0")
    assert r.returncode == 0, r.stderr.decode()
    one_line(ct.cli("bench-decode", "ct200", r.stdout.decode().strip()), 2, "a regen run has no drafter")


def in_container(private: Path) -> list[int]:
    """The live processes inside the pct stand-in's container whose private folder this is (their /srv/ct
    is it, as `pct stop` finds them)."""
    want, found = private.stat(), []
    for name in os.listdir("/proc"):
        try:
            st = os.stat(f"/proc/{name}/root/srv/ct") if name.isdigit() else None
            alive = st is not None and Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
        except OSError:
            continue
        if alive and (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            found.append(int(name))
    return found


def ends_with_its_controller(ct, run: str) -> None:
    """A bench-decode lives as long as its controller, and status and stop see it (in the test above, on its
    trained run: one training run fewer). Before, a bench-decode's agent and specdec ran on for minutes after
    its controller was killed or timed out, holding the slot, unseen by `status`, beyond `stop`; Ctrl-C left the
    slot's lock and its folder. Each way it can end, at the worker it runs then (export or specdec), and what must
    hold after it: nothing of it running in the container, the slot free (the next bench-decode takes it), no
    temporary folder (or the next call removes it), one line from its controller."""
    lock, inside = ct.private / "locks" / "cpu.json", lambda: in_container(ct.private.parent)

    def holder():
        """The live agent that holds the slot (not a killed one whose lock is left)."""
        try:
            pid = json.loads(lock.read_text())["pid"]
        except (OSError, ValueError, KeyError):
            return None
        return pid if Path(f"/proc/{pid}").exists() else None

    def running(agent, module):
        for p in procs.children(agent):
            try:
                if module.encode() in Path(f"/proc/{p}/cmdline").read_bytes():
                    return p
            except OSError:
                pass
        return None

    def bench(module):
        """A bench-decode of `run` that would decode for minutes: (its controller, agent, worker) once the agent's
        worker runs `module` (trainer.export, then trainer.specdec)."""
        proc = ct.cli("bench-decode", "ct200", run, "--max-new-tokens", "100000", "--limit", "1", "--json", wait=False)
        agent = wait_for(holder, 120, "the bench's slot")
        return proc, agent, wait_for(lambda: running(agent, module), 120, f"its {module}")

    def ended(proc, code, needle):
        out, err = proc.communicate(timeout=60)
        one_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), code, needle)
        assert out == b"", out

    def clean(within=5):
        wait_for(lambda: not inside() and ct.locks() == [] and list(ct.exports.iterdir()) == [], within,
                 "nothing of the bench left on the target")

    # Ctrl-C, then SIGTERM (`timeout`), in its controller: the target is told and its end awaited, then one line
    for sig in (signal.SIGINT, signal.SIGTERM):
        proc, agent, worker = bench("trainer.export")
        proc.send_signal(sig)
        ended(proc, 128 + sig, f"ct200: bench-decode interrupted ({sig.name}): the measurement on the target ended "
                               "and its slot is free")
        assert ct.locks() == [] and list(ct.exports.iterdir()) == [], sig     # already, as the controller said
        clean()

    # its controller killed with SIGKILL: the connection closes, and the target ends it within seconds
    proc, agent, worker = bench("trainer.specdec")
    proc.kill()
    proc.wait()
    clean(within=20)

    # seen by status, ended by stop (SIGTERM to its agent, then --force: SIGKILL to the agent and its worker)
    for force in (False, True):
        proc, agent, worker = bench("trainer.export")
        if not force:
            r = ct.cli("status", "ct200", "--json")
            assert r.returncode == 0, r.stderr.decode()
            row = json.loads(r.stdout)["runs"][-1]
            assert row["run"] == f"bench-{agent}" and row["kind"] == "bench-decode" and row["pid"] == agent, row
            assert row["state"] == "running" and row["measures"] == run and row["started"] and row["slots"] == ["cpu"]
            assert f"bench-decode of {run}" in ct.cli("status", "ct200").stdout.decode()
        r = ct.cli("stop", "ct200", f"bench-{agent}", *["--force"] * force)
        assert r.returncode == 0 and r.stdout.decode().startswith(
            f"ct200: bench-decode bench-{agent} of run {run} stopped ({'SIGKILL' if force else 'SIGTERM'}, "), r
        assert ct.locks() == [] and list(ct.exports.iterdir()) == []
        ended(proc, 1, "agent on the target was killed (exit 137)" if force else "ended by SIGTERM on the target")
        clean()

    # its agent killed with SIGKILL: specdec dies with it; the lock it leaves is stale (status shows nothing), its
    # folder stays; the next bench-decode takes the slot and removes the folder; then its export killed alone
    proc, agent, worker = bench("trainer.specdec")
    os.kill(agent, signal.SIGKILL)
    ended(proc, 1, "the measurement's agent on the target was killed (exit 137)")
    wait_for(lambda: not inside(), 20, "its specdec to die with its agent")
    assert ct.locks() == ["cpu.json"] and [p.name for p in ct.exports.iterdir()] == [f".tmp-{agent}"]
    assert [r["run"] for r in json.loads(ct.cli("status", "ct200", "--json").stdout)["runs"]
            if r["kind"] == "bench-decode"] == []
    proc, second, worker = bench("trainer.export")
    assert [p.name for p in ct.exports.iterdir()] == [f".tmp-{second}"]
    os.kill(worker, signal.SIGKILL)
    ended(proc, 1, "export killed by signal 9 (SIGKILL: out of memory?)")
    clean()


def test_the_held_out_prompts_are_the_last_eval_prompts_rows_cut_before_their_first_answer(tmp_path, capsys):
    from orchestrator.remote.runs.bench import _held_out

    out = tmp_path / "prompts.jsonl"
    turns = [{"role": "system", "content": "#"}, {"role": "user", "content": "a"},
             {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    rows = [{"messages": [{"role": "user", "content": str(i)}, {"role": "assistant", "content": "x"}]}
            for i in range(4)] + [{"messages": turns}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n\n" for r in rows))   # blank lines: no rows
    (tmp_path / "ids.jsonl").write_text("[1]\n" + json.dumps({"input_ids": [1, 2, 3]}) + "\n")

    def held(**cfg):
        try:
            return _held_out("R", cfg, str(out), str(tmp_path))
        except SystemExit:
            return json.loads(capsys.readouterr().out)

    assert held(data="data.jsonl", eval_prompts=2) == 2      # relative to the trainer's cwd, as it read it
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"messages": [{"role": "user", "content": "3"}]}, {"messages": turns[:2]}]
    for cfg, why in [({"data": "synthetic", "eval_prompts": 2}, "synthetic data"),
                     ({"data": "data.jsonl", "eval_prompts": 0}, "held out no rows"),
                     ({"data": "data.jsonl", "eval_prompts": 3}, "5 rows were too few to hold 3 out"),
                     ({"data": "missing.jsonl", "eval_prompts": 1}, "cannot read its data"),
                     ({"data": str(tmp_path / "ids.jsonl"), "eval_prompts": 1}, "not chat rows")]:
        doc = held(**cfg)
        assert doc["reason"] == "no_prompts" and why in doc["message"] and doc["exit_code"] == 2, doc


def refusal(capsys, fn, *args, **kw):
    """An agent function's reply: its refusal's document (it exits through refuse()), else its value."""
    try:
        return fn(*args, **kw)
    except SystemExit:
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_child_killed_by_a_signal_is_said_so_with_128_plus_n(tmp_path, capsys):
    from orchestrator.remote.runs.export import run_child

    def child(code):
        return [sys.executable, "-c", "import os, signal, sys; print('specdec: prompt 1/2: 7 tokens', file=sys.stderr,"
                f" flush=True); print('specdec: error: bad prompt', file=sys.stderr) if {code} > 0 else None; "
                f"os.kill(os.getpid(), -{code}) if {code} < 0 else sys.exit({code})"]

    def ran(code, what="specdec"):
        return refusal(capsys, run_child, "R", what, child(code), str(tmp_path), dict(os.environ),
                       reason=lambda last: "not_lossless" if "NOT lossless" in last else "bench")

    doc = ran(-9)
    assert (doc["reason"], doc["message"], doc["exit_code"]) == ("bench", "specdec killed by signal 9 (SIGKILL: out "
                                                                 "of memory?)", 137), doc
    doc = ran(-15, "export")
    assert (doc["message"], doc["exit_code"]) == ("export killed by signal 15 (SIGTERM)", 143), doc
    assert ran(2)["message"] == "bad prompt" and ran(2)["exit_code"] == 2
    assert refusal(capsys, run_child, "R", "x", [sys.executable, "-c", "print('doc')"], str(tmp_path),
                   dict(os.environ)) == b"doc\n"


def test_the_runs_programs_run_from_its_cwd_with_its_env_and_the_live_releases_code(tmp_path, capsys):
    from orchestrator.remote.runs.export import run_child, program, run_cwd, run_env

    for folder in ("wd/releases/new", "wd/releases/old"):     # both have a trainer package: new is live
        (tmp_path / folder / "trainer").mkdir(parents=True)
        (tmp_path / folder / "trainer" / "__init__.py").write_text("")
        (tmp_path / folder / "trainer" / "where.py").write_text(
            "import json, os, sys\nprint(json.dumps([__file__, os.getcwd(), os.environ.get('CACHE'), "
            "os.environ.get('SECRET_TOKEN'), os.environ['CUDA_VISIBLE_DEVICES'], sys.argv[1:]]))\n")
    (tmp_path / "wd" / "current").symlink_to("releases/new")
    wd, old = str(tmp_path / "wd"), str(tmp_path / "wd" / "releases" / "old")
    rec = {"cwd": old, "user_env": {"CACHE": "/c", "SECRET_TOKEN": "***"}}
    assert run_cwd(wd, rec) == old and run_cwd(wd, {"cwd": old + "-pruned"}) == str(tmp_path / "wd/releases/new")
    env = run_env(rec, {"CACHE": "/now", "SECRET_TOKEN": "s3", "PATH": os.environ["PATH"]}, "1")
    out = run_child("R", "where", program(wd, "trainer.where") + ["--x", "1"], run_cwd(wd, rec), env)
    assert json.loads(out) == [str(tmp_path / "wd/releases/new/trainer/where.py"), old, "/c", "s3", "1", ["--x", "1"]]


def test_a_bench_holds_one_free_slot_while_it_lives(tmp_path, capsys):
    from orchestrator.remote.runs.bench import _claim_slot
    from orchestrator.remote.runs.locks import release_slots

    wd = str(tmp_path)
    assert refusal(capsys, _claim_slot, wd, "R", 2) == (f"bench-{os.getpid()}", "0")
    (tmp_path / "locks" / "gpu1.json").write_text(json.dumps({"run": "T", "pid": os.getppid()}))   # a live run
    doc = refusal(capsys, _claim_slot, wd, "R", 2)
    assert doc["reason"] == "busy" and doc["exit_code"] == 1, doc
    assert doc["message"] == f"no free GPU to measure on: GPU 0 by run bench-{os.getpid()} (pid {os.getpid()}), " \
                             f"GPU 1 by run T (pid {os.getppid()})"
    assert refusal(capsys, _claim_slot, wd, "R", 2, 2)["reason"] == "bad_gpu"
    release_slots(wd, f"bench-{os.getpid()}")
    assert refusal(capsys, _claim_slot, wd, "R", 2, 0) == (f"bench-{os.getpid()}", "0")
    # an agent killed with SIGKILL: its lock names a process that is gone, so the slot is free
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout
    lock = json.loads((tmp_path / "locks" / "gpu0.json").read_text())
    for key in ("launcher_pid", "supervisor_pid", "pid"):
        lock[key] = int(gone)
    (tmp_path / "locks" / "gpu0.json").write_text(json.dumps(lock))
    assert refusal(capsys, _claim_slot, wd, "R", 2, 0) == (f"bench-{os.getpid()}", "0")
    assert refusal(capsys, _claim_slot, wd, "R", 0) == (f"bench-{os.getpid()}", "")       # CPU-only: the cpu slot
    assert sorted(p.name for p in (tmp_path / "locks").glob("*.json")) == ["cpu.json", "gpu0.json", "gpu1.json"]


def test_the_held_out_rows_are_the_ones_the_trainers_split_eval_holds_out(tmp_path, capsys):
    """The agent cannot import the trainer: its copy of split_eval's rule, held equal here."""
    from orchestrator.remote.runs.bench import _held_out
    from trainer.run.data import Sample, split_eval

    out = tmp_path / "prompts.jsonl"
    for rows, n in ((8, 2), (4, 2), (3, 2), (5, 1), (1, 1), (6, 3)):
        (tmp_path / "data.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": str(i)}]})
                                                     + "\n" for i in range(rows)))
        _, prompts, held_out = split_eval([Sample((i,), (1,)) for i in range(rows)], n)
        got = refusal(capsys, _held_out, "R", {"data": "data.jsonl", "eval_prompts": n}, str(out), str(tmp_path))
        if held_out:
            assert got == n and [int(json.loads(line)["messages"][0]["content"]) for line in
                                 out.read_text().splitlines()] == [p[0] for p in prompts], (rows, n)
        else:       # the trainer evaluated on training rows: none held out to measure on
            assert got["reason"] == "no_prompts" and "too few" in got["message"], (rows, n, got)


def test_refusals_say_what_the_user_wanted_done():
    from orchestrator.errors import NotFound, OpsError
    from orchestrator.inventory import Target
    from orchestrator.runs import bench_decode, export
    from orchestrator.ssh.agent_call import Refused

    t = Target(name="ct200", workdir="/w")
    none = Refused("ct200", {"reason": "not_found", "any_runs": True})
    for refusal, verb in ((bench_decode._refusal, "measure"), (export.refusal, "export")):
        e = refusal(t, "latest", none)
        assert isinstance(e, NotFound) and str(e).startswith(f"ct200: no succeeded run in /w/runs to {verb}; "), e
    e = bench_decode._refusal(t, "R", Refused("ct200", {"reason": "busy", "run": "R", "message": "no free GPU"}))
    assert type(e) is OpsError and str(e) == "ct200: run R: cannot measure decoding: no free GPU"


def test_the_rows_the_trainer_skipped_are_read_from_the_logs_head_only(tmp_path, monkeypatch):
    from orchestrator.remote.runs import bench

    monkeypatch.setattr(bench, "LOG_HEAD", 100)
    line = "[trainer] data d.jsonl: 6 rows for training, 2 skipped (no room for a block in the loss mask)\n"
    (tmp_path / "train.log").write_text(line + "x" * 100 + "\n")
    assert bench._skipped(str(tmp_path)) == 2
    (tmp_path / "train.log").write_text("x" * 100 + "\n" + line)
    assert bench._skipped(str(tmp_path)) == 0 and bench._skipped(str(tmp_path / "none")) == 0
