"""`logs` on a terminal: each event once, as a human line (the trainer's JSON twins left out), and
Ctrl-C ends the follow, not the run, saying how to stop it. A real tiny run in the pct stand-in
through the real sshd; the CLI's stdout is a pseudo-terminal."""
import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from collections import Counter

from trainer_quick import CLI_MAIN, IDLE_RUN, copy_trainer, tiny_run_config, wait_for

from orchestrator import inventory
from orchestrator.deploy import sync as deploy
from orchestrator.runs.logview import for_terminal

WORKDIR = "/srv/ct/dflash"


def test_a_terminal_shows_each_event_once():
    step = json.dumps({"step": 3, "loss": 1.5, "accuracy": 0.1}).encode() + b"\n"
    assert for_terminal(step) is None                                  # its twin is the [trainer] line
    assert for_terminal(b'[rank0]: ' + step) is None
    assert for_terminal(b'{"event": "done", "step": 3, "loss": 1.5}\n') is None
    assert for_terminal(b'{"event": "checkpoint", "step": 4, "path": "/r/ck-4", "seconds": 0.1}\n') == \
        b"[trainer] checkpoint at step 4: /r/ck-4\n"
    assert for_terminal(b'[rank0]: {"event": "stopped", "step": 9}\n') == b"[rank0]: [trainer] stopped at step 9\n"
    for kept in (b"[trainer] step 3/10 | loss 1.5\n", b"{not json\n", b"[1, 2]\n", b'{"other": 1}\n'):
        assert for_terminal(kept) == kept



# Each event's words on a terminal: the trainer's own text line (a twinned event) or the one
# for_terminal writes in its place.
SHOWN = {"worker_ready": lambda e: f"worker {e['worker']} ({e['device']}) ready in",
         "eval": lambda e: f"eval at step {e['step']}: tau",
         "done": lambda e: f"done: {e['step']} steps",
         "resume": lambda e: f"resumed from {e['path']} at step {e['step']}",
         "checkpoint": lambda e: f"checkpoint at step {e['step']}: {e['path']}",
         "checksum": lambda e: f"replicas' weights agree at step {e['step']}"}


def test_the_events_left_out_are_the_trainers_own_list(tmp_path, capsys):
    """The trainer says which events it also writes as text; `logs` reads that list, not a copy. A real
    run's output (two workers, checkpoints, evals, checksums, then a resume), as a terminal shows it:
    no JSON line, and each of its events on exactly one line (a twinned event by the trainer's text)."""
    from trainer_quick import train

    from orchestrator.runs import logview
    from trainer.run import log

    assert logview.TWINNED is log.TWINNED
    out = tmp_path / "run"
    every = ("--checkpoint-every", "2", "--eval-every", "2", "--checksum-every", "2")
    assert train(out, "--steps", "4", "--workers", "2", *every) == 0
    assert train(out, "--steps", "6", "--workers", "2", "--resume", *every) == 0
    lines = capsys.readouterr().out.encode().splitlines(keepends=True)
    shown = [t.decode() for t in map(for_terminal, lines) if t is not None]
    assert not [t for t in shown if t.startswith("{")], shown
    events = [json.loads(line) for line in lines if line.startswith(b'{"event"')]
    assert {e["event"] for e in events} == set(SHOWN), events
    for e in events:
        if e["event"] == "resume":      # the checkpoint it resumed from
            e["path"] = out / "checkpoints" / f"step-{e['step']:08d}"
    said = Counter(SHOWN[e["event"]](e) for e in events)
    for words, n in said.items():       # (each run's workers are ready once: twice in all)
        assert sum(words in t for t in shown) == n, (words, n, shown)
    steps = Counter(f"[trainer] step {json.loads(line)['step']}/" for line in lines if line.startswith(b'{"step"'))
    assert sorted(steps) == [f"[trainer] step {i}/" for i in range(1, 7)]
    for words, n in steps.items():
        assert sum(t.startswith(words) for t in shown) == n, (words, n, shown)


def test_ctrl_c_while_following_says_the_run_goes_on_and_how_to_stop_it(sshd, fakepct, make_inventory, tmp_path):
    fakepct.create(200)
    path = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable, "workdir": WORKDIR}})
    assert deploy.deploy(inventory.load(str(path)), ["ct200"], source=str(copy_trainer(tmp_path / "src")))["ct200"].ok
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_run_config(checkpoint_every=2))

    def cli(*args):
        return subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", str(path), *map(str, args)],
                              capture_output=True, timeout=180)

    # IDLE_RUN: after its first 4 steps the run sleeps before each step, leaving the cores to the rest
    r = cli("launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", cfg, *IDLE_RUN,
            "--", "--steps", "1000000")
    assert r.returncode == 0, r.stderr.decode()
    run = r.stdout.decode().strip()
    try:
        main, term = pty.openpty()
        # Ctrl-C as a terminal user's shell delivers it: SIGINT at its default (conftest.py puts it back
        # where the suite was started with it ignored, as `make test &` from a script does)
        follow = subprocess.Popen([sys.executable, "-c", CLI_MAIN, "-i", str(path), "logs", "ct200", run],
                                  stdout=term, stderr=subprocess.PIPE)
        os.close(term)
        seen = bytearray()

        def shown() -> bool:
            if select.select([main], [], [], 0.2)[0]:   # one read per poll: the run never pauses
                seen.extend(os.read(main, 65536))
            return seen.count(b"[trainer] step ") >= 3 and b"checkpoint at step" in seen

        wait_for(shown, timeout=120, what="three steps and a checkpoint on the terminal")
        follow.send_signal(signal.SIGINT)
        _, err = follow.communicate(timeout=60)
        assert follow.returncode == 130, err
        assert err.decode().splitlines()[-1] == (
            f"dflash-ops: stopped following; run {run} goes on (ct200): `dflash-ops logs ct200 {run}` follows it "
            f"again, `dflash-ops stop ct200 {run}` stops it")
        twins = [x for x in seen.splitlines() if b'{"step": ' in x or b'"event"' in x]
        assert not twins, twins                                       # each event once, as a human line
        time.sleep(1)
        status = json.loads(cli("status", "ct200", "--json").stdout)["runs"]
        assert [(s["run"], s["state"]) for s in status] == [(run, "running")]
    finally:
        cli("stop", "ct200", run, "--force")


def test_json_carries_each_event_once_with_a_signature_line_and_the_steps_summarised():
    from orchestrator.runs.follow import Line, Reconnecting
    from orchestrator.runs.logview import Seen
    from trainer.signatures import load_catalog

    oom = next(s for s in load_catalog().signatures if s.id == "cuda-oom")
    seen = Seen()
    log = [Line(b'{"step": 1, "loss": 3.0, "accuracy": 0.1}\n', 1), Line(b"[trainer] step 1/9 | loss 3.0\n", 2),
           Line(b'{"event": "checkpoint", "step": 1, "path": "/r/ck-1"}\n', 3),
           Line(b"[trainer] checkpoint at step 1\n", 4),
           Line(b'{"step": 2, "loss": 2.5, "accuracy": 0.2}\n', 5),
           Line(b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n", 6, [oom]),
           Line(b'{"event": "worker_failed", "worker": 1, "error": "CUDA out of memory"}\n', 7, [oom])]
    for line in log:
        seen.line(None, line)
    seen.connection(None, Reconnecting(attempt=1, delay=0.5, reason="EOF", offset=10), "connection_lost")
    doc = seen.as_json()
    assert [(e["event"], e["line"]) for e in doc["events"][:3]] == [("checkpoint", 3), ("signature", 6),
                                                                     ("worker_failed", 7)]
    assert doc["events"][1]["signature"] == "cuda-oom" and "out of memory" in doc["events"][1]["text"]
    assert doc["events"][2]["signatures"] == [{"signature": "cuda-oom", "severity": oom.severity}]
    assert doc["events"][3]["event"] == "connection_lost" and doc["events"][3]["attempt"] == 1
    assert doc["steps"] == {"lines": 2, "first_step": 1, "first_loss": 3.0, "min_loss": 2.5, "last_step": 2,
                            "last_loss": 2.5, "last": {"step": 2, "loss": 2.5, "accuracy": 0.2}}
    several = Seen()
    several.line("ct300", Line(b'[rank0]: {"step": 4, "loss": 1.0}\n', 1))
    assert several.as_json()["steps"]["ct300"]["last_step"] == 4
    several.line("ct300", Line(b'{"event": "x", "target": "tiny", "line": 99}\n', 2))   # ours win
    assert several.as_json()["events"] == [{"event": "x", "target": "ct300", "line": 2}]


def test_logs_json_is_one_document_following_or_not(sshd, fakepct, make_inventory, tmp_path):
    fakepct.create(200)
    path = make_inventory({"ct200": {"host": "node", "vmid": 200, "python": sys.executable, "workdir": WORKDIR}})
    assert deploy.deploy(inventory.load(str(path)), ["ct200"], source=str(copy_trainer(tmp_path / "src")))["ct200"].ok
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_run_config(checkpoint_every=4, log_every=2, steps=8))

    def cli(*args):
        return subprocess.run([sys.executable, "-c", CLI_MAIN, "-i", str(path), *map(str, args)],
                              capture_output=True, timeout=180)

    r = cli("launch", "ct200", "--gpus", "0", "--policy", "eager", "--config", cfg)
    assert r.returncode == 0, r.stderr.decode()
    run = r.stdout.decode().strip()
    followed = cli("logs", "ct200", run, "--follow", "--json")       # from the start to the end, as it runs
    assert followed.returncode == 0, followed.stderr.decode()
    doc = json.loads(followed.stdout)                                # ONE document, nothing else on stdout
    assert doc["state"] == "succeeded" and doc["run"] == run
    kinds = [e["event"] for e in doc["events"]]
    assert kinds.count("checkpoint") == 2 and kinds.count("done") == 1, kinds     # each once
    assert doc["steps"]["lines"] == 4 and doc["steps"]["last_step"] == 8 and doc["steps"]["first_step"] == 2
    assert b"[trainer]" not in followed.stderr                       # no per-event streaming with --json
    again = cli("logs", "ct200", run, "--no-follow", "--json")
    assert json.loads(again.stdout)["events"] == doc["events"]
