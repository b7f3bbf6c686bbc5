"""Runs agent: the `probe` command. Runs the probe program of the live release
(`python -m trainer.probe`, trainer/probe/program.py) and replies with its document.

    probe WORKDIR [--reuse] -- PROBE_ARGS...

With --reuse, a WORKDIR/probe.json made with the torch installed now (same version) is the reply
as it is, marked "reused" with its time; the probe runs only when there is none or torch changed.

The probe's progress lines (one per case) go to stderr as they come; its JSON document (its whole
stdout) comes back as the reply's "probe". No release deployed is a refusal, not an exit status:
{"ok": false, "reason": "no_release", "message": ...}. A probe program that fails passes its exit
status on (its own message is the last stderr line).
"""
import json
import os
import subprocess
import sys

from ..agent_base import MAX_RECORD_BYTES, dist_version, emit, fail, home_dir, read_json, refuse
from ..release.store import live_release
from .spec import PROBE_FILE


def cmd_probe(workdir, args, reuse=False):
    _, path = live_release(workdir)
    if not path or not os.path.isdir(path):
        refuse("no_release", "no release deployed in %s" % workdir)
    if reuse:
        saved = read_json(os.path.join(workdir, PROBE_FILE), MAX_RECORD_BYTES)     # a few KB
        if isinstance(saved, dict) and isinstance(saved.get("result"), dict) and saved.get("policy") \
                and saved.get("torch") and saved.get("torch") == dist_version("torch"):
            emit({"ok": True, "probe": dict(saved["result"], reused=saved.get("time"))})
            return
    env = dict(os.environ)
    # `pct exec --keep-env 0` leaves no HOME; torch's compile caches want one.
    env.update({"HOME": home_dir(), "PYTHONUNBUFFERED": "1"})
    sys.stderr.flush()
    proc = subprocess.run([sys.executable, "-m", "trainer.probe", "--workdir", workdir] + list(args),
                          cwd=path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    if proc.returncode != 0:
        sys.exit(proc.returncode)
    try:
        doc = json.loads(proc.stdout.decode("utf-8", "replace"))
    except ValueError:
        fail("the probe printed no JSON document")
    emit({"ok": True, "probe": doc})
