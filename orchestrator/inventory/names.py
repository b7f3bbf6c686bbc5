"""What hosts.yaml's names and `workdir:` may be (pure; checked at load, docs/reliability.md, "Names" and "workdir").

Names of targets, hosts and groups are typed on command lines and joined with commas
(`launch ct1,ct2`), so they are letters, digits, `-`, `_` and `.`, start with a letter or a digit,
and never look like a run id (`logs NAME` must mean one thing). A workdir is where dflash-ops
creates `releases/`, `current` and `runs/`: an absolute, normalised path (or `~`, `~/...`: the
target user's home, resolved on the target, where the agents check the result again), never `/`,
a system folder or a path with `..` or control characters.
"""
from __future__ import annotations

import posixpath
import re
import unicodedata

# The folders a workdir may not be or be inside of: the agents' own lists (remote/agent_base.py, stdlib
# only and safe to import), so the controller and the target refuse the same ones.
from orchestrator.remote.agent_base import SYSTEM_ROOTS, SYSTEM_TREES

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
RUN_ID_RE = re.compile(r"^\d{8}-\d{6}-[0-9a-f]+$")     # launch.new_run_id: 20250101-120000-3fa9c1


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a target, host or group; None when it can."""
    if not NAME_RE.match(name):
        return ("names are 1-64 letters, digits, '-', '_' and '.', starting with a letter or a digit")
    if name == "latest" or RUN_ID_RE.match(name):
        return "looks like a run id (`logs NAME` would be ambiguous); use another name"
    return None


def control_characters(text: str) -> bool:
    """Whether `text` holds a control or format character (newline, tab, an RTL override...)."""
    return any(unicodedata.category(c).startswith("C") for c in text)


def workdir_problem(path: str) -> str | None:
    """Why `path` cannot be a workdir; None when it can (`~` forms: the part after `~`)."""
    if control_characters(path):
        return "contains a control character"
    if path == "~" or path.startswith("~/"):
        rest = path[1:] or "/"
        if _dotted(rest) or (rest != "/" and normalised(rest) != rest):
            return "must be normalised: no `.`, `..`, `//` or trailing / (write ~/NAME)"
        return None
    if path.startswith("~"):
        return "~ must be followed by / (~USER is not supported; the target user's home is ~)"
    if not path.startswith("/"):
        # A relative workdir would resolve against whatever folder the remote command starts in.
        return "must be an absolute path (or start with ~/)"
    # normalised first: `//etc`, `/usr/../etc` and `/etc/.` are /etc, a system folder like it
    if why := system_folder(normalised(path)):
        return why
    if _dotted(path) or normalised(path) != path:
        return f"must be normalised: no `.`, `..`, `//` or trailing / (as {normalised(path)!r})"
    return None


def normalised(path: str) -> str:
    """An absolute path as the kernel resolves it, symlinks aside: POSIX's normpath keeps a leading
    `//` (`//etc` stays `//etc`), which Linux reads as `/`."""
    return "/" + posixpath.normpath(path).lstrip("/")


def system_folder(path: str) -> str | None:
    """Why an absolute, normalised path is a system folder; None when it is not."""
    if path in SYSTEM_ROOTS:
        return f"{path} is a system folder; use a folder of its own (e.g. /root/dflash)"
    top = "/" + path.split("/")[1]
    if top in SYSTEM_TREES:
        return f"{top} is a system folder; use a folder of its own (e.g. /root/dflash)"
    return None


def _dotted(path: str) -> bool:
    return any(part in (".", "..") for part in path.split("/"))
