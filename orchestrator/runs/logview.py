"""How `logs` (and `launch --follow`) show a run: the log's lines on stdout as they arrive, notes
and the summary on stderr.

stdout piped or redirected is the log byte for byte (`| grep`, `> file`). On a terminal each event
prints once, as a human line: the trainer writes every step, eval and end twice (a `[trainer]`
line and its JSON twin, which `report` reads), so there the JSON twin is left out; a JSON event
without a twin (a checkpoint, a stop) is shown as a line of its own. With --json, nothing but ONE
document at the end (also with --follow): the summary, plus `events` and `steps` (Seen): the
per-event streaming is the human output. Ctrl-C stops following, never the run: it says so and how
to stop it.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

import click
from trainer.controller_view import TWINNED     # the trainer's list of events it also writes as text (torch-free)

from orchestrator.errors import OpsError, Terminated

SEVERITY_COLOUR = {"fatal": b"1;31", "warning": b"33"}


def isatty(stream) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def note(text: str) -> None:
    click.echo(f"dflash-ops: {text}", err=True)


def fmt_num(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def fmt_tau(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def fmt_elapsed(seconds) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{seconds:.0f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class Seen:
    """What `--json` carries of the log besides the summary, each event once: `events`, in order, the
    trainer's JSON events (eval, checkpoint, worker_failed, done, ...; not their `[trainer]` twins),
    each with the line it came on and the signatures that line matched; every other line that
    matched a failure signature (`"event": "signature"`, its text); the connection lost and resumed.
    `steps`: the step lines summarised (how many, first and last step, first, last and lowest loss,
    the last step's whole record); with several nodes, per node."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.steps: dict = {}

    def line(self, target: str | None, line) -> None:
        _, doc = _json_line(line.data)
        at = {"target": target} if target is not None else {}
        sigs = [{"signature": s.id, "severity": s.severity} for s in line.hits]
        if doc is not None and doc.get("event") is None and "step" in doc and "loss" in doc:
            self._step(target, doc)
        elif doc is not None and doc.get("event") is not None:
            # where it was said last: an event of the trainer's with a "target" or "line" key keeps ours
            self.events.append({**doc, **at, "line": line.number, **({"signatures": sigs} if sigs else {})})
        else:
            self.events.extend({**at, "event": "signature", "line": line.number, **sig, "text": line.text[:500]}
                               for sig in sigs)

    def connection(self, target: str | None, event, kind: str) -> None:
        at = {"target": target} if target is not None else {}
        self.events.append({**at, "event": kind, **{k: v for k, v in vars(event).items() if k != "since"}})

    def _step(self, target, doc: dict) -> None:
        s = self.steps.setdefault(target, {"lines": 0, "first_step": doc["step"], "first_loss": doc["loss"],
                                           "min_loss": None})
        loss = doc["loss"]
        s.update(lines=s["lines"] + 1, last_step=doc["step"], last_loss=loss, last=doc)
        if isinstance(loss, (int, float)) and (s["min_loss"] is None or loss < s["min_loss"]):
            s["min_loss"] = loss

    def as_json(self) -> dict:
        several = any(k is not None for k in self.steps) or any("target" in e for e in self.events)
        return {"events": self.events, "steps": self.steps if several else self.steps.get(None, {"lines": 0})}


def _rank_lead(data: bytes) -> tuple[bytes, bytes]:
    """A log line as its rank lead (`[rankN]: `, torchrun's, or b"") and the rest."""
    if data.startswith(b"[rank"):
        head, sep, rest = data.partition(b"]: ")
        if sep and head[5:].isdigit():
            return head + sep, rest
    return b"", data


def _json_line(data: bytes) -> tuple[bytes, dict | None]:
    """A log line's rank lead (`[rankN]: `, or b"") and its JSON object (None when it is not one)."""
    lead, body = _rank_lead(data)
    if not body.startswith(b"{"):
        return lead, None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):     # a line of the log: anything may be written there
        return lead, None
    return lead, (doc if isinstance(doc, dict) else None)


def print_job(events, as_json: bool, seen: Seen | None = None):
    """Write each line to stdout as it arrives; explain each signature once (per node) on stderr;
    print the summary last and return it (a follow.Summary for a run on one node, a
    nodes.JobSummary for a job over several).

    The first event (nodes.Job) names the run's nodes. One node: its lines as they are (coloured
    on a terminal where a signature hit). Several: each line led by `[target/rankN]` (rank 0
    included: with several nodes its lines carry `[rank0]: ` in the log too) or `[target]` (the
    node's launcher and torchrun), notes led by the node, and one summary for the job. On a
    terminal each event once (for_terminal). With --json nothing is printed; `seen` collects the
    events for the one document. Ctrl-C ends the follow (exit 130) saying the run goes on and how to
    stop it."""
    out = sys.stdout.buffer
    with contextlib.closing(events):
        job = next(events)
        try:
            return _print_events(events, job, as_json, out, isatty(sys.stdout), seen)
        except KeyboardInterrupt as e:  # Ctrl-C (SIGTERM where the caller raises it) stops this follow, not the run
            first = job.targets[0]
            note(f"stopped following; run {job.run} goes on ({', '.join(job.targets)}): "
                 f"`dflash-ops logs {first} {job.run}` follows it again, `dflash-ops stop {first} {job.run}` stops it")
            sys.exit(143 if isinstance(e, Terminated) else 130)


def _print_events(events, job, as_json: bool, out, tty: bool, seen: Seen | None = None):
    """print_job's loop over the events after the Job; the summary."""
    from orchestrator.runs.follow import Line, Reconnecting, Resumed
    from orchestrator.runs.nodes import NodeEvent

    explained: set = set()
    several = len(job.targets) > 1
    for ev in events:
        if not isinstance(ev, NodeEvent):       # the summary, last
            if not as_json:
                note(_job_summary_line(ev) if several else _summary_line(ev))
            return ev
        t, e = (ev.target if several else None), ev.event
        at = f"{t}: " if t is not None else ""
        if seen is not None:
            if isinstance(e, Line):
                seen.line(t, e)
            elif isinstance(e, (Reconnecting, Resumed)):
                seen.connection(t, e, "connection_lost" if isinstance(e, Reconnecting) else "resumed")
        if isinstance(e, Line):
            data = for_terminal(e.data) if tty else e.data
            if not as_json and data is not None:
                data = _prefixed(t, data) if t is not None else _coloured(e, data) if tty else data
                try:
                    out.write(data)
                    out.flush()
                except BrokenPipeError:
                    _reader_gone()
            for sig in e.hits:
                if (t, sig.id) in explained or as_json:
                    continue
                explained.add((t, sig.id))
                note(f"{at}line {e.number}: `{sig.id}` ({sig.severity}): {sig.meaning}")
                click.echo(f"            what to do: {sig.remedy}", err=True)
        elif isinstance(e, Reconnecting):
            if not as_json:
                resuming = f", resuming at byte {max(e.offset, 0)}" if t is None else ""
                note(f"{at}connection lost ({e.reason}); reconnecting in {e.delay:g} s "
                     f"(attempt {e.attempt}{resuming})")
        elif isinstance(e, Resumed):
            if not as_json:
                note(f"{at}reconnected after {e.down_s:.2f} s; resuming at byte {e.offset}")
    raise OpsError("the log streams ended without a summary" if several
                   else "the log stream ended without a summary")


def for_terminal(data: bytes) -> bytes | None:
    """A log line as a terminal shows it: None for the JSON twin of a `[trainer]` line (a step, an
    eval, the end), a checkpoint or a stop as a line of its own, anything else as it is. A rank's
    `[rankN]: ` lead is kept."""
    lead, doc = _json_line(data)
    if doc is None:
        return data
    event = doc.get("event")
    if event in TWINNED or (event is None and "step" in doc and "loss" in doc):
        return None
    if event == "checkpoint":
        text = f"[trainer] checkpoint at step {doc.get('step')}: {doc.get('path')}"
    elif event == "stopped":
        text = f"[trainer] stopped at step {doc.get('step')}"
    elif event == "checksum":
        text = f"[trainer] the {doc.get('replicas')} replicas' weights agree at step {doc.get('step')}"
    else:
        return data
    return lead + text.encode() + b"\n"


def _coloured(line, data: bytes) -> bytes:
    """A line with a signature hit, in its severity's colour (the line ending left outside)."""
    if not line.hits:
        return data
    body = data.rstrip(b"\r\n")
    code = SEVERITY_COLOUR.get(line.hits[0].severity, b"1")
    return b"\x1b[" + code + b"m" + body + b"\x1b[0m" + data[len(body):]


def _prefixed(target: str, data: bytes) -> bytes:
    """`[rank1]: text` -> `[target/rank1] text`; any other line -> `[target] line`."""
    lead, body = _rank_lead(data)
    return b"[" + target.encode() + (b"/rank" + lead[5:-3] if lead else b"") + b"] " + body


def _job_summary_line(s) -> str:
    nodes = ", ".join(f"{t} {n['state']}" + (f" (exit {(n.get('exit') or {}).get('exit_code')})"
                                              if (n.get('exit') or {}).get('exit_code') not in (None, 0) else "")
                      for t, n in s.nodes.items())
    parts = [f"run {s.run}: {s.state} on {len(s.targets)} nodes ({nodes})", f"steps {fmt_num(s.step)}",
             f"last loss {fmt_num(s.loss)}", f"tau {fmt_tau(s.tau)}"]
    rc = s.root_cause
    if rc:
        where = f"{rc['target']}" + (f"/rank{rc['rank']}" if rc.get("rank") is not None else "")
        parts.append(f"first failure: {where}" + (f": {rc['error']}" if rc.get("error") else "")
                     + (f" (signature {rc['signature']})" if rc.get("signature") else ""))
    return "; ".join(parts)


def _reader_gone() -> None:
    """`logs | head`: the reader went away, which is not an error. Handled here because Click
    turns EPIPE into exit 1 before cli.main could map it; stdout goes to /dev/null so the
    interpreter's last flush stays quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(0)


def _summary_line(s) -> str:
    ex = s.exit or {}
    how = ""
    if s.state == "running":
        how = "still running"
    elif s.state == "unreadable":       # its records on the target cannot be used; the log was shown
        how = f"unreadable ({ex.get('reason')}; `dflash-ops rm {s.target} {s.run}` removes it)"
    elif ex.get("signal_name"):
        how = f"{s.state} ({ex['signal_name']})"
    elif ex.get("exit_code") is not None:
        how = f"{s.state} (exit {ex['exit_code']})"
    elif s.state == "lost":
        how = f"lost ({ex.get('reason')})"
    elif ex.get("lost"):
        how = f"{s.state} (lost: {ex.get('reason')})"
    else:
        how = s.state
    sigs = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in s.signatures.items()) or "none"
    if s.kind == "regen":       # the target's answers: rows, not steps, loss and tau
        parts = [f"{s.target}: regen run {s.run}: {how}", f"rows written {fmt_num(s.rows)}"]
    else:
        parts = [f"{s.target}: run {s.run}: {how}", f"steps {fmt_num(s.step)}", f"last loss {fmt_num(s.loss)}",
                 f"tau {fmt_tau(s.tau)}"]
    parts += [f"elapsed {fmt_elapsed(s.elapsed_s)}", f"signatures: {sigs}"]
    if s.classified and s.state == "failed":
        parts.append(f"cause: {s.classified}")
    if s.outages:
        parts.append(f"connection lost {s.outages} time(s), {s.reconnects} reconnect attempt(s)")
    return "; ".join(parts)
