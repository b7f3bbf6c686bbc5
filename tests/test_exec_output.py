"""Output without bounds: `exec` (one target or several, --json or not) and a playbook's exec step keep
at most targets/exec.KEEP_BYTES of each stream per target and let the rest stream through, in memory
that does not grow with the output and time linear in it. Through the real sshd and the pct stand-in,
the CLI as a user runs it; the writers alone for what is counted exactly."""
import json
import os
import subprocess
import sys
import tracemalloc

import pytest

from orchestrator.lines import PIECE, LastLine, LineBuffer
from orchestrator.ssh.transport import Kept, LocalTransport
from orchestrator.targets.exec import KEEP_BYTES, LinePrefixer

MAIN = "from orchestrator.cli import main; main()"
MB = 1_000_000


# Started by a small launcher that forks the CLI itself: Linux carries a process's peak RSS across
# exec from the mm it replaces, so a CLI forked straight from this (torch-loaded, late in a suite) pytest
# process reported pytest's own size as its peak (906 MB in a full run where the CLI used ~60).
LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
_, status, usage = os.wait4(pid, 0)
os.write(2, ("%d %f %f" % (os.waitstatus_to_exitcode(status), usage.ru_maxrss / 1024,
                            usage.ru_utime + usage.ru_stime)).encode())
"""


def cli(path, *args, home, stdout=subprocess.PIPE, timeout=120):
    """The CLI's (exit status, stdout, peak RSS in MB of the CLI process, CPU seconds)."""
    proc = subprocess.Popen([sys.executable, "-S", "-c", LAUNCHER, "-c", MAIN, "-i", str(path), *map(str, args)],
                            stdout=stdout, stderr=subprocess.PIPE, env=dict(os.environ, DFLASH_OPS_HOME=str(home)))
    out = proc.stdout.read() if stdout is subprocess.PIPE else b""
    code, peak, cpu = proc.stderr.read().split()
    proc.wait(timeout=timeout)
    return int(code), out, float(peak), float(cpu)


def test_exec_json_keeps_the_first_mib_and_counts_the_rest_in_bounded_memory(exec_targets, tmp_path):
    # 60 MB of stdout without a newline, and some stderr: before, the controller held all of it, several
    # times over (5.9 GB peak for 300 MB); now its peak is the CLI's own plus a few MiB.
    _, _, idle, _ = cli(exec_targets, "exec", "ct200", "--json", "--", "true", home=tmp_path)
    code, out, peak, _ = cli(exec_targets, "exec", "ct200", "--json", "--", "sh", "-c",
                             f"head -c {60 * MB} /dev/zero; echo oops >&2; exit 3", home=tmp_path)
    assert code == 3
    doc = json.loads(out)["targets"]["ct200"]
    assert doc["exit_code"] == 3 and doc["ok"] is False
    assert doc["stdout_truncated"] is True and doc["stdout_bytes"] == 60 * MB
    assert doc["stdout"] == "\0" * KEEP_BYTES
    assert doc["stderr"] == "oops\n" and doc["stderr_bytes"] == 5 and doc["stderr_truncated"] is False
    assert len(out) < 8 * KEEP_BYTES                # \u0000 is 6 characters of JSON
    assert peak < idle + 60, (peak, idle)           # MB; output kept whole grew with it (benchmarks.md)


def test_several_targets_take_time_linear_in_their_output(exec_targets, tmp_path):
    # Lines without a newline through the `[target] ` writer: each chunk once re-joined and re-split the
    # line held so far, so the time grew with the square of the output (docs/benchmarks.md has the
    # figures). CPU seconds of the CLI, not wall time: two targets of N MB cost about twice one of N MB.
    n = 20 * MB
    cmd = ["--", "sh", "-c", f"head -c {n} /dev/zero"]
    _, _, _, base = cli(exec_targets, "exec", "ct200", "--", "true", home=tmp_path, stdout=subprocess.DEVNULL)
    code1, _, peak1, one = cli(exec_targets, "exec", "ct200", *cmd, home=tmp_path, stdout=subprocess.DEVNULL)
    code2, _, peak2, two = cli(exec_targets, "exec", "ct200", "ct201", *cmd, home=tmp_path, stdout=subprocess.DEVNULL)
    assert code1 == code2 == 0
    assert (two - base) < 4 * max(one - base, 0.2), (base, one, two)
    assert peak2 < peak1 + 30, (peak1, peak2)       # MB: nothing held per target but a piece of a line


def test_the_prefixed_output_is_the_output_in_pieces(exec_targets, tmp_path):
    out = tmp_path / "out"
    with open(out, "wb") as f:
        code, _, _, _ = cli(exec_targets, "exec", "ct200", "ct201", "--", "sh", "-c",
                            f"head -c {3 * PIECE + 5} /dev/zero | tr '\\0' a; echo; echo two; printf three",
                            home=tmp_path, stdout=f)
    assert code == 0
    lines = out.read_bytes().split(b"\n")
    assert lines[-1] == b""
    for t in ("ct200", "ct201"):
        mine = [line[len(t) + 3:] for line in lines if line.startswith(f"[{t}] ".encode())]
        assert mine == [b"a" * PIECE] * 3 + [b"a" * 5, b"two", b"three"]


def test_a_play_step_keeps_each_stream_once_and_bounded(exec_targets, tmp_path):
    book = tmp_path / "big.yaml"
    book.write_text("steps:\n"
                    "  - name: big\n"
                    f"    exec: {{shell: \"head -c {20 * MB} /dev/zero | tr '\\\\0' x; echo; echo last-line\"}}\n"
                    "  - name: wide\n"
                    f"    exec: {{shell: \"head -c {200_000} /dev/zero | tr '\\\\0' v\"}}\n"
                    "  - name: check\n"
                    "    assert: {step: big, that: value, equals: last-line}\n")
    code, out, peak, _ = cli(exec_targets, "play", book, "ct200", "--json", home=tmp_path)
    assert code == 0, out[-2000:]
    steps = {s["name"]: s["result"] for s in json.loads(out)["targets"]["ct200"]["steps"]}
    big, wide = steps["big"], steps["wide"]
    assert big["stdout_truncated"] is True and big["stdout_bytes"] == 20 * MB + len("\nlast-line\n")
    assert big["stdout"] == "x" * KEEP_BYTES and big["value"] == "last-line" and big["value_truncated"] is False
    assert wide["value_truncated"] is True and wide["value"] == "v" * (64 * 1024)
    assert wide["stdout"] == "v" * 200_000 and wide["stdout_truncated"] is False
    records = list((tmp_path / "plays").rglob("ct200.json"))
    assert len(records) == 1
    size = records[0].stat().st_size
    assert size < KEEP_BYTES + 200_000 + 64 * 1024 + 10_000, size     # each output once, bounded
    assert peak < 150, peak                          # MB (an 80 MB step: 510 MB before)


# --- the writers, counted ------------------------------------------------------------------------

def _feed(sink, total: int, chunk: int) -> None:
    piece = b"z" * chunk
    for _ in range(total // chunk):
        sink(piece)


@pytest.mark.parametrize("make", [
    lambda written: LinePrefixer(b"[ct200] ", lambda b: written.append(len(b))),
    lambda written: LineBuffer(lambda line: written.append(len(line)), limit=PIECE),
], ids=["prefixer", "linebuffer"])
@pytest.mark.timeout(120)       # the quadratic re-join of the line took minutes; a linear pass, a moment
def test_a_10_mb_line_without_newline_passes_in_bounded_memory_and_time(make):
    # 1 KiB chunks: holding the line and re-joining it each time moved ~50 GB (minutes); now each byte
    # is copied a bounded number of times and at most a piece is held. The peak proves the line is not
    # held (what made the re-joins grow); a piece is written as soon as it is whole, not at the end.
    written: list[int] = []
    sink = make(written)
    tracemalloc.start()
    try:
        _feed(sink, 2 * PIECE, 1024)
        assert len(written) >= 1                    # the first piece went out before the line's end
        _feed(sink, 10 * 1024 * 1024 - 2 * PIECE, 1024)
        sink.flush()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * PIECE, peak
    assert len(written) == 10 * 1024 * 1024 // PIECE and all(n <= PIECE + 16 for n in written)


def test_kept_and_last_line_hold_a_bounded_amount():
    kept, last = Kept(1000), LastLine(100)
    tracemalloc.start()
    try:
        for _ in range(2000):
            kept(b"y" * 4096)
            last(b"y" * 4096)
        last(b"\n  the end  \n\n")
        last.flush()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
    assert kept.value() == b"y" * 1000 and kept.total == 2000 * 4096 and kept.cut
    assert last.value == "the end" and not last.cut


def test_the_transport_keeps_what_it_is_asked_to_and_counts_the_rest():
    t = LocalTransport()
    r = t.run(["sh", "-c", "head -c 300000 /dev/zero; head -c 5000 /dev/zero >&2"], keep=1000)
    assert (r.stdout, r.stdout_bytes, r.stdout_cut) == (b"\0" * 1000, 300_000, True)
    assert (r.stderr, r.stderr_bytes, r.stderr_cut) == (b"\0" * 1000, 5000, True)
    whole = t.run(["sh", "-c", "head -c 300000 /dev/zero"])          # no keep: all of it, as before
    assert whole.stdout == b"\0" * 300_000 and not whole.stdout_cut


def test_a_held_command_told_to_end_before_its_data_went_is_ended_not_a_crash():
    """An interrupted exec's Hold.end can close the command's stdin between its start and the write of the
    Hold's data (the thread that runs it descheduled, seen under load): the command was told to end, and
    run() returns its status, where it raised `ValueError: I/O operation on closed file`."""
    from orchestrator.ssh.hold import Hold

    class EndedAtOnce(Hold):
        def begin(self, start, send):       # the caller's end() lands right after the start
            started = super().begin(start, send)
            self.end("TERM")
            return started

    r = LocalTransport().run(["cat"], stdin=EndedAtOnce(b"data"))
    assert (r.exit_code, r.stdout) == (0, b"TERM\n")
