"""Commands in a Proxmox container: `pct exec VMID --keep-env 0 -- ARGV` through another transport
(PctTransport), pct's argv, and what pct's refusals and a container gone down under a command mean
(`pct status`, asked on the node in the same round trip). docs/containers.md has pct's semantics.
"""
from __future__ import annotations

import re
import time
from typing import Mapping, Sequence

from orchestrator.envvars import env_argv
from orchestrator.errors import ContainerError
from orchestrator.ssh.transport import Kept, Result, Transport


def pct_exec_argv(pct: str, vmid: int, argv: Sequence[str], *, sudo: bool,
                  env: Mapping[str, str] | None = None) -> list[str]:
    """`pct exec VMID --keep-env 0 -- [env K=V...] ARGV`: the `--` is mandatory (pct parses options
    over the whole list), `--keep-env 0` keeps the node's SSH environment out (it still defaults
    to 1), so the variables the inventory asks for are set in the command itself."""
    head = ["sudo", "-n"] if sudo else []
    return [*head, pct, "exec", str(vmid), "--keep-env", "0", "--", *env_argv(env), *argv]


def pct_status_argv(pct: str, vmid: int, *, sudo: bool) -> list[str]:
    return [*(["sudo", "-n"] if sudo else []), pct, "status", str(vmid)]


# What a node may print around pct's own words: pct is Perl, and a locale the node lacks (often
# LANG/LC_* sent by the SSH client) makes perl warn on stderr before anything else.
_NOISE = re.compile(r"^(perl: warning: .*|\s+(LANGUAGE|LC_ALL|LC_\w+|LANG) = .*|\s+are supported and installed "
                    r"on your system\.|perl: warning: Falling back to .*|locale: Cannot set .*|"
                    r"bash: warning: setlocale: .*|-bash: warning: setlocale: .*)$")


def node_noise_removed(text: str) -> str:
    """`text` less the node's locale warnings, which are never the answer to what was asked."""
    return "\n".join(line for line in text.splitlines() if not _NOISE.match(line))


STATUS_MARK = "dflash-ops pct-status:"
# Runs on the node: the exec, and only when it exits 255 (pct's own refusal, or the command's own
# status) -- or 1 under `sudo -n` (a password wanted), or 137 / 143 (lxc-attach's 128 + SIGKILL /
# SIGTERM: the container may have been stopped or shut down under the command, every process of it
# killed) -- `pct status` to tell which. The common case costs no extra pct start (a Perl program
# that takes a good part of a second on a node). After a 137, pct may still say running for a moment:
# a hard stop kills the container's processes first and closes its command socket (pct's "running",
# docs/containers.md) only once LXC has cleaned up, so it asks again, up to WENT_DOWN_CHECKS times
# 0.5 s apart. The mark line carries pct status's exit, the command's and pct's words.
WENT_DOWN_CHECKS = 5
_CHECKED = (
    's=$1 p=$2 v=$3; shift 3\n'
    '"$@"\n'
    'rc=$?\n'
    'case "$s:$rc" in *:255|*:137|*:143|1:1) ;; *) exit "$rc";; esac\n'
    'n=1\n'
    'while :; do\n'
    '  if [ "$s" = 1 ]; then out=$(sudo -n "$p" status "$v" 2>&1); else out=$("$p" status "$v" 2>&1); fi\n'
    '  src=$?\n'
    '  case "$src:$out" in 0:*"status: running"*) ;; *) break;; esac\n'
    f'  [ "$rc" = 137 ] && [ "$n" -lt {WENT_DOWN_CHECKS} ] || exit "$rc"\n'
    '  n=$((n + 1)); sleep 0.5 2>/dev/null || sleep 1\n'
    'done\n'
    "printf '%s %s %s %s\\n' '" + STATUS_MARK + "' \"$src\" \"$rc\" \"$out\" >&2\n"
    'exit 255\n'
)


def pct_checked_argv(pct: str, vmid: int, argv: Sequence[str], *, sudo: bool,
                     env: Mapping[str, str] | None = None) -> list[str]:
    """`pct exec VMID --keep-env 0 -- ARGV`, explained by `pct status VMID` when pct refuses."""
    return ["sh", "-c", _CHECKED, "sh", "1" if sudo else "0", pct, str(vmid),
            *pct_exec_argv(pct, vmid, argv, sudo=sudo, env=env)]


class PctTransport(Transport):
    """Wraps another transport (usually ssh to the node): `pct exec VMID --keep-env 0 -- ...`.

    With `verify=True` the first command also checks `pct status` (same round trip), so a
    stopped or unknown container is a clear ContainerError rather than pct's bare 255."""

    def __init__(self, inner: Transport, vmid: int, *, pct: str = "/usr/sbin/pct", sudo: bool = False,
                 target: str = "", verify: bool = False, env: Mapping[str, str] | None = None):
        self.inner, self.vmid, self.pct, self.sudo = inner, vmid, pct, sudo
        self.env = dict(env or {})
        self.target = target or str(vmid)
        self.description = f"{inner.description} pct {vmid}"
        self._verify = verify

    def _container_error(self, code: int, text: str, rc: int = 255) -> ContainerError:
        """pct status's answer (exit `code`, `text`) as the error; `rc`, the command's exit: 137 / 143
        when the container went down under it."""
        text = node_noise_removed(text).strip()
        if self.sudo and "password is required" in text:
            return ContainerError(self.target, self.vmid,
                                  f"`sudo -n {self.pct}` needs a password: allow it passwordless for this user")
        if code != 0:
            return ContainerError(self.target, self.vmid, text.splitlines()[-1] if text else
                                  f"pct status exited {code}")
        m = re.search(r"^status: (\S+)", text, re.M)
        state = m.group(1) if m else "unknown"
        if rc in (137, 143):
            said = (f"went down under the command (exit {rc}, killed by SIG{'KILL' if rc == 137 else 'TERM'}) "
                    f"and is {state}")
        else:
            said = f"is {state}, not running"
        return ContainerError(self.target, self.vmid, f"{said}; start it with `pct start {self.vmid}`", state=state,
                              under=rc if rc in (137, 143) else None)

    def check(self, rc: int = 255) -> None:
        """`pct status` on its own: a stopped or unknown container raises ContainerError (`rc`: the exit of
        a command that ended before, 137 / 143 when the container may have gone down under it)."""
        for n in range(1, WENT_DOWN_CHECKS + 1 if rc == 137 else 2):    # as _CHECKED asks after a 137
            if n > 1:
                time.sleep(0.5)
            r = self.inner.run(pct_status_argv(self.pct, self.vmid, sudo=self.sudo))
            text = (r.stdout + r.stderr).decode(errors="replace")
            if r.exit_code != 0 or "status: running" not in text:
                raise self._container_error(r.exit_code, text, rc)
        self._verify = False

    def run(self, argv, **kw) -> Result:
        if not self._verify:
            return self.inner.run(pct_exec_argv(self.pct, self.vmid, argv, sudo=self.sudo, env=self.env), **kw)
        sink = kw.get("stderr")
        mark = STATUS_MARK.encode()
        kept: list[bytes] = []   # all of stderr when the caller keeps it, else a tail to find the mark in
        head = Kept(kw.get("keep")) if sink is None and kw.get("keep") is not None else None

        def watch(data: bytes) -> None:
            kept.append(data)
            if head is not None:        # the caller keeps the first `keep` bytes: kept is a tail
                head(data)
                del kept[:-8]
            if sink is None:
                return
            del kept[:-8]
            if mark in data:           # printed last, on its own line: never the caller's business
                data = data[:data.index(mark)]
            if data:
                sink(data)

        kw["stderr"] = watch
        r = self.inner.run(pct_checked_argv(self.pct, self.vmid, argv, sudo=self.sudo, env=self.env), **kw)
        err = b"".join(kept)
        if r.exit_code == 255 and mark in err:
            code, _, rest = err[err.index(mark) + len(mark):].decode(errors="replace").strip().partition(" ")
            rc, _, text = rest.partition(" ")
            raise self._container_error(int(code) if code.isdigit() else 1, text, int(rc) if rc.isdigit() else 255)
        self._verify = False
        if sink is not None:
            return r
        if head is not None:
            return Result(r.exit_code, r.stdout, head.value(), r.stdout_bytes, head.total)
        return Result(r.exit_code, r.stdout, err, r.stdout_bytes, len(err))
