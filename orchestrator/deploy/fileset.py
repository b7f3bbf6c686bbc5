"""Which files a deploy ships. In a git checkout: what git tracks plus the untracked files
git does not ignore (`git ls-files --cached --others --exclude-standard`), so exports, run outputs
and venvs never ship; elsewhere the source tree less what `.gitignore` and `.git/info/exclude`
exclude (as SkyPilot and Ray do, docs/background.md#ops-conventions). Either way less what
`.dflashignore` excludes, and never `.git`, `.venv`, `__pycache__`, nor a folder the tool wrote (an
export, a built target, a run's output: known by its marker file, not by .gitignore). `all_files`: every file but
those (and `.dflashignore`'s).

The matcher implements gitignore's rules (negation, directory-only `dir/`, anchored `/x`,
`**`, per-directory files whose patterns are relative to their own folder) as pure functions.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import UsageError
from trainer.controller_view import output_kind   # torch-free

ALWAYS_EXCLUDED = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".hypothesis",
                   ".mypy_cache", ".ruff_cache", ".dflash-manifest.json", ".dflash-stat.json"}
IGNORE_FILES = (".gitignore", ".dflashignore")
MANIFEST_NAME = ".dflash-manifest.json"    # written into every release by the release agent


@dataclass(frozen=True)
class Rule:
    regex: re.Pattern
    negate: bool
    dir_only: bool
    base: str          # the folder (relative, '' for the root) the pattern file lives in


def compile_pattern(pattern: str, base: str = "") -> Rule | None:
    """One gitignore line -> a Rule, or None for blanks and comments."""
    line = pattern.rstrip("\n")
    if not line.strip() or line.startswith("#"):
        return None
    # Trailing spaces are ignored unless escaped.
    while line.endswith(" ") and not line.endswith("\\ "):
        line = line[:-1]
    negate = line.startswith("!")
    if negate:
        line = line[1:]
    if line.startswith("\\"):
        line = line[1:]
    dir_only = line.endswith("/")
    line = line.rstrip("/")
    anchored = "/" in line
    line = line.lstrip("/")
    regex = _translate(line)
    if not anchored:
        regex = "(?:.*/)?" + regex
    return Rule(re.compile("^" + regex + "$", re.DOTALL), negate, dir_only, base)


def _translate(glob: str) -> str:
    out, i, n = [], 0, len(glob)
    while i < n:
        c = glob[i]
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif glob.startswith("/**", i) and i + 3 == n:
            out.append("/.*")
            i += 3
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = glob.find("]", i + 1)
            if j == -1:
                out.append(re.escape(c))
                i += 1
            else:
                body = glob[i + 1:j].replace("\\", "\\\\")
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = j + 1
        elif c == "\\" and i + 1 < n:
            out.append(re.escape(glob[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def is_ignored(rel: str, is_dir: bool, rules: list[Rule]) -> bool:
    """gitignore semantics: the last matching rule wins."""
    ignored = False
    for rule in rules:
        if rule.dir_only and not is_dir:
            continue
        if rule.base:
            if not rel.startswith(rule.base + "/"):
                continue
            sub = rel[len(rule.base) + 1:]
        else:
            sub = rel
        if rule.regex.match(sub):
            ignored = not rule.negate
    return ignored


def _read_rules(path: Path, base: str) -> list[Rule]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [r for r in (compile_pattern(line, base) for line in text.splitlines()) if r]


class LinkError(UsageError):
    """A symlink in the source that cannot ship: it loops, dangles or leaves the tree."""


def _check_link(root: Path, path: Path, rel: str) -> bool:
    """For a symlink at rel: True when it ships (a link to a file inside the tree, sent as that
    file's content), False when it is skipped (a link to a folder inside the tree); raises
    LinkError for a link that loops, dangles or points outside the tree."""
    try:
        real = path.resolve(strict=True)
    except RuntimeError:             # Python < 3.13 reports a loop this way
        raise LinkError(f"{root / rel}: symlink loop; remove it or list it in .dflashignore") from None
    except OSError as e:
        what = "symlink loop" if e.errno == errno.ELOOP else f"broken symlink ({e.strerror})"
        raise LinkError(f"{root / rel}: {what}; remove it or list it in .dflashignore") from None
    if real != root and root not in real.parents:
        raise LinkError(f"{root / rel}: symlink points outside the source tree (to {real}); "
                        f"copy the file in, or list the link in .dflashignore")
    return real.is_file()


def collect(root: Path, all_files: bool = False) -> list[str]:
    """Relative POSIX paths of every file to ship, sorted (the module's docstring says which).
    Symlinks to files inside the tree are followed (the file's content ships); symlinked folders
    inside it are skipped; a link that leaves the tree, dangles or loops is an error naming it (it
    would ship someone else's files, or nothing)."""
    return without_outputs(root, collect_all(root, all_files))[0]


def collect_all(root: Path, all_files: bool = False) -> list[str]:
    """collect() before the tool's own outputs are left out."""
    root = root.resolve()
    listed = None if all_files else git_files(root)
    if listed:
        return _from_git(root, listed)
    return _walk(root, ("dflashignore",) if all_files else ("gitignore", "dflashignore"))


def without_outputs(root: Path, files: list[str]) -> tuple[list[str], dict[str, str]]:
    """(files less those inside a folder the tool wrote, {that folder: what it is}). An export, a
    built target or a training run's output never ships, wherever it lies and whatever .gitignore
    says: each is known by the marker file its writer leaves (trainer/owned.py), --all-files too."""
    kinds: dict[str, str | None] = {}

    def output(folder: str) -> str | None:
        if folder not in kinds:
            kinds[folder] = output_kind(root / folder) if folder else None
        return kinds[folder]

    kept, left = [], {}
    for rel in files:
        parts = rel.split("/")[:-1]
        hit = next((f for f in ("/".join(parts[:i + 1]) for i in range(len(parts))) if output(f)), None)
        if hit is None:
            kept.append(rel)
        else:
            left[hit] = output(hit) or ""
    return kept, left


def git_files(root: Path) -> list[str] | None:
    """What git tracks under root plus the untracked files it does not ignore, relative to root;
    None when root is not in a git work tree (or there is no git)."""
    try:
        r = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return sorted({p.decode("utf-8", "surrogateescape") for p in r.stdout.split(b"\0") if p})


def _from_git(root: Path, listed: list[str]) -> list[str]:
    """git's list less .dflashignore and the always-excluded names; deleted tracked files, nested
    repositories and links to folders left out, links checked as the walk checks them."""
    rules: dict[str, list[Rule]] = {}

    def rules_in(folder: str) -> list[Rule]:      # the .dflashignore rules that apply in folder
        if folder not in rules:
            parent = rules_in(folder.rpartition("/")[0]) if folder else []
            rules[folder] = parent + _read_rules(root / folder / ".dflashignore", folder)
        return rules[folder]

    files = []
    for rel in listed:
        parts = rel.rstrip("/").split("/")
        if rel.endswith("/") or any(p in ALWAYS_EXCLUDED for p in parts):
            continue
        if any(is_ignored("/".join(parts[:i + 1]), i < len(parts) - 1, rules_in("/".join(parts[:i])))
               for i in range(len(parts))):
            continue
        path = root / rel
        if path.is_symlink():
            if _check_link(root, path, rel):
                files.append(rel)
        elif path.is_file():
            files.append(rel)
    return sorted(files)


def _walk(root: Path, honour: tuple[str, ...]) -> list[str]:
    """The tree's files less what the ignore files named in `honour` (gitignore, dflashignore)
    exclude."""
    rules = _read_rules(root / ".git" / "info" / "exclude", "") if "gitignore" in honour else []
    names = tuple(n for n in IGNORE_FILES if n[1:] in honour)
    files: list[str] = []

    def walk(folder: Path, rel: str, rules: list[Rule]) -> None:
        for name in names:
            rules = rules + _read_rules(folder / name, rel)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            return
        for e in entries:
            if e.name in ALWAYS_EXCLUDED:
                continue
            child = f"{rel}/{e.name}" if rel else e.name
            is_dir = e.is_dir(follow_symlinks=False)
            if is_ignored(child, is_dir, rules):
                continue
            if e.is_symlink():
                if _check_link(root, Path(e.path), child):
                    files.append(child)
            elif is_dir:
                walk(Path(e.path), child, rules)
            elif e.is_file():
                files.append(child)

    walk(root, "", rules)
    return sorted(files)


RACY_NS = 2_000_000_000   # a cached hash is trusted only for a file whose mtime is older than the cache by this


def manifest(root: Path, files: list[str], cache: Path | None = None) -> dict[str, list]:
    """{path: [sha256, size, executable]} for the given files.

    cache: a JSON file of earlier hashes (hash_cache_path): a file whose size, mtime, ctime and inode
    are those recorded is not read again, as rsync's quick check skips a file of unchanged size and
    mtime (ctime and the inode besides: a `touch -r` or a file swapped in by rename still reads). Git's
    rule for racily clean entries applies: a hash is trusted only for a file whose mtime is older than
    the cache's own writing by RACY_NS, since a file written in the same tick as the cache could change
    again without its mtime moving. The cache is rewritten (atomically) when anything in it changed;
    a cache that cannot be read or written is simply not used. For a no-change deploy of a
    1,000-file tree it saves reading and hashing every file: the controller's largest CPU cost after
    its imports."""
    import json
    import time

    old: dict = {}
    written = 0
    if cache is not None:
        try:
            doc = json.loads(cache.read_text())
            old, written = doc["entries"], int(doc["written_ns"])
        except (OSError, ValueError, KeyError, TypeError):
            old = {}
    now = time.time_ns()
    out: dict[str, list] = {}
    entries: dict[str, list] = {}
    base, racy = str(root), False
    for rel in files:
        path = f"{base}/{rel}"
        st = os.stat(path)
        key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        hit: list = old.get(rel) or []
        fresh = hit[:4] == key
        if fresh and max(st.st_mtime_ns, st.st_ctime_ns) < written - RACY_NS:
            digest = hit[4]
        else:
            racy |= fresh       # unchanged, but too near the cache's writing: written again below
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            digest = h.hexdigest()
        entries[rel] = [*key, digest]
        out[rel] = [digest, st.st_size, bool(st.st_mode & 0o111)]
    if cache is not None and (racy or entries != old):
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
            tmp.write_text(json.dumps({"written_ns": now, "entries": entries}, separators=(",", ":")))
            os.replace(tmp, cache)
        except OSError:
            pass
    return out


def hash_cache_path(root: Path) -> Path:
    """Where manifest() keeps the hashes of the tree at root: $DFLASH_OPS_HOME/hash-cache/, one file per
    source folder (named by its resolved path's sha256)."""
    home = Path(os.environ.get("DFLASH_OPS_HOME", Path.home() / ".dflash-ops"))
    return home / "hash-cache" / (hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:24] + ".json")
