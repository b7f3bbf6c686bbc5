"""The one seam through which bytes reach a target.

    LocalTransport          subprocess on this machine
    SshTransport            one paramiko connection to a host (jump hosts, known_hosts, keepalive)
    PctTransport(inner, v)  `pct exec V --keep-env 0 -- [env K=V..] ARGV` run through another transport
                            (ssh/pct.py: pct's argv, its refusals explained by `pct status`)
    EnvTransport(inner, e)  `env K=V.. ARGV` through another transport (a target without vmid)

Every transport runs an argv (or a bash script, `bash -c SOURCE`) with stdin streamed in, or held
open while the command runs (hold.Hold: EOF there tells the command its caller is gone), and stdout/stderr
streamed out separately, and returns the exit status. `shell_join` is the only place where a string
is quoted for a shell: ssh hands the remote user's shell one command line, pct and lxc-attach pass
argv straight through (docs/background.md, pct), so one quoting layer is all there is.
"""
from __future__ import annotations

import shlex
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import IO, Callable, Iterable, Mapping, Sequence, Union

from orchestrator.envvars import env_argv
from orchestrator.errors import SIGNAL_POLL_S, ConnectionLost, OpsError, join_thread
from orchestrator.inventory import Host, sshconfig
from orchestrator.ssh.connect import _reason, open_client, where
from orchestrator.ssh.hold import Hold, Sink

Stdin = Union[None, bytes, IO[bytes], Iterable[bytes], Hold]
CHUNK = 1 << 16
KEEPALIVE_S = 5          # as Ansible's proxmox_pct_remote does (docs/background.md, pct)


@dataclass(frozen=True)
class Result:
    """A command's exit status and the output kept: a stream given to a sink is not kept (b""); one
    kept under `run(keep=N)` is its first N bytes, and *_bytes counts all of it (None: not counted)."""
    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_bytes: int | None = None
    stderr_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def stdout_cut(self) -> bool:
        return self.stdout_bytes is not None and self.stdout_bytes > len(self.stdout)

    @property
    def stderr_cut(self) -> bool:
        return self.stderr_bytes is not None and self.stderr_bytes > len(self.stderr)


# --- pure functions (unit-tested) -----------------------------------------------------------

def shell_join(argv: Sequence[str]) -> str:
    """The one quoting function: argv -> a command line any POSIX shell splits back to argv."""
    if not argv:
        raise ValueError("empty command")
    for a in argv:
        if "\x00" in a:
            raise ValueError("a command argument cannot contain a NUL byte")
    return " ".join(shlex.quote(a) for a in argv)


def bash_argv(script: str) -> list[str]:
    return ["bash", "-c", script]


def reporting_signals(argv: Sequence[str]) -> list[str]:
    """argv run by a shell that exits 128+N when the command is killed by signal N, as a local
    subprocess (LocalTransport) and lxc-attach in a container report it: sshd reports such a death
    as an exit-signal, which paramiko drops (the status would read as 255). The command runs in a
    subshell (that execs it) and `; exit $?` follows, so the shell waits rather than exec'ing the
    command in its place. The shell's own stderr is /dev/null (the command gets the channel's, kept on
    fd 3): its words about the death (`Killed`) are not the command's output, and a pct target, where
    lxc-attach reports the status, has none."""
    return ["sh", "-c", 'exec 3>&2 2>/dev/null; (exec "$@" 2>&3 3>&-); exit $?', "sh", *argv]


# --- the seam -------------------------------------------------------------------------------

class Transport:
    description = "transport"

    def run(self, argv: Sequence[str], *, stdin: Stdin = None, stdout: Sink | None = None,
            stderr: Sink | None = None, timeout: float | None = None, keep: int | None = None) -> Result:
        """stdout / stderr: sinks the stream goes to as it comes; a stream without one is kept in the
        Result, all of it, or with `keep` its first `keep` bytes (the rest counted, not kept)."""
        raise NotImplementedError

    def script(self, source: str, **kw) -> Result:
        return self.run(bash_argv(source), **kw)

    def close(self) -> None:
        pass


def _wait(proc: subprocess.Popen, timeout: float | None) -> int:
    """proc.wait(timeout) in slices of SIGNAL_POLL_S: a transport's run() may be called from the main
    thread, which must still run the handler of a signal another thread took (errors.wait_for_event);
    subprocess.TimeoutExpired once `timeout` has passed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = SIGNAL_POLL_S if deadline is None else max(0.0, min(SIGNAL_POLL_S, deadline - time.monotonic()))
        try:
            return proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() >= deadline:
                raise


def _close(pipe) -> None:
    try:
        pipe.close()
    except OSError:     # BrokenPipeError: the command stopped reading
        pass


def _chunks(stdin: Stdin) -> Iterable[bytes]:
    if stdin is None or isinstance(stdin, Hold):   # a Hold is not sent: the transports keep it open
        return ()
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        data = bytes(stdin)
        return (data[i:i + CHUNK] for i in range(0, len(data), CHUNK))
    if hasattr(stdin, "read"):
        return iter(lambda: stdin.read(CHUNK), b"")
    return stdin


def _pump_both(sources, on_failure: Callable[[], None]):
    """One daemon thread per (recv, sink) pair, moving chunks until EOF. The first exception (a
    timeout, or a caller's sink raising) is kept and `on_failure()` stops the command, so the
    other stream ends too. Returns (threads, failures)."""
    failures: list[BaseException] = []

    def pump(recv, sink):
        try:
            for data in iter(lambda: recv(CHUNK), b""):
                sink(data)
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller after the join
            failures.append(e)
            on_failure()

    threads = [threading.Thread(target=pump, args=pair, daemon=True) for pair in sources]
    for t in threads:
        t.start()
    return threads, failures


class Kept:
    """A sink that keeps the first `limit` bytes of a stream (all of it for None; none for 0) and
    counts the whole (`total`); `cut`: some were not kept. Memory: `limit`; time: linear."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = self.total = 0

    def __call__(self, data: bytes) -> None:
        self.total += len(data)
        room = len(data) if self.limit is None else min(len(data), self.limit - self.size)
        if room > 0:
            self.parts.append(bytes(data[:room]) if room < len(data) else bytes(data))
            self.size += room

    @property
    def cut(self) -> bool:
        return self.total > self.size

    def value(self) -> bytes:
        if len(self.parts) > 1:         # joined once
            self.parts[:] = [b"".join(self.parts)]
        return self.parts[0] if self.parts else b""


class _Collector:
    """A sink that either forwards to the caller or keeps the bytes for the Result (all, or the
    first `keep`)."""

    def __init__(self, sink: Sink | None, keep: int | None = None):
        self.sink = sink
        self.kept = Kept(keep) if sink is None else None

    def __call__(self, data: bytes) -> None:
        if self.sink is not None:
            self.sink(data)
        elif self.kept is not None:
            self.kept(data)

    def value(self) -> bytes:
        return self.kept.value() if self.kept is not None else b""

    @property
    def total(self) -> int | None:
        return self.kept.total if self.kept is not None else None


class LocalTransport(Transport):
    description = "local"

    def run(self, argv, *, stdin=None, stdout=None, stderr=None, timeout=None, keep=None) -> Result:
        out, err = _Collector(stdout, keep), _Collector(stderr, keep)
        hold = stdin if isinstance(stdin, Hold) else None
        started: list[subprocess.Popen] = []

        def start() -> None:
            started.append(subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, bufsize=0))

        def send(data: bytes) -> None:      # Hold.end: the line, then EOF
            stdin_pipe = started[0].stdin
            assert stdin_pipe is not None
            try:
                stdin_pipe.write(data)
            finally:
                stdin_pipe.close()
        try:
            if hold is None:
                start()
            elif not hold.begin(start, send):
                raise OpsError("local: interrupted before the command started")
        except FileNotFoundError:
            return Result(127, b"", f"{argv[0]}: command not found\n".encode())
        except PermissionError:
            return Result(126, b"", f"{argv[0]}: permission denied\n".encode())
        proc = started[0]

        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None   # PIPE, all three
        pipe = proc.stdin
        # bufsize=0: raw pipes, whose read(n) returns what is there without waiting for n bytes.
        readers, failures = _pump_both([(proc.stdout.read, out), (proc.stderr.read, err)], proc.kill)
        try:
            try:
                for chunk in [hold.data] if hold is not None else _chunks(stdin):
                    pipe.write(chunk)
            except BrokenPipeError:
                pass  # the command stopped reading; its exit status says why
            except ValueError:      # closed: Hold.end (an interrupted caller) came first and told it to end
                if hold is None or hold.line is None:
                    raise
            finally:
                if hold is None:
                    _close(pipe)
            try:
                code = _wait(proc, timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise OpsError(f"local: {argv[0]} timed out after {timeout:.0f} s") from None
        except BaseException:
            if hold is not None:        # hang up: EOF, then a moment for the command to end
                hold.end("")
                deadline = time.monotonic() + hold.grace_s
                try:
                    proc.wait(timeout=hold.grace_s)
                except subprocess.TimeoutExpired:
                    pass
                for t in readers:       # its last words reach the sinks
                    t.join(max(0.0, deadline - time.monotonic()))
                hold.ended = proc.poll() is not None
            raise
        finally:
            if hold is not None:
                hold.done()
            _close(pipe)
        for t in readers:
            join_thread(t)
        if failures:
            raise failures[0]   # the caller's sink raised (e.g. its reader went away)
        if code < 0:          # match what a shell / lxc-attach reports: 128 + signal
            code = 128 - code
        return Result(code, out.value(), err.value(), out.total, err.total)


# paramiko is imported on first use, without `invoke` (sshconfig.paramiko says why).
_paramiko = sshconfig.paramiko


class SshTransport(Transport):
    """One paramiko connection to one host, reused for every command of a dflash-ops command."""

    def __init__(self, host: Host, *, sock=None, chain: Sequence[Host] = ()):
        """chain: the jump hosts crossed to reach `host` (outermost first), for the messages."""
        self.host = host
        self.description = where(host)
        client = open_client(host, chain, sock)
        self.client = client
        self.runs = 0            # commands run over this connection (round trips)
        self.transport = client.get_transport()
        self.transport.set_keepalive(KEEPALIVE_S)

    def open_tunnel(self, address: str, port: int):
        """A direct-tcpip channel to address:port, used as the socket of the next hop."""
        return self.transport.open_channel("direct-tcpip", (address, port), ("127.0.0.1", 0))

    def run(self, argv, *, stdin=None, stdout=None, stderr=None, timeout=None, keep=None) -> Result:
        line = shell_join(reporting_signals(argv))
        out, err = _Collector(stdout, keep), _Collector(stderr, keep)
        self.runs += 1
        try:
            chan = self.transport.open_session(timeout=self.host.connect_timeout)
        except Exception as e:  # paramiko raises SSHException/EOFError/OSError here
            raise ConnectionLost(self.host.name, f"cannot open a session: {_reason(e)}") from None
        if timeout is not None:
            chan.settimeout(timeout)
        hold = stdin if isinstance(stdin, Hold) else None

        def send(data: bytes) -> None:      # Hold.end: the line, then EOF
            chan.sendall(data)
            chan.shutdown_write()
        if hold is None:
            chan.exec_command(line)
        elif not hold.begin(lambda: chan.exec_command(line), send):
            chan.close()
            raise OpsError(f"{self.host.name}: interrupted before the command started")
        readers, failure = _pump_both([(chan.recv, out), (chan.recv_stderr, err)], chan.close)
        try:
            try:
                for chunk in [hold.data] if hold is not None else _chunks(stdin):
                    chan.sendall(chunk)
                if hold is None:
                    chan.shutdown_write()
            except (OSError, EOFError):
                pass  # remote stopped reading, or the connection broke: the checks below say which
            for t in readers:
                join_thread(t)
            if failure:
                exc = failure[0]
                if isinstance(exc, socket.timeout):
                    raise OpsError(f"{self.host.name}: {argv[0]} timed out after {timeout:.0f} s") from None
                raise exc
            if not chan.status_event.wait(timeout or 60) or not chan.exit_status_ready():
                raise ConnectionLost(self.host.name)
            code = chan.recv_exit_status()
        except BaseException as e:
            if hold is not None and not isinstance(e, OpsError):    # the caller's Ctrl-C / SIGTERM: hang up
                hold.ended = _hang_up(hold, chan, readers)
            chan.close()    # sshd closes the command's pipes: EOF on its stdin, EPIPE on its writes
            raise
        finally:
            if hold is not None:    # held until the exit status: a command may close its output first
                hold.done()
        chan.close()
        if code == -1:
            # No exit-status: the connection broke, or the shell of reporting_signals was killed
            # itself (sshd then sends exit-signal instead of exit-status).
            if not self.transport.is_active():
                raise ConnectionLost(self.host.name)
            code = 255
        return Result(code, out.value(), err.value(), out.total, err.total)

    def alive(self) -> bool:
        return self.transport is not None and self.transport.is_active()


    def close(self) -> None:
        self.client.close()


def _hang_up(hold: Hold, chan, readers: Sequence[threading.Thread]) -> bool:
    """EOF on a held stdin, then up to hold.grace_s for the command to end (its streams closed and its
    exit status in): whether it did."""
    if hold.end("") != Hold.RUNNING:
        return True     # it had ended, or never started
    deadline = time.monotonic() + hold.grace_s
    for t in readers:
        t.join(max(0.0, deadline - time.monotonic()))
    return chan.status_event.wait(max(0.0, deadline - time.monotonic()))


class EnvTransport(Transport):
    """Another transport whose commands run as `env K=V ... ARGV`: a target without vmid (the node
    itself, or this machine) gets its variables exactly as a container does."""

    def __init__(self, inner: Transport, env: Mapping[str, str]):
        self.inner, self.env = inner, dict(env)
        self.description = inner.description

    def run(self, argv, **kw) -> Result:
        return self.inner.run([*env_argv(self.env), *argv], **kw)

    def __getattr__(self, name):   # alive(), open_tunnel(), host ... of the wrapped transport
        return getattr(self.inner, name)
