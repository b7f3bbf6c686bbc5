"""The launch spec: the one JSON document a launch sends the runs agent (stdin's first line), declared
once. Each key's types and default are here; normalize(spec) is called once at the agent's door
(runs_agent.cmd_launch, and on the spec a resume rebuilds), and the controller's launch_spec writes through
it too, so both sides read every key with the same default and nothing downstream spells one again.
Imported as is by the controller, like kinds.py (stdlib only, Python >= 3.8).

The names both sides share live here too: `auto` (the trainer resolves it from WORKDIR/probe.json; the
trainer's own spelling is trainer/policies.py AUTO, checked equal by tests/test_launch_spec.py) and the
probe's file. Keys the agent adds on its side after the door (upload_dir, node_env) are not sent.
"""
AUTO_POLICY = "auto"                  # the probe's choice, resolved by the trainer
DEFAULT_TOPOLOGY = "threads"          # trainer/run/config.py TOPOLOGIES holds the choices
PROBE_FILE = "probe.json"             # WORKDIR/probe.json: the probe's saved choice

_REQUIRED = object()
_NULL = type(None)

# key: (the JSON types it may have, its default). A list or dict default is copied.
FIELDS = {
    "run": ((str,), _REQUIRED),             # the run's id (a resume's: the run it continues)
    "kind": ((str,), "train"),              # runs/kinds.py: train | regen | gate
    "target": ((str, _NULL), None),         # the inventory's name for this target
    "gpus": ((int, _NULL), None),           # GPUs the run takes (None: a resume keeps its own)
    "gpu_ids": ((list, _NULL), None),       # exactly these GPUs
    "target_gpus": ((int,), 0),             # GPUs the inventory says the target has
    "topology": ((str,), DEFAULT_TOPOLOGY),
    "compile_policy": ((str,), AUTO_POLICY),
    "workers": ((int, _NULL), None),
    "extra": ((list,), []),                 # the trainer's arguments, after the tool's own
    "name": ((str, _NULL), None),           # launch --name
    "resume": ((str, _NULL), None),         # the run to continue
    "config_text": ((str, _NULL), None),    # the --config file's text, its name and where it came from
    "config_name": ((str, _NULL), None),
    "config_source": ((str, _NULL), None),
    "config_file": ((str, _NULL), None),    # a resume: the run's own copy on the target
    "files": ((list,), []),                 # files sent after the spec (runs/upload.py)
    "controller": ((dict, _NULL), None),    # who launched: user, host
    "user_env": ((dict,), {}),              # hosts.yaml env: and --env, secrets masked (recorded)
    "nodes": ((dict, _NULL), None),         # one node of a job: targets, index, endpoint, address
    "cpu_by_default": ((bool,), False),     # no GPUs only because none were asked for
}


class SpecError(ValueError):
    """A launch spec that is not one: its message names the key."""


def _type_ok(value, types) -> bool:
    if isinstance(value, bool) and bool not in types:   # JSON true is not a number of GPUs
        return False
    return isinstance(value, types)


def normalize(spec) -> dict:
    """The spec with every key present (defaults filled in) and of its type; SpecError otherwise,
    an unknown key included (a misspelt key would otherwise be read as its default)."""
    if not isinstance(spec, dict):
        raise SpecError("a launch spec is a JSON object, not %s" % type(spec).__name__)
    unknown = sorted(k for k in spec if k not in FIELDS)
    if unknown:
        raise SpecError("unknown key(s) in the launch spec: %s" % ", ".join(map(str, unknown)))
    out = {}
    for key, (types, default) in FIELDS.items():
        if key in spec:
            value = spec[key]
        elif default is _REQUIRED:
            raise SpecError("the launch spec has no %r" % key)
        else:
            value = list(default) if isinstance(default, list) else dict(default) if isinstance(default, dict) \
                else default
        if not _type_ok(value, types):
            raise SpecError("launch spec key %r: expected %s, got %s" % (
                key, " or ".join("null" if t is _NULL else t.__name__ for t in types), type(value).__name__))
        out[key] = value
    return out
