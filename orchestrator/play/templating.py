r"""`{{ }}` templates of a playbook and the values of step options: pure functions (playbook.py
checks a file with them, run.py renders each step with them on each target).

`{{ NAME }}` is a variable, `{{ steps.STEP.KEY... }}` a key of an earlier step's JSON result;
filters `| dirname`, `| basename`, `| words`. A string that is one template keeps the value's type;
in a shell script every value is inserted as literal text, quoted for where it lands (once, here:
shell_contexts): unquoted, one shell word (shlex.quote); inside "...", with \ " $ ` escaped; inside
'...', with each ' closed and reopened. Where no quoting is safe (a here-document, $'...') the
template is refused, with the safe way: the value through exec's `env:` and "$NAME" in the script.
"""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from orchestrator.errors import OpsError, UsageError
from orchestrator.inventory.yamlnodes import MAX_FLOAT, MAX_INT_DIGITS, MIN_FLOAT, float_in_range

FILTERS: dict[str, Callable[[Any], Any]] = {
    "dirname": lambda v: os.path.dirname(_text(v)),
    "basename": lambda v: os.path.basename(_text(v)),
    "words": lambda v: v if isinstance(v, list) else shlex.split(_text(v)),
}
TEMPLATE_RE = re.compile(r"\{\{(.*?)\}\}")
EXPR_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_-]+)*)\s*((?:\|\s*[a-z]+\s*)*)$")
ASSERT_TESTS = ("equals", "not_equals", "in", "less_than", "greater_than", "exists")

def _templated(value) -> bool:
    if isinstance(value, str):
        return "{{" in value
    if isinstance(value, list):
        return any(_templated(v) for v in value)
    if isinstance(value, dict):
        return any(_templated(v) for v in value.values())
    return False


def expressions(value) -> list[str]:
    """Every `{{ ... }}` expression in a value (strings, lists, mappings)."""
    if isinstance(value, str):
        return [m.group(1) for m in TEMPLATE_RE.finditer(value)]
    if isinstance(value, list):
        return [e for v in value for e in expressions(v)]
    if isinstance(value, dict):
        return [e for v in value.values() for e in expressions(v)]
    return []


def parse_expr(expr: str) -> tuple[list[str], list[str]]:
    """`steps.launch.run | basename` -> (['steps', 'launch', 'run'], ['basename']); ValueError if malformed."""
    m = EXPR_RE.match(expr)
    if not m:
        raise ValueError(f"{{{{{expr}}}}}: not a template (a name, `.key`s, `| filter`s)")
    filters = [f.strip() for f in m.group(2).split("|") if f.strip()]
    for f in filters:
        if f not in FILTERS:
            raise ValueError(f"{{{{{expr}}}}}: unknown filter {f!r} (filters: {', '.join(FILTERS)})")
    return m.group(1).split("."), filters



class Missing(OpsError):
    """A template names a step result that this play does not have (exit 1)."""


def _walk(value, keys: list[str]) -> tuple[Any, int | None]:
    """(the value at the dotted keys, None), or (None, index of the first key that is not there):
    a key of a mapping, or an index of a list."""
    for i, key in enumerate(keys):
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return None, i
    return value, None


@dataclass
class Context:
    """What templates see on one target: variables (rendered on use) and earlier steps' results."""
    variables: Mapping[str, Any]
    results: dict[str, Any] = field(default_factory=dict)
    preview: bool = False      # --dry-run: a result not there yet reads as <steps.NAME.KEY>
    _stack: tuple = ()

    def lookup(self, path: list[str]):
        if path[0] == "steps":
            if path[1] not in self.results and self.preview:
                return f"<{'.'.join(path)}>"
            if path[1] not in self.results:
                raise Missing(f"{{{{ steps.{'.'.join(path[1:])} }}}}: step {path[1]!r} has no result here "
                              f"(it did not run in this play, nor in an earlier play of this playbook on this target)")
            value, missing = _walk(self.results[path[1]], path[2:])
            if missing is not None:
                raise Missing(f"{{{{ steps.{'.'.join(path[1:])} }}}}: step {path[1]!r}'s result has no "
                              f"{'.'.join(path[2:missing + 3])!r}")
            return value
        name = path[0]
        if name in self._stack:
            raise UsageError(f"variable {name!r} refers to itself ({' -> '.join(self._stack + (name,))})")
        value = self.variables.get(name)
        inner = Context(self.variables, self.results, self.preview, self._stack + (name,))
        return render(value, inner) if isinstance(value, str) else value


def render(value, ctx: Context, *, shell: bool = False):
    """The value with its templates filled in (see the module's docstring)."""
    if isinstance(value, list):
        out = []
        for v in value:
            r = render(v, ctx, shell=shell)
            if isinstance(v, str) and _whole(v) and isinstance(r, list):
                out.extend(r)        # `- "{{ args | words }}"` splices its words
            else:
                out.append(r)
        return out
    if isinstance(value, dict):
        return {k: render(v, ctx, shell=shell) for k, v in value.items()}
    if not isinstance(value, str) or "{{" not in value:
        return value
    if _whole(value) and not shell:
        whole = TEMPLATE_RE.fullmatch(value.strip())
        assert whole is not None        # _whole(value)
        return _evaluate(whole.group(1), ctx)

    where = iter(shell_contexts(value)) if shell else None

    def fill(m) -> str:
        v = _evaluate(m.group(1), ctx)
        words = [_text(w) for w in v] if isinstance(v, list) else [_text(v)]
        if where is None:
            return " ".join(words)
        quote = _QUOTES[next(where)]
        return " ".join(quote(w) for w in words)
    return TEMPLATE_RE.sub(fill, value)


_QUOTES: dict[str, Callable[[str], str]] = {
    "plain": shlex.quote,
    "double": lambda w: re.sub(r'([\\"$`])', r"\\\1", w),     # the four characters "..." still expands
    "single": lambda w: w.replace("'", "'\\''"),               # '...' ends, \' is a quote, '...' again
    "comment": lambda w: w.replace("\n", " "),                  # a newline would end the comment
}


def shell_contexts(script: str) -> list[str]:
    """Where each {{ }} template of a bash script lands: "plain" (a word of its own or part of one),
    "double" (inside "..."), "single" (inside '...'), "comment" (after #, to the line's end). A
    UsageError for a template inside a here-document (after <<: its body expands $(...) whatever
    quotes it holds) or $'...' (where a backslash escapes): no quoting of the value is safe there.
    A scan of the quoting bash does: backslashes, quotes, comments, and $( ) nesting (a new quoting
    level inside "...")."""
    out: list[str] = []
    stack = ["plain"]           # the innermost quoting context last; $( ) pushes a new plain one
    heredoc, i, n = False, 0, len(script)
    refuse = ("{{{{ }}}} inside {} cannot be quoted safely; pass the value as exec's `env:` "
              "(env: {{NAME: \"{{{{ value }}}}\"}}) and write \"$NAME\" in the script")
    while i < n:
        state, c = stack[-1], script[i]
        if script.startswith("{{", i):
            end = script.find("}}", i)
            end = n if end < 0 else end + 2
            if heredoc:
                raise UsageError(refuse.format("a here-document"))
            if state == "ansi":
                raise UsageError(refuse.format("$'...'"))
            out.append(state)
            i = end
            continue
        if state == "single":
            if c == "'":
                stack.pop()
        elif state == "ansi":
            if c == "\\":
                i += 1
            elif c == "'":
                stack.pop()
        elif state == "comment":
            if c == "\n":
                stack.pop()
        elif c == "\\":
            i += 1                                  # the next character is literal
        elif state == "double":
            if c == '"':
                stack.pop()
            elif script.startswith("$(", i):
                stack.append("plain")
                i += 1
        else:                                       # plain
            if c == "'":
                stack.append("single")
            elif c == '"':
                stack.append("double")
            elif script.startswith("$'", i):
                stack.append("ansi")
                i += 1
            elif script.startswith("$(", i):
                stack.append("plain")
                i += 1
            elif c == ")" and len(stack) > 1:
                stack.pop()
            elif c == "#" and (i == 0 or script[i - 1] in " \t\n;&|("):
                stack.append("comment")
            elif script.startswith("<<", i) and not script.startswith("<<<", i):
                heredoc = True
                i += 1
        i += 1
    return out


def _whole(value: str) -> bool:
    m = TEMPLATE_RE.fullmatch(value.strip())
    return m is not None and "{{" not in m.group(1)


def _evaluate(expr: str, ctx: Context):
    path, filters = parse_expr(expr)
    value = ctx.lookup(path)
    for f in filters:
        value = FILTERS[f](value)
    return value


def _text(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


# --- option values ----------------------------------------------------------------------------

def convert(kind, value):
    """A rendered option value as its kind wants it; ValueError saying what was expected."""
    if isinstance(kind, tuple):
        if value not in kind:
            raise ValueError(f"expected one of {', '.join(kind)}, got {value!r}")
        return value
    if kind == "any":
        return value
    if kind in ("str", "shell"):
        if isinstance(value, (list, dict)) or value is None:
            raise ValueError(f"expected a string, got {_kind(value)}")
        return _text(value)
    if kind == "int":     # the file's own bounds (yamlnodes) hold for a value from --var too
        text = value.strip() if isinstance(value, str) else value
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not re.fullmatch(r"\d+", str(text)):
            raise ValueError(f"expected a whole number, got {_short(value)}")
        if len(str(text)) > MAX_INT_DIGITS:
            raise ValueError(f"a whole number of {len(str(text))} digits (at most {MAX_INT_DIGITS})")
        return int(text)
    if kind == "num":
        try:
            if isinstance(value, bool) or isinstance(value, str) and len(value) > 64:
                raise ValueError
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {_short(value)}") from None
        if not float_in_range(number):
            raise ValueError(f"{_short(value)}: a number is 0 or between {MIN_FLOAT:g} and {MAX_FLOAT:g} in size "
                             "(not inf, not nan)")
        return number
    if kind == "bool":
        words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
        if isinstance(value, bool):
            return value
        if _text(value).lower() in words:
            return words[_text(value).lower()]
        raise ValueError(f"expected true or false, got {value!r}")
    if kind == "list":
        if isinstance(value, str):   # one word: `state: succeeded`, `policies: eager`
            return [value] if value else []
        if not isinstance(value, list) or any(isinstance(v, (list, dict)) or v is None for v in value):
            raise ValueError(f"expected a list of words, got {_kind(value)}")
        return [_text(v) for v in value]
    if kind == "map":
        if not isinstance(value, dict) or any(isinstance(v, (list, dict)) for v in value.values()):
            raise ValueError(f"expected a mapping of names to values, got {_kind(value)}")
        return {str(k): _text(v) for k, v in value.items()}
    if kind == "argv":
        if not isinstance(value, list):
            raise ValueError(f"expected a list (an argv: [nvidia-smi, -L]); a command line is `shell:`, got {value!r}")
        return convert("list", value)
    if kind == "cmd":
        if isinstance(value, str):
            return value                 # a bash script
        return convert("list", value)    # an argv
    raise AssertionError(kind)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:27] + "..." + text[-10:]


def _kind(value) -> str:
    return {list: "a list", dict: "a mapping", type(None): "nothing"}.get(type(value), f"{value!r}")


def check_assert(options: Mapping[str, Any], result) -> tuple[bool, str]:
    """(passed, what was checked): `that` (a dotted key) of a step's result against one test."""
    that = str(options["that"])
    value, missing = _walk(result, that.split(".") if that else [])
    found = missing is None
    test = next(t for t in ASSERT_TESTS if t in options)
    want = options[test]
    if test == "exists":
        ok = found == convert("bool", want)
        return ok, f"{that} {'exists' if found else 'does not exist'}"
    if not found:
        return False, f"{options['step']} has no {that!r}"
    if test == "equals":
        ok = _same(value, want)
    elif test == "not_equals":
        ok = not _same(value, want)
    elif test == "in":
        ok = any(_same(value, w) for w in (want if isinstance(want, list) else [want]))
    else:
        try:
            number, limit = float(value), convert("num", want)
        except (TypeError, ValueError):
            return False, f"{that} is {value!r}, not a number"
        ok = number < limit if test == "less_than" else number > limit
    return ok, f"{that} = {value!r} ({test.replace('_', ' ')} {want!r})"


def _same(a, b) -> bool:
    """Equal, or equal as text (`--var` values are strings: 4 and "4" are the same)."""
    return a == b or (not isinstance(a, (list, dict)) and not isinstance(b, (list, dict)) and _text(a) == _text(b))
