"""hosts.yaml -> frozen, typed objects, validated once at load.

Every error names the file, the line and the key, and suggests a near-miss spelling.
The built-in target `local` exists even without a file.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from orchestrator.inventory import names, sshconfig, yamlnodes
from orchestrator.envvars import NAME_RE
from orchestrator.errors import InventoryError, UsageError

LOCAL = "local"
ENV_VAR = "DFLASH_OPS_INVENTORY"


@dataclass(frozen=True)
class Host:
    """A machine reached over SSH (a Proxmox node or a plain host)."""

    name: str
    address: str
    user: str = "root"
    port: int = 22
    identity_file: str | None = None
    known_hosts: str | None = None
    jump: str | None = None
    pct: str = "/usr/sbin/pct"
    connect_timeout: float = 10.0
    identities_only: bool = False    # as OpenSSH's IdentitiesOnly: of the agent's keys, only identity_file's
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # Filled at load, not a hosts.yaml key: every IdentityFile the ssh_config names (in order).
    identities: tuple = ()

    @property
    def key_files(self) -> tuple:
        """The identity files to offer, in order (hosts.yaml's, else the ssh_config's)."""
        return self.identities or ((self.identity_file,) if self.identity_file else ())


@dataclass(frozen=True)
class Target:
    """Where code is deployed and training runs."""

    name: str
    host: str | None = None          # None: this machine
    vmid: int | None = None          # None: the host itself, no pct
    python: str = "python3"
    workdir: str = "/root/dflash"
    gpus: int = 0
    expect: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # Several nodes in one job: the container's address on the training network (which the other
    # nodes dial; not the node's SSH address) and the rendezvous port when this target hosts it.
    train_address: str | None = None
    train_port: int = 29400

    @property
    def is_local(self) -> bool:
        return self.host is None and self.vmid is None


@dataclass(frozen=True)
class Inventory:
    path: str | None
    hosts: Mapping[str, Host]
    targets: Mapping[str, Target]
    default: str | None = None
    ssh_config: str | None = None    # the ssh_config file read at load, if any
    groups: Mapping[str, tuple] = field(default_factory=lambda: MappingProxyType({}))   # name -> target names

    def target(self, name: str) -> Target:
        try:
            return self.targets[name]
        except KeyError:
            raise UsageError(f"unknown target {name!r}{yamlnodes.did_you_mean(name, self.targets)}"
                             f" (known: {', '.join(sorted(self.targets))})") from None

    def default_target(self) -> Target:
        """docs/inventory.md: `default:`, else the only target the file defines, else `local`."""
        if self.default:
            return self.target(self.default)
        defined = [n for n in self.targets if n != LOCAL]
        if len(defined) == 1:
            return self.targets[defined[0]]
        return self.targets[LOCAL]

    def expand(self, word: str) -> list[Target]:
        """`ct200,ct300` (targets, comma-separated) or a group of hosts.yaml `groups:`: its targets,
        in the order given; a single name is that one target."""
        if word in self.groups:
            return [self.targets[n] for n in self.groups[word]]
        names = [n for n in word.split(",") if n]
        if not names:
            raise UsageError(f"{word!r}: expected a target, TARGET,TARGET... or a group name")
        if len(set(names)) != len(names):
            raise UsageError(f"{word}: a target is named twice")
        return [self.target_or_group(n) for n in names]

    def names_targets(self, word: str) -> bool:
        """Whether `word` is what expand takes: a target, TARGET,TARGET... or a group name."""
        try:
            self.expand(word)
        except UsageError:
            return False
        return True

    def target_or_group(self, name: str) -> Target:
        if name in self.groups:
            raise UsageError(f"{name!r} is a group; name it alone, not in a list of targets")
        if name not in self.targets:
            raise UsageError(f"unknown target {name!r}{yamlnodes.did_you_mean(name, {**self.targets, **self.groups})}"
                             f" (known: {', '.join(sorted(self.targets))}"
                             + (f"; groups: {', '.join(sorted(self.groups))}" if self.groups else "") + ")")
        return self.targets[name]

    def select(self, names: tuple[str, ...] | list[str]) -> list[Target]:
        if not names:
            return [self.default_target()]
        seen: dict[str, Target] = {}
        for n in names:
            for t in (self.expand(n) if n in self.groups or "," in n else [self.target(n)]):
                seen.setdefault(t.name, t)
        return list(seen.values())

    def host_chain(self, host: Host) -> list[Host]:
        """The jump hosts to cross before `host`, outermost first."""
        chain: list[Host] = []
        h = host
        while h.jump:
            h = self.hosts[h.jump]
            chain.insert(0, h)
        return chain


def local_target() -> Target:
    """The built-in `local` target: this machine, the controller's own python."""
    home = Path(os.environ.get("DFLASH_OPS_HOME", Path.home() / ".dflash-ops"))
    return Target(name=LOCAL, python=sys.executable, workdir=str(home / "local"),
                  gpus=_local_gpu_count())


def _local_gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def find_path(explicit: str | None) -> Path | None:
    """docs/inventory.md: --inventory/-i, else $DFLASH_OPS_INVENTORY, else ./hosts.yaml (if it exists)."""
    if explicit:
        return Path(explicit)
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    p = Path("hosts.yaml")
    return p if p.exists() else None


def load(explicit: str | None = None, ssh_config: str | None = None) -> Inventory:
    """ssh_config: an ssh_config file to read instead of the inventory's `ssh_config:` or
    ~/.ssh/config (`-F/--ssh-config`)."""
    path = find_path(explicit)
    if path is None:
        return Inventory(path=None, hosts=MappingProxyType({}),
                         targets=MappingProxyType({LOCAL: local_target()}), ssh_config=ssh_config)
    return parse(yamlnodes.read_text(path), str(path), ssh_config=ssh_config)


# --- parsing -------------------------------------------------------------------------------

_TOP_KEYS = {"default": str, "hosts": dict, "targets": dict, "ssh_config": str, "groups": dict}
HOSTNAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*$")
_INTERNAL = {"name", "identities"}      # dataclass fields that are not hosts.yaml keys
MAX_GPUS = 1024             # a target's `gpus:`; more than any machine holds
MAX_CONNECT_TIMEOUT = 3600.0
# The range of each number key (yamlnodes bounds every number's digits and size first):
# key -> (lowest, highest, the rule as the message says it).
RANGES = {
    "port": (1, 65535, "1..65535"),
    "train_port": (1, 65535, "1..65535"),
    "vmid": (100, 999_999_999, "a Proxmox VMID, 100..999999999"),
    "gpus": (0, MAX_GPUS, f"0..{MAX_GPUS}"),
    "connect_timeout": (0.1, MAX_CONNECT_TIMEOUT, f"a number of seconds, 0.1..{MAX_CONNECT_TIMEOUT:g}"),
}


def parse(text: str, file: str = "hosts.yaml", ssh_config: str | None = None) -> Inventory:
    root = yamlnodes.compose(text, file)
    if root is None:
        top: dict[str, tuple[Any, int]] = {}
    else:
        top = yamlnodes.mapping(root, file, "(top level)")
    for key, (_, line) in top.items():
        if key not in _TOP_KEYS:
            raise InventoryError(file, line, key, f"unknown key{yamlnodes.did_you_mean(key, _TOP_KEYS)}")

    if ssh_config is None and "ssh_config" in top:
        ssh_config = os.path.expanduser(yamlnodes.scalar(top["ssh_config"][0], str, file, "ssh_config"))
        if not os.path.exists(ssh_config):
            raise InventoryError(file, top["ssh_config"][1], "ssh_config", f"no such file: {ssh_config}")
    hosts: dict[str, Host] = {}
    explicit: dict[str, set[str]] = {}
    if "hosts" in top:
        node, line = top["hosts"]
        for name, (hnode, hline) in yamlnodes.mapping(node, file, "hosts").items():
            _check_name(name, file, hline, "hosts")
            hosts[name] = _build(Host, name, hnode, hline, file, f"hosts.{name}")
            explicit[name] = set(yamlnodes.mapping(hnode, file, f"hosts.{name}"))
    cfg_path = ssh_config if ssh_config is not None else (sshconfig.default_path() if hosts else None)

    targets: dict[str, Target] = {LOCAL: local_target()}
    if "targets" in top:
        node, line = top["targets"]
        for name, (tnode, tline) in yamlnodes.mapping(node, file, "targets").items():
            if name == LOCAL:
                raise InventoryError(file, tline, f"targets.{name}",
                                     "'local' is the built-in target (this machine); use another name")
            _check_name(name, file, tline, "targets")
            t = _build(Target, name, tnode, tline, file, f"targets.{name}")
            if t.host is not None and t.host not in hosts:
                raise InventoryError(file, yamlnodes.line_of(tnode, "host", tline), f"targets.{name}.host",
                                     f"names a missing host {t.host!r}{yamlnodes.did_you_mean(t.host, hosts)}")
            targets[name] = t

    # The ssh_config fills in what hosts.yaml leaves out (sshconfig.py), then jump hosts written
    # as addresses or hop lists become hosts of their own.
    try:
        cfg = sshconfig.SshConfig(cfg_path if hosts else None)
        for name, h in list(hosts.items()):
            hosts[name] = sshconfig.apply(h, explicit[name], cfg)
    except sshconfig.SshConfigError as e:
        raise InventoryError(file, None, "ssh_config", str(e)) from None
    for name, h in list(hosts.items()):
        _check_jump_chain(h, hosts, file, top["hosts"][0], cfg)
    for name, h in list(hosts.items()):
        if h.jump and h.jump not in hosts:
            try:
                made, via = sshconfig.jump_hosts(h, hosts, cfg, _hop_host)
            except sshconfig.SshConfigError as e:
                raise InventoryError(file, yamlnodes.line_of(yamlnodes.child(top["hosts"][0], name), "jump", None),
                                     f"hosts.{name}.jump", str(e)) from None
            hosts.update(made)
            hosts[name] = dataclasses.replace(h, jump=via)

    groups = _groups(top["groups"][0], file, targets) if "groups" in top else {}

    default = None
    if "default" in top:
        node, line = top["default"]
        default = yamlnodes.scalar(node, str, file, "default")
        if default not in targets:
            raise InventoryError(file, line, "default",
                                 f"names a missing target {default!r}{yamlnodes.did_you_mean(default, targets)}")
    return Inventory(path=file, hosts=MappingProxyType(hosts), targets=MappingProxyType(targets),
                     default=default, ssh_config=cfg_path, groups=MappingProxyType(groups))


def _groups(node, file: str, targets: Mapping[str, Target]) -> dict[str, tuple]:
    """`groups: {NAME: [TARGET, ...]}`: names for sets of targets (one multi-node launch)."""
    out: dict[str, tuple] = {}
    for name, (gnode, gline) in yamlnodes.mapping(node, file, "groups").items():
        _check_name(name, file, gline, "groups")
        if name in targets:
            raise InventoryError(file, gline, f"groups.{name}", "a target has this name; give the group another")
        if yamlnodes.node_kind(gnode) != "list" or not gnode.value:
            raise InventoryError(file, gline, f"groups.{name}", "expected a list of target names")
        members: list[str] = []
        for item in gnode.value:
            member = yamlnodes.scalar(item, str, file, f"groups.{name}")
            if member not in targets:
                raise InventoryError(file, item.start_mark.line + 1, f"groups.{name}",
                                     f"names a missing target {member!r}{yamlnodes.did_you_mean(member, targets)}")
            if member in members:
                raise InventoryError(file, item.start_mark.line + 1, f"groups.{name}",
                                     f"names {member!r} twice")
            members.append(member)
        out[name] = tuple(members)
    return out


def _check_name(name: str, file: str, line: int, section: str) -> None:
    problem = names.name_problem(name)
    if problem:
        raise InventoryError(file, line, f"{section}.{name!r}", problem)


def _hop_host(*, name: str, address: str, user: str | None, port: int | None, parent: Host) -> Host:
    """A jump host written as an address: what it does not say comes from the host naming it."""
    return Host(name=name, address=address, user=user or "root", port=port or 22,
                identity_file=parent.identity_file, identities=parent.identities,
                identities_only=parent.identities_only, known_hosts=parent.known_hosts,
                connect_timeout=parent.connect_timeout)


def _check_jump_chain(host: Host, hosts: dict[str, Host], file: str, hosts_node, cfg) -> None:
    seen = [host.name]
    h = host
    while h.jump:
        hnode = yamlnodes.child(hosts_node, h.name)
        line = yamlnodes.line_of(hnode, "jump", None)
        if h.jump not in hosts and (sshconfig.looks_like_address(h.jump) or cfg.knows(h.jump)):
            return   # an address (ProxyJump spelling) or an ssh_config Host: resolved after
        if h.jump not in hosts:
            raise InventoryError(file, line, f"hosts.{h.name}.jump",
                                 f"names a missing host {h.jump!r}{yamlnodes.did_you_mean(h.jump, hosts)}")
        if h.jump in seen:
            loop = " -> ".join(seen + [h.jump])
            raise InventoryError(file, line, f"hosts.{h.name}.jump", f"jump-host loop: {loop}")
        seen.append(h.jump)
        h = hosts[h.jump]


def _build(cls, name: str, node, line: int, file: str, where: str):
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in _INTERNAL}
    required = {f.name for f in fields.values()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    items = yamlnodes.mapping(node, file, where)
    values: dict[str, Any] = {}
    for key, (vnode, vline) in items.items():
        if key not in fields:
            raise InventoryError(file, vline, f"{where}.{key}", f"unknown key{yamlnodes.did_you_mean(key, fields)}")
        values[key] = _convert(fields[key].type, vnode, file, f"{where}.{key}", vline)
    for key in sorted(required - values.keys()):
        raise InventoryError(file, line, f"{where}.{key}", "missing required key")
    for key, (low, high, what) in RANGES.items():
        if key in values and not low <= values[key] <= high:
            raise InventoryError(file, yamlnodes.line_of(node, key, line), f"{where}.{key}",
                                 f"must be {what} (got {values[key]})")
    if "workdir" in values and (why := names.workdir_problem(values["workdir"])):
        raise InventoryError(file, yamlnodes.line_of(node, "workdir", line), f"{where}.workdir",
                             f"{why} (got {values['workdir']!r})")
    if "train_address" in values and not _is_address(values["train_address"]):
        raise InventoryError(file, yamlnodes.line_of(node, "train_address", line), f"{where}.train_address",
                             f"expected an IPv4 address or a host name, got {values['train_address']!r}")
    for key, (_, eline) in yamlnodes.mapping(node, file, where).items():
        if key == "env":
            for k, (_, kline) in yamlnodes.mapping(yamlnodes.child(node, "env"), file, f"{where}.env").items():
                if not NAME_RE.match(k):
                    raise InventoryError(file, kline, f"{where}.env.{k}",
                                         "not a variable name (letters, digits and _, not first a digit)")
    for key in ("identity_file", "known_hosts"):
        if values.get(key):
            values[key] = os.path.expanduser(values[key])
    return cls(name=name, **values)


def _is_address(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).version == 4
    except ValueError:
        return bool(HOSTNAME_RE.match(text)) and not text.replace(".", "").isdigit()


def _convert(type_str: object, node, file: str, where: str, line: int):
    t = str(type_str)
    if t.startswith("Mapping"):
        items = yamlnodes.mapping(node, file, where)
        return MappingProxyType({k: yamlnodes.scalar(v, str, file, f"{where}.{k}") for k, (v, _) in items.items()})
    if t == "bool":
        return yamlnodes.scalar(node, bool, file, where)
    if "int" in t:
        return yamlnodes.scalar(node, int, file, where)
    if "float" in t:
        return float(yamlnodes.scalar(node, (int, float), file, where))
    return yamlnodes.scalar(node, str, file, where)
