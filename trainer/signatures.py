"""Failure signatures: name a crash from the text it printed.

The catalog is data (`signatures.yaml` beside this file); this module loads and validates it and
matches text against it. Pure Python (stdlib + PyYAML), no torch: the same code names failures on the
target (probe cases, the trainer) and on the controller (`dflash-ops scan`, `logs`).

    catalog = load_catalog()                  # the bundled catalog, validated once
    catalog.match_line("RuntimeError: CUDA error: ...")        # -> Signature | None
    m = catalog.matcher()                     # streaming, for live logs
    for line in lines: for line_no, sig in m.feed(line): ...
    scan_text(text)                           # -> [(line_no, Signature)], 1-based line numbers
    classify(output_text, exit_code)          # -> "cudagraph-trees-tls" | ... | None

A pattern is either one regex searched in one line, or `{all: [regex, ...], within: N}`: every regex
matches some line of a window of N consecutive lines (a traceback's frame line, source line and
exception line). A multi-line signature is reported on the line that completes it.
"""
from __future__ import annotations

import re
import sys
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator

import yaml

DEFAULT_PATH = Path(__file__).with_name("signatures.yaml")
SEVERITIES = ("fatal", "warning")
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_REQUIRED = ("id", "severity", "patterns", "meaning", "remedy")
_OPTIONAL = ("torch", "generic", "exit_codes", "upstream")
_WINDOW_KEYS = ("all", "within")


class CatalogError(ValueError):
    """The catalog file is malformed; the message names the file, the line and the key."""


# -- versions ("torch versions affected", and the probe's build expectations) -----------------

_CLAUSE_RE = re.compile(r"^\s*(>=|<=|==|!=|>|<)?\s*(\d+(?:\.\d+)*)\s*$")


def version_tuple(version: str) -> tuple[int, ...]:
    """Leading numeric components: '2.13.0+cu130' -> (2, 13, 0); '2.14.0a0+git1' -> (2, 14, 0)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if not m:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def check_spec(spec: str) -> None:
    """Raise ValueError unless `spec` is 'any' or comma-joined clauses like '>=2.5,<2.13' / '13.0'."""
    if str(spec).strip() in ("any", "*", ""):
        return
    for clause in str(spec).split(","):
        if not _CLAUSE_RE.match(clause):
            raise ValueError(f"bad version clause {clause.strip()!r} in {spec!r} (want e.g. '>=2.5,<2.13')")


def version_in(version: str, spec: str) -> bool:
    """Does `version` satisfy `spec`? A bare version (no operator) matches as a prefix: '2.11' matches
    '2.11.0+cu130'. Components missing on one side count as 0 for the ordering operators."""
    check_spec(spec)
    if str(spec).strip() in ("any", "*", ""):
        return True
    have = version_tuple(version)
    for clause in str(spec).split(","):
        m = _CLAUSE_RE.match(clause)
        assert m is not None        # check_spec accepted it
        op, want_s = m.groups()
        want = tuple(int(p) for p in want_s.split("."))
        if op is None:
            if have[: len(want)] != want:
                return False
            continue
        n = max(len(have), len(want))
        a, b = have + (0,) * (n - len(have)), want + (0,) * (n - len(want))
        ok = {">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b, "==": a == b, "!=": a != b}[op]
        if not ok:
            return False
    return True


# -- the catalog ------------------------------------------------------------------------------

@dataclass(frozen=True)
class WindowPattern:
    """Every regex matches some line within `within` consecutive lines."""

    regexes: tuple[re.Pattern, ...]
    within: int


@dataclass(frozen=True)
class Signature:
    id: str
    severity: str  # "fatal" | "warning"
    meaning: str
    remedy: str
    torch: str = "any"
    generic: bool = False
    exit_codes: tuple[int, ...] = ()
    upstream: tuple[str, ...] = ()
    line_patterns: tuple[re.Pattern, ...] = ()
    window_patterns: tuple[WindowPattern, ...] = ()

    @property
    def fatal(self) -> bool:
        return self.severity == "fatal"

    def affects(self, torch_version: str) -> bool:
        return version_in(torch_version, self.torch)

    def as_dict(self) -> dict:
        return {"id": self.id, "severity": self.severity, "meaning": self.meaning,
                "remedy": self.remedy, "torch": self.torch, "generic": self.generic,
                "exit_codes": list(self.exit_codes), "upstream": list(self.upstream)}


@dataclass(frozen=True)
class Catalog:
    signatures: tuple[Signature, ...]
    source: str = "<catalog>"

    def __iter__(self) -> Iterator[Signature]:
        return iter(self.signatures)

    def __len__(self) -> int:
        return len(self.signatures)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(s.id for s in self.signatures)

    def get(self, sig_id: str) -> Signature:
        for s in self.signatures:
            if s.id == sig_id:
                return s
        raise KeyError(sig_id)

    def match_line(self, line: str) -> Signature | None:
        """The first signature (catalog order) whose single-line patterns match `line`.
        Multi-line patterns need context: use matcher() or scan_text()."""
        for sig in self.signatures:
            if any(r.search(line) for r in sig.line_patterns):
                return sig
        return None

    def matcher(self) -> "Matcher":
        return Matcher(self)

    def scan_lines(self, lines: Iterable[str]) -> Iterator[tuple[int, Signature]]:
        m = Matcher(self)
        for line in lines:
            yield from m.feed(line)

    def scan_text(self, text: str) -> list[tuple[int, Signature]]:
        return list(self.scan_lines(text.splitlines()))

    def classify(self, output_text: str, exit_code: int | None) -> str | None:
        """Name the failure in a process's output: of the fatal signatures found, the specific one
        listed first in the catalog (order is priority: a trees assertion over the segfault it
        leads to, a missing triton over the BackendCompilerFailed that wraps it), else the first
        generic one listed, else what the exit status alone says (-11/139 segfault, ...)."""
        found = {sig.id for _, sig in self.scan_text(output_text or "") if sig.fatal}
        for generic in (False, True):
            for sig in self.signatures:
                if sig.id in found and sig.generic == generic:
                    return sig.id
        if exit_code is not None:
            for sig in self.signatures:
                if exit_code in sig.exit_codes:
                    return sig.id
        return None


class Matcher:
    """Streaming matcher: feed lines one at a time (or raw chunks), get (line_no, Signature) back.

    At most one signature is reported per line (the first in catalog order). A multi-line pattern
    is reported on the line that completes it, then starts over, so one traceback counts once."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.line_no = 0
        self._partial = ""
        sigs = catalog.signatures
        # (literal, regex) pairs: `literal in line` is checked before the regex runs
        self._singles = [[(_required_literal(r), r) for r in s.line_patterns] for s in sigs]
        self._windows: list[tuple[int, WindowPattern, list[tuple[str | None, re.Pattern]], deque]] = [
            (i, wp, [(_required_literal(r), r) for r in wp.regexes], deque())
            for i, s in enumerate(sigs) for wp in s.window_patterns]
        lits = [lit for group in self._singles for lit, _ in group]
        lits += [lit for _, _, parts, _ in self._windows for lit, _ in parts]
        # when every regex has a literal, a line holding none of them matches nothing
        known = [lit for lit in lits if lit is not None]
        self._quick = tuple(set(known)) if len(known) == len(lits) else None

    def feed(self, line: str) -> list[tuple[int, Signature]]:
        """One line (a trailing newline is ignored). Returns [] or [(line_no, signature)]."""
        self.line_no += 1
        n, line = self.line_no, line.rstrip("\r\n")
        if self._quick is not None and not any(lit in line for lit in self._quick):
            return []        # most lines: nothing to match (windows prune by line number)
        hit_index: int | None = None
        for i, group in enumerate(self._singles):
            if any((lit is None or lit in line) and r.search(line) for lit, r in group):
                hit_index = i
                break
        # every window must see every line, even when a single-line pattern already hit;
        # a window is a deque of (line_no, frozenset(indexes of the regexes that line matched))
        for i, wp, parts_rx, window in self._windows:
            parts = frozenset(k for k, (lit, r) in enumerate(parts_rx)
                              if (lit is None or lit in line) and r.search(line))
            while window and window[0][0] <= n - wp.within:
                window.popleft()
            if parts:
                window.append((n, parts))
                seen = frozenset().union(*(p for _, p in window))
                if len(seen) == len(wp.regexes):
                    window.clear()
                    if hit_index is None or i < hit_index:
                        hit_index = i
        return [] if hit_index is None else [(n, self.catalog.signatures[hit_index])]

    def feed_text(self, chunk: str) -> list[tuple[int, Signature]]:
        """Raw output as it arrives (may end mid-line; the rest is kept for the next chunk)."""
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()
        out: list[tuple[int, Signature]] = []
        for line in lines:
            out.extend(self.feed(line))
        return out

    def close(self) -> list[tuple[int, Signature]]:
        """Flush a last line that had no newline."""
        if not self._partial:
            return []
        line, self._partial = self._partial, ""
        return self.feed(line)


@lru_cache(maxsize=1024)
def _required_literal(rx: re.Pattern) -> str | None:
    """The longest literal run every match of `rx` must contain, or None when unsure. Lets the
    matcher skip a regex with a plain substring test (most log lines match nothing)."""
    if rx.flags & re.IGNORECASE:
        return None
    if sys.version_info >= (3, 11):
        import re._parser as sre_parse
    else:                                       # pragma: no cover - 3.10
        import sre_parse
    try:
        items = list(sre_parse.parse(rx.pattern).data)   # its top-level items (iterating it gives the same)
    except Exception:  # noqa: BLE001 - any surprise: no shortcut, the regex still runs
        return None
    best, run = "", ""
    for op, arg in items + [(None, None)]:      # top level only: every item there is required
        if op is sre_parse.LITERAL and isinstance(arg, int):     # a LITERAL's arg: its code point
            run += chr(arg)
            continue
        best, run = max(best, run, key=len), ""
    return best if len(best) >= 3 else None


# -- loading and validation -------------------------------------------------------------------

class _LineDict(dict):
    line: int = 0


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> _LineDict:
    d = _LineDict(loader.construct_mapping(node, deep=True))
    d.line = node.start_mark.line + 1
    return d


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _compile(rx: object, err) -> re.Pattern:
    if not isinstance(rx, str) or not rx:
        raise err(f"pattern must be a non-empty string, got {rx!r}")
    try:
        return re.compile(rx)
    except re.error as e:
        raise err(f"bad regex {rx!r}: {e}") from None


def _parse_entry(entry: object, index: int, source: str) -> Signature:
    line = getattr(entry, "line", None)

    def err(message: str, key: str | None = None) -> CatalogError:
        where = f"{source}:{line}" if line else source
        name = entry.get("id") if isinstance(entry, dict) else None
        who = f"signature {name!r}" if isinstance(name, str) else f"signature #{index + 1}"
        return CatalogError(f"{where}: {who}: {key + ': ' if key else ''}{message}")

    if not isinstance(entry, dict):
        raise err(f"must be a mapping, got {type(entry).__name__}")
    unknown = sorted(set(entry) - set(_REQUIRED) - set(_OPTIONAL), key=str)
    if unknown:
        raise err(f"unknown key(s) {', '.join(map(str, unknown))}; allowed: "
                  f"{', '.join(_REQUIRED + _OPTIONAL)}")
    for key in _REQUIRED:
        if key not in entry:
            raise err("missing", key)
    sid = entry["id"]
    if not isinstance(sid, str) or not _ID_RE.match(sid):
        raise err(f"must be lowercase letters, digits and dashes, got {sid!r}", "id")
    if entry["severity"] not in SEVERITIES:
        raise err(f"must be one of {', '.join(SEVERITIES)}, got {entry['severity']!r}", "severity")
    for key in ("meaning", "remedy"):
        if not isinstance(entry[key], str) or not entry[key].strip():
            raise err("must be a non-empty string", key)
    torch_spec = str(entry.get("torch", "any"))
    try:
        check_spec(torch_spec)
    except ValueError as e:
        raise err(str(e), "torch") from None
    generic = entry.get("generic", False)
    if not isinstance(generic, bool):
        raise err(f"must be true or false, got {generic!r}", "generic")
    codes = entry.get("exit_codes", [])
    if not isinstance(codes, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in codes):
        raise err(f"must be a list of integers, got {codes!r}", "exit_codes")
    upstream = entry.get("upstream", [])
    if not isinstance(upstream, list) or not all(isinstance(u, str) for u in upstream):
        raise err(f"must be a list of strings, got {upstream!r}", "upstream")

    patterns = entry["patterns"]
    if not isinstance(patterns, list) or not patterns:
        raise err("must be a non-empty list", "patterns")
    singles: list[re.Pattern] = []
    windows: list[WindowPattern] = []
    perr = lambda m: err(m, "patterns")  # noqa: E731
    for p in patterns:
        if isinstance(p, dict):
            extra = sorted(set(p) - set(_WINDOW_KEYS), key=str)
            if extra or "all" not in p or "within" not in p:
                raise perr(f"a multi-line pattern has exactly the keys all, within; got {sorted(p, key=str)}")
            if not isinstance(p["all"], list) or not p["all"]:
                raise perr("'all' must be a non-empty list of regexes")
            within = p["within"]
            if not isinstance(within, int) or isinstance(within, bool) or within < 1:
                raise perr(f"'within' must be a positive number of lines, got {within!r}")
            windows.append(WindowPattern(tuple(_compile(rx, perr) for rx in p["all"]), within))
        else:
            singles.append(_compile(p, perr))
    return Signature(
        id=sid, severity=entry["severity"], meaning=" ".join(entry["meaning"].split()),
        remedy=" ".join(entry["remedy"].split()), torch=torch_spec, generic=generic,
        exit_codes=tuple(codes), upstream=tuple(upstream),
        line_patterns=tuple(singles), window_patterns=tuple(windows))


def parse_catalog(text: str, source: str = "<string>") -> Catalog:
    """Validate catalog YAML text; raises CatalogError naming `source`, the line and the key."""
    try:
        doc = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise CatalogError(f"{source}: not valid YAML: {e}") from None
    if not isinstance(doc, dict) or set(doc) != {"signatures"}:
        keys = sorted(doc, key=str) if isinstance(doc, dict) else type(doc).__name__
        raise CatalogError(f"{source}: the top level must be a mapping with only the key "
                           f"'signatures', got {keys}")
    entries = doc["signatures"]
    if not isinstance(entries, list) or not entries:
        raise CatalogError(f"{source}: 'signatures' must be a non-empty list")
    sigs = [_parse_entry(e, i, source) for i, e in enumerate(entries)]
    seen: set[str] = set()
    for s in sigs:
        if s.id in seen:
            raise CatalogError(f"{source}: signature {s.id!r}: id: duplicate")
        seen.add(s.id)
    return Catalog(tuple(sigs), source)


@lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int) -> Catalog:
    with open(path, encoding="utf-8") as f:
        return parse_catalog(f.read(), path)


def load_catalog(path: str | Path | None = None) -> Catalog:
    """Load and validate a catalog (default: the bundled signatures.yaml). Cached per file version."""
    p = Path(path) if path is not None else DEFAULT_PATH
    try:
        mtime = p.stat().st_mtime_ns
    except OSError as e:
        raise CatalogError(f"{p}: cannot read the signature catalog: {e.strerror or e}") from None
    return _load_cached(str(p), mtime)


def scan_text(text: str, catalog: Catalog | None = None) -> list[tuple[int, Signature]]:
    return (catalog or load_catalog()).scan_text(text)


def classify(output_text: str, exit_code: int | None, catalog: Catalog | None = None) -> str | None:
    return (catalog or load_catalog()).classify(output_text, exit_code)
