"""A playbook: a YAML file of named steps, each one dflash-ops action with its options, run in
order on every target (play.py runs it). Loaded and checked here, before anything connects:
every mistake is one line `FILE:LINE: KEY: message`, exit 2, as for hosts.yaml (yamlnodes.py).

    description: deploy, probe, train, export
    vars:                       # defaults; null = required (--var NAME=VALUE)
      config: trainer/demo.yaml
    steps:
      - name: deploy
        deploy: {source: .}
      - name: launch
        launch: {config: "{{ config }}", gpus: "{{ gpus }}"}
      - name: follow
        logs: {run: "{{ steps.launch.run }}"}

Templates: `{{ NAME }}` is a variable: the file's `vars:`, then the target's inventory keys
(TARGET_KEYS), then `--var NAME=VALUE` (later wins); `{{ steps.STEP.KEY... }}` is a key of an
earlier step's JSON result. Filters: `| dirname`, `| basename`, `| words` (split into a list of
words). A string that is one template keeps the value's type (`gpus: "{{ gpus }}"` is a number);
in a shell script (exec `shell:`, or a string `unless:`/`watch:`), every value is inserted as one
shell word, quoted. Pure functions only: no I/O but reading the file.
"""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from . import yamlnodes as yn
from .errors import FileError, OpsError, UsageError

TARGET_KEYS = ("target", "host", "vmid", "python", "workdir", "gpus")
BUILTINS = ("playbook_dir",)
FILTERS: dict[str, Callable[[Any], Any]] = {
    "dirname": lambda v: os.path.dirname(_text(v)),
    "basename": lambda v: os.path.basename(_text(v)),
    "words": lambda v: v if isinstance(v, list) else shlex.split(_text(v)),
}
STEP_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
TEMPLATE_RE = re.compile(r"\{\{(.*?)\}\}")
EXPR_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_-]+)*)\s*((?:\|\s*[a-z]+\s*)*)$")
RUN_STATES = ("running", "succeeded", "failed", "stopped", "ended")

# Option kinds: "str" "int" "num" "bool" "list" (of words; one word may be written alone) "argv"
# (a list, never one string) "map" (str -> str) "cmd" (an argv list, or a string run by bash -c)
# "shell" (a bash script) "any" (a plain value), or a tuple of the allowed words.
ACTIONS: dict[str, dict[str, Any]] = {
    "deploy": {"source": "str", "install_deps": "bool", "verify": "bool"},
    "probe": {"gpus": "int", "policies": "list", "topologies": "list", "case_timeout": "int", "reuse": "bool"},
    "launch": {"gpus": "int", "gpu_ids": "str", "name": "str", "config": "str",
               "topology": ("threads", "processes"), "policy": "str", "workers": "int", "env": "map",
               "args": "list"},
    "logs": {"run": "str"},
    "export": {"run": "str", "step": "int", "output": "str",
               "dtype": ("bfloat16", "float16", "float32"), "force": "bool"},
    "exec": {"command": "argv", "shell": "shell", "env": "map", "unless": "cmd", "watch": "cmd",
             "changes": "bool"},
    "wait-for": {"run": "str", "state": "list", "timeout": "num", "every": "num"},
    "assert": {"step": "str", "that": "str", "equals": "any", "not_equals": "any", "in": "any",
               "less_than": "num", "greater_than": "num", "exists": "bool", "message": "str"},
}
ASSERT_TESTS = ("equals", "not_equals", "in", "less_than", "greater_than", "exists")


@dataclass(frozen=True)
class Step:
    name: str
    action: str
    options: Mapping[str, Any]         # as written (templates unrendered)
    line: int
    lines: Mapping[str, int] = field(default_factory=dict)   # option -> its line

    def where(self, index: int, option: str | None = None) -> str:
        base = f"steps[{index}].{self.action}" if option else f"steps[{index}]"
        return f"{base}.{option}" if option else base


@dataclass(frozen=True)
class Playbook:
    path: str
    steps: tuple[Step, ...]
    vars: Mapping[str, Any]            # the file's defaults (None: required)
    description: str | None = None

    def index(self, name: str) -> int:
        for i, s in enumerate(self.steps):
            if s.name == name:
                return i
        raise UsageError(f"--from {name}: no such step in {self.path} "
                         f"(steps: {', '.join(s.name for s in self.steps)}){yn.did_you_mean(name, self.names)}")

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.steps]


# --- loading --------------------------------------------------------------------------------

def load(path: str, given: Mapping[str, str] | None = None) -> Playbook:
    return parse(yn.read_text(Path(path)), path, given)


def parse(text: str, file: str, given: Mapping[str, str] | None = None) -> Playbook:
    """The playbook, checked: keys, option types, step names, templates (every variable known,
    every `steps.X` an earlier step), required variables given. `given`: the --var values."""
    given = dict(given or {})
    root = yn.compose(text, file)
    if root is None:
        raise FileError(file, None, None, "empty playbook: it needs `steps:`")
    top = yn.mapping(root, file, "(top level)")
    for key, (_, kline) in top.items():
        if key not in ("description", "vars", "steps"):
            raise FileError(file, kline, key, f"unknown key{yn.did_you_mean(key, ('description', 'vars', 'steps'))}")
    if "steps" not in top:
        raise FileError(file, 1, "steps", "missing required key")
    description = yn.scalar(top["description"][0], str, file, "description") if "description" in top else None
    variables: dict[str, Any] = {}
    var_lines: dict[str, int] = {}
    if "vars" in top and not _is_null(top["vars"][0]):
        for name, (vnode, vline) in yn.mapping(top["vars"][0], file, "vars").items():
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name) or name == "steps":
                raise FileError(file, vline, f"vars.{name}", "not a variable name (letters, digits and _)")
            if name in BUILTINS:
                raise FileError(file, vline, f"vars.{name}", "is set by dflash-ops; choose another name")
            variables[name] = None if _is_null(vnode) else yn.scalar(vnode, (str, int, float, bool), file,
                                                                     f"vars.{name}")
            var_lines[name] = vline
    known = set(variables) | set(TARGET_KEYS) | set(BUILTINS)
    for name in given:
        if name not in known:
            raise UsageError(f"--var {name}: {file} has no variable {name!r}{yn.did_you_mean(name, known)} "
                             f"(its variables: {', '.join(sorted(set(variables) | set(TARGET_KEYS)))})")
    for name, value in variables.items():
        if value is None and name not in given:
            raise FileError(file, var_lines[name], f"vars.{name}",
                            f"required: pass --var {name}=VALUE (the comments in {file} say what it takes)")
        _check_templates(value, known, set(), file, var_lines[name], f"vars.{name}")

    steps: list[Step] = []
    items = yn.sequence(top["steps"][0], file, "steps")
    if not items:
        raise FileError(file, top["steps"][1], "steps", "no steps")
    for i, snode in enumerate(items):
        step = _step(snode, i, file, steps)
        for opt, value in step.options.items():
            _check_templates(value, known, {s.name for s in steps}, file, step.lines[opt], step.where(i, opt))
        steps.append(step)
    return Playbook(path=file, steps=tuple(steps), vars=variables, description=description)


def _is_null(node) -> bool:
    return node.tag == "tag:yaml.org,2002:null"


def _step(node, i: int, file: str, earlier: list[Step]) -> Step:
    where = f"steps[{i}]"
    items = yn.mapping(node, file, where)
    if "name" not in items:
        raise FileError(file, yn.line(node), f"{where}.name", "missing required key")
    name = yn.scalar(items["name"][0], str, file, f"{where}.name")
    if not STEP_NAME_RE.match(name):
        raise FileError(file, items["name"][1], f"{where}.name",
                        f"{name!r}: a step name is letters, digits, _ and - (it is used in {{{{ steps.NAME }}}})")
    for s in earlier:
        if s.name == name:
            raise FileError(file, items["name"][1], f"{where}.name", f"duplicate step name (first on line {s.line})")
    actions = [k for k in items if k != "name"]
    unknown = [k for k in actions if k not in ACTIONS]
    if unknown:
        k = unknown[0]
        raise FileError(file, items[k][1], f"{where}.{k}",
                        f"unknown action{yn.did_you_mean(k, ACTIONS)} (actions: {', '.join(ACTIONS)})")
    if len(actions) != 1:
        raise FileError(file, yn.line(node), where,
                        "a step is one action: " + (f"it has {', '.join(actions)}" if actions else
                                                    f"add one of {', '.join(ACTIONS)}"))
    action = actions[0]
    anode, aline = items[action]
    options: dict[str, Any] = {}
    lines: dict[str, int] = {}
    schema = ACTIONS[action]
    if not _is_null(anode):
        for opt, (onode, oline) in yn.mapping(anode, file, f"{where}.{action}").items():
            key = f"{where}.{action}.{opt}"
            if opt not in schema:
                raise FileError(file, oline, key, f"unknown option{yn.did_you_mean(opt, schema)} "
                                                  f"(options of {action}: {', '.join(schema)})")
            value = yn.construct(onode)
            if not _templated(value):
                try:
                    convert(schema[opt], value)
                except ValueError as e:
                    raise FileError(file, oline, key, str(e)) from None
            options[opt], lines[opt] = value, oline
    step = Step(name=name, action=action, options=options, line=items["name"][1], lines=lines)
    _check_step(step, i, file, aline, earlier)
    return step


def _check_step(step: Step, i: int, file: str, aline: int, earlier: list[Step]) -> None:
    """What one option alone cannot say: exec's command xor shell, assert's step and one test."""
    o, where = step.options, f"steps[{i}].{step.action}"
    if step.action == "exec" and ("command" in o) == ("shell" in o):
        raise FileError(file, aline, where, "give `command:` (an argv list) or `shell:` (a bash script), one of them")
    if step.action == "assert":
        if "step" not in o or "that" not in o:
            raise FileError(file, aline, where, "needs `step:` (an earlier step) and `that:` (a key of its result)")
        if o["step"] not in {s.name for s in earlier}:
            raise FileError(file, step.lines["step"], f"{where}.step",
                            f"{o['step']!r} is not an earlier step{yn.did_you_mean(str(o['step']), [s.name for s in earlier])}")
        tests = [t for t in ASSERT_TESTS if t in o]
        if len(tests) != 1:
            raise FileError(file, aline, where, f"needs exactly one test of {', '.join(ASSERT_TESTS)}")
    if step.action == "wait-for":
        for state in convert("list", o.get("state", ["succeeded"])) if not _templated(o.get("state")) else []:
            if state not in RUN_STATES:
                raise FileError(file, step.lines["state"], f"{where}.state",
                                f"{state!r} is not a run state ({', '.join(RUN_STATES)})")


# --- templates ------------------------------------------------------------------------------

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


def _check_templates(value, known: set[str], steps: set[str], file: str, line: int, where: str) -> None:
    for expr in expressions(value):
        try:
            path, _ = parse_expr(expr)
        except ValueError as e:
            raise FileError(file, line, where, str(e)) from None
        if path[0] == "steps":
            if len(path) < 2 or path[1] not in steps:
                name = path[1] if len(path) > 1 else ""
                raise FileError(file, line, where, f"{{{{ {'.'.join(path)} }}}}: {name!r} is not an earlier step"
                                                   f"{yn.did_you_mean(name, steps)}")
        elif path[0] not in known:
            raise FileError(file, line, where, f"unknown variable {path[0]!r}{yn.did_you_mean(path[0], known)}")
        elif len(path) > 1:
            raise FileError(file, line, where, f"{{{{ {'.'.join(path)} }}}}: a variable has no keys")


class Missing(OpsError):
    """A template names a step result that this play does not have (exit 1)."""


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
            value = self.results[path[1]]
            for i, key in enumerate(path[2:], 2):
                if isinstance(value, dict) and key in value:
                    value = value[key]
                elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
                    value = value[int(key)]
                else:
                    raise Missing(f"{{{{ steps.{'.'.join(path[1:])} }}}}: step {path[1]!r}'s result has no "
                                  f"{'.'.join(path[2:i + 1])!r}")
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
        return _evaluate(TEMPLATE_RE.fullmatch(value.strip()).group(1), ctx)

    def fill(m) -> str:
        v = _evaluate(m.group(1), ctx)
        if isinstance(v, list):
            return " ".join(shlex.quote(_text(w)) if shell else _text(w) for w in v)
        return shlex.quote(_text(v)) if shell else _text(v)
    return TEMPLATE_RE.sub(fill, value)


def _whole(value: str) -> bool:
    m = TEMPLATE_RE.fullmatch(value.strip())
    return bool(m) and "{{" not in m.group(1)


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
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, (int, str)) or not re.match(r"^\s*\d+\s*$", str(value)):
            raise ValueError(f"expected a whole number, got {value!r}")
        return int(value)
    if kind == "num":
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {value!r}") from None
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


def _kind(value) -> str:
    return {list: "a list", dict: "a mapping", type(None): "nothing"}.get(type(value), f"{value!r}")


def check_assert(options: Mapping[str, Any], result) -> tuple[bool, str]:
    """(passed, what was checked): `that` (a dotted key) of a step's result against one test."""
    that = str(options["that"])
    value, found = result, True
    for key in that.split(".") if that else []:
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            found, value = False, None
            break
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
