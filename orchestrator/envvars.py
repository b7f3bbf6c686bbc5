"""Environment variables given to the trainer and to every command on a target.

`pct exec --keep-env 0` leaves a container command only PATH and `container=lxc` (docs/background.md,
pct), so variables travel in the command itself, as `env K=V ... ARGV`: one more argv, quoted once
by transport.shell_join like every other. Where they come from, later wins: the host's `env:`,
the target's `env:` (hosts.yaml), `launch --env K=V`.
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping

from orchestrator.errors import UsageError
from orchestrator.remote.agent_base import MASKED as MASK   # stdlib only: the agents read run.json with it

NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A name containing one of these holds a credential: its value is never printed or recorded.
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "PASS", "CREDENTIAL", "AUTH", "PRIVATE")


def env_argv(env: Mapping[str, str] | None) -> list[str]:
    """`env K=V ...` to put before an argv; nothing when there is nothing to set."""
    if not env:
        return []
    return ["env", *(f"{k}={v}" for k, v in env.items())]


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(w in upper for w in SECRET_WORDS)


def masked(env: Mapping[str, str] | None) -> dict[str, str]:
    """The variables as they may be shown or recorded: secret-looking values replaced by ***."""
    return {k: (MASK if is_secret(k) else v) for k, v in (env or {}).items()}


def user_env(inv, target, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a command on `target` gets, as it may be shown: host env, target env, extra; masked."""
    host = inv.hosts[target.host].env if target.host else {}
    return masked({**host, **target.env, **(extra or {})})


def parse_assignments(items: Iterable[str], what: str = "--env") -> dict[str, str]:
    """`K=V` strings (repeatable option) -> {K: V}; a bad one is a UsageError naming it."""
    out: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not NAME_RE.match(name):
            raise UsageError(f"{what} {item!r}: expected NAME=VALUE, NAME made of letters, digits and _ "
                             f"(not first a digit)")
        if "\x00" in value:
            raise UsageError(f"{what} {name}: a value cannot contain a NUL byte")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:      # bytes the shell passed that are not UTF-8 (surrogate-escaped)
            raise UsageError(f"{what} {name}: the value is not UTF-8 text: {value!r}") from None
        out[name] = value
    return out
