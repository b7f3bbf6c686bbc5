"""The runs agent on this machine with a stub trainer: its joined source, a workdir with one release
whose trainer is the stub (the `wd` fixture), and the calls the runs-agent tests make."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from trainer_quick import wait_for

from orchestrator.ssh import agent_call as agent_mod

POLICIES = Path(__file__).resolve().parent.parent / "trainer" / "policies.py"
SOURCE = agent_mod.command(agent_mod.RUNS)   # what the controller sends: `python -c SOURCE CMD ...`

STUB = r'''
import argparse, json, os, signal, sys, time
p = argparse.ArgumentParser()
p.add_argument("--out"); p.add_argument("--gpus", type=int); p.add_argument("--topology")
p.add_argument("--compile-policy"); p.add_argument("--workers"); p.add_argument("--config")
p.add_argument("--steps", type=int, default=5); p.add_argument("--sleep", type=float, default=0.01)
p.add_argument("--resume", action="store_true")
a = p.parse_args()
first = 1
if a.resume and os.path.exists(os.path.join(a.out, "checkpoint")):
    first = int(open(os.path.join(a.out, "checkpoint")).read())
    print(json.dumps({"event": "resume", "step": first - 1}), flush=True)
print("[stub] CUDA_VISIBLE_DEVICES=%r HOME=%s unbuffered=%s cwd=%s config=%s" % (
    os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("HOME"),
    os.environ.get("PYTHONUNBUFFERED"), os.getcwd(), a.config), flush=True)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
for i in range(first, a.steps + 1):
    if stop:
        open(os.path.join(a.out, "checkpoint"), "w").write(str(i))
        print(json.dumps({"event": "stopped", "step": i - 1}), flush=True)
        sys.exit(143)
    pace = {} if i == first else {"steps_per_s": 4.0, "eta_s": (a.steps - i) / 4.0}   # the trainer's: none at first
    print(json.dumps(dict({"step": i, "loss": 1.0 / i, "tokens_per_s": 100.0 + i}, **pace)), flush=True)
    time.sleep(a.sleep)
print(json.dumps({"event": "done", "step": a.steps, "loss": 1.0 / a.steps, "acceptance_length": 2.5}))
'''


def make_workdir(root: Path) -> Path:
    """root/wd: one release, live, whose trainer is the stub (the `wd` fixture of conftest.py)."""
    rel = root / "wd" / "releases" / "r1"
    (rel / "trainer").mkdir(parents=True)
    (rel / "trainer" / "__main__.py").write_text(STUB)
    shutil.copy(POLICIES, rel / "trainer" / "policies.py")     # `auto`'s rule: the release's own
    (rel / ".git-commit").write_text("abc1234\n")
    os.symlink("releases/r1", root / "wd" / "current")
    return root / "wd"


def kill_leftovers(wd: Path) -> None:
    """Stop whatever a failed test left running in wd."""
    for run in (wd / "runs").glob("*"):
        rec = _json(run / "run.json")
        for pid in (rec.get("pid"), rec.get("supervisor_pid")):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def _json(path):
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):     # tests write broken records on purpose
        return {}
    return doc if isinstance(doc, dict) else {}


def agent(cmd, wd, *args, stdin=None, timeout=60, env=None):
    """The agent's CMD on wd (env: variables added to this process's); it must exit 0."""
    r = subprocess.run([sys.executable, "-c", SOURCE, cmd, str(wd), *map(str, args)],
                       input=stdin, capture_output=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr.decode()
    return r


def launch(wd, run, *, gpus=0, total=0, compile_policy="eager", extra=(), env=None, **spec):
    doc = {"run": run, "gpus": gpus, "target_gpus": total, "compile_policy": compile_policy, "extra": list(extra),
           **spec}
    r = agent("launch", wd, stdin=json.dumps(doc).encode(), env=env)
    return json.loads(r.stdout.decode().splitlines()[-1])


def state(wd, run):
    doc = json.loads(agent("status", wd, "--", run).stdout)
    return doc["runs"][0]


def ended(wd, run, timeout=30):
    return wait_for(lambda: (wd / "runs" / run / "exit.json").exists(), timeout, f"{run} to end")


