"""A playbook: a YAML file of named steps, each one dflash-ops action with its options, run in
order on every target (run.py runs it). Loaded and checked here, before anything connects:
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

Templates (templating.py): `{{ NAME }}` is a variable: the file's `vars:`, then the target's
inventory keys (TARGET_KEYS), then `--var NAME=VALUE` (later wins); `{{ steps.STEP.KEY... }}` is a
key of an earlier step's JSON result. Here every name is checked to exist (an earlier step, a
known variable). Pure functions only: no I/O but reading the file.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping

from orchestrator.inventory import yamlnodes as yn
from orchestrator.envvars import NAME_RE
from orchestrator.errors import FileError, UsageError
from orchestrator.play.templating import ASSERT_TESTS, _templated, convert, expressions, parse_expr
from orchestrator.runs.options import POLICIES, TOPOLOGIES

TARGET_KEYS = ("target", "host", "vmid", "python", "workdir", "gpus")
BUILTINS = ("playbook_dir",)
STEP_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
RUN_STATES = ("running", "succeeded", "failed", "stopped", "lost", "ended")

# Option kinds: "str" "int" "num" "bool" "list" (of words; one word may be written alone) "argv"
# (a list, never one string) "map" (str -> str) "cmd" (an argv list, or a string run by bash -c)
# "shell" (a bash script) "any" (a plain value), or a tuple of the allowed words.
ACTIONS: dict[str, dict[str, Any]] = {
    "deploy": {"source": "str", "install_deps": "bool", "verify": "bool"},
    "probe": {"gpus": "int", "policies": "list", "topologies": "list", "case_timeout": "int", "reuse": "bool"},
    "launch": {"gpus": "int", "gpu_ids": "str", "name": "str", "config": "str",
               "topology": TOPOLOGIES, "compile_policy": POLICIES, "workers": "int", "env": "map",
               "args": "list", "gate": "bool"},
    "logs": {"run": "str"},
    "export": {"run": "str", "step": "int", "output": "str",
               "dtype": ("bfloat16", "float16", "float32"), "force": "bool"},
    "exec": {"command": "argv", "shell": "shell", "env": "map", "unless": "cmd", "watch": "cmd",
             "changes": "bool"},
    "wait-for": {"run": "str", "state": "list", "timeout": "num", "every": "num"},
    "assert": {"step": "str", "that": "str", "equals": "any", "not_equals": "any", "in": "any",
               "less_than": "num", "greater_than": "num", "exists": "bool", "message": "str"},
}


@dataclass(frozen=True)
class Step:
    name: str
    action: str
    options: Mapping[str, Any]         # as written (templates unrendered)
    line: int
    lines: Mapping[str, int] = field(default_factory=dict)   # option -> its line

    def where(self, index: int, option: str | None = None) -> str:
        return f"steps[{index}].{self.action}.{option}" if option else f"steps[{index}]"


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
            if not NAME_RE.match(name) or name == "steps":
                raise FileError(file, vline, f"vars.{name}", "not a variable name (letters, digits and _)")
            if name in BUILTINS:
                raise FileError(file, vline, f"vars.{name}", "is set by dflash-ops; choose another name")
            variables[name] = None if _is_null(vnode) else yn.scalar(vnode, (str, int, float, bool), file,
                                                                     f"vars.{name}")
            var_lines[name] = vline
    known = set(variables) | set(TARGET_KEYS) | set(BUILTINS)
    for name, value in given.items():
        if name not in known:
            raise UsageError(f"--var {name}: {file} has no variable {name!r}{yn.did_you_mean(name, known)} "
                             f"(its variables: {', '.join(sorted(set(variables) | set(TARGET_KEYS)))})")
        _check_given(name, value, known)
    for name, value in variables.items():
        if value is None and name not in given:
            raise FileError(file, var_lines[name], f"vars.{name}",
                            f"required: pass --var {name}=VALUE (the comments in {file} say what it takes)")
        _check_templates(value, known, set(), file, var_lines[name], f"vars.{name}")

    steps: dict[str, Step] = {}     # by name, in order: each step checked against those before it in O(1)
    items = yn.sequence(top["steps"][0], file, "steps")
    if not items:
        raise FileError(file, top["steps"][1], "steps", "no steps")
    for i, snode in enumerate(items):
        step = _step(snode, i, file, steps)
        for opt, value in step.options.items():
            _check_templates(value, known, steps.keys(), file, step.lines[opt], step.where(i, opt))
        steps[step.name] = step
    return Playbook(path=file, steps=tuple(steps.values()), vars=variables, description=description)


def _is_null(node) -> bool:
    return node.tag == "tag:yaml.org,2002:null"


def _step(node, i: int, file: str, earlier: dict[str, Step]) -> Step:
    where = f"steps[{i}]"
    items = yn.mapping(node, file, where)
    if "name" not in items:
        raise FileError(file, yn.line(node), f"{where}.name", "missing required key")
    name = yn.scalar(items["name"][0], str, file, f"{where}.name")
    if not STEP_NAME_RE.match(name):
        raise FileError(file, items["name"][1], f"{where}.name",
                        f"{name!r}: a step name is letters, digits, _ and - (it is used in {{{{ steps.NAME }}}})")
    if name in earlier:
        raise FileError(file, items["name"][1], f"{where}.name",
                        f"duplicate step name (first on line {earlier[name].line})")
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


def _check_step(step: Step, i: int, file: str, aline: int, earlier: dict[str, Step]) -> None:
    """What one option alone cannot say: exec's command xor shell, assert's step and one test."""
    o, where = step.options, f"steps[{i}].{step.action}"
    if step.action == "exec" and ("command" in o) == ("shell" in o):
        raise FileError(file, aline, where, "give `command:` (an argv list) or `shell:` (a bash script), one of them")
    if step.action == "assert":
        if "step" not in o or "that" not in o:
            raise FileError(file, aline, where, "needs `step:` (an earlier step) and `that:` (a key of its result)")
        if o["step"] not in earlier:
            raise FileError(file, step.lines["step"], f"{where}.step",
                            f"{o['step']!r} is not an earlier step"
                            f"{yn.did_you_mean(str(o['step']), list(earlier))}")
        tests = [t for t in ASSERT_TESTS if t in o]
        if len(tests) != 1:
            raise FileError(file, aline, where, f"needs exactly one test of {', '.join(ASSERT_TESTS)}")
    if step.action == "wait-for":
        for state in convert("list", o.get("state", ["succeeded"])) if not _templated(o.get("state")) else []:
            if state not in RUN_STATES:
                raise FileError(file, step.lines["state"], f"{where}.state",
                                f"{state!r} is not a run state ({', '.join(RUN_STATES)})")


# --- templates: every name known ---------------------------------------------------------------

def _check_given(name: str, value: str, known: set[str]) -> None:
    """A `--var` value is checked as the file's `vars:` are, before any step runs: its templates
    name known variables, never a step's result (a variable means the same in every step)."""
    for expr in expressions(value):
        if expr.strip().split(".")[0].split("|")[0].strip() == "steps":
            raise UsageError(f"--var {name}: {{{{{expr}}}}} reads a step's result, which no variable can (it is one "
                             f"value for every step); write the template in the step's option instead")
    try:
        _check_templates(value, known, set(), "--var", 0, name)
    except FileError as e:
        raise UsageError(f"--var {name}: {e.message}") from None

def _check_templates(value, known: set[str], steps: Collection[str], file: str, line: int, where: str) -> None:
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
