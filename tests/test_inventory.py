"""Inventory: every bad file gives one line naming file, line and key (exit 2 via the CLI)."""
import subprocess
import sys

import pytest

from orchestrator import inventory
from orchestrator.inventory import yamlnodes
from orchestrator.errors import InventoryError, UsageError

GOOD = """\
default: ct200
hosts:
  bastion:
    address: bastion.invalid
  pve1:
    address: pve1.invalid
    user: ops
    port: 2222
    jump: bastion
targets:
  ct200:
    host: pve1
    vmid: 200
    python: /root/venv/bin/python
    workdir: /root/dflash
    gpus: 8
    expect: {torch: ">=2.5", cuda: "13.0"}
  node:
    host: pve1
"""


def test_good_file_loads_into_frozen_objects():
    inv = inventory.parse(GOOD, "hosts.yaml")
    t = inv.target("ct200")
    assert (t.host, t.vmid, t.gpus, t.python) == ("pve1", 200, 8, "/root/venv/bin/python")
    assert dict(t.expect) == {"torch": ">=2.5", "cuda": "13.0"}
    h = inv.hosts["pve1"]
    assert (h.user, h.port, h.jump, h.pct) == ("ops", 2222, "bastion", "/usr/sbin/pct")
    assert [x.name for x in inv.host_chain(h)] == ["bastion"]
    assert inv.default_target().name == "ct200"
    assert "local" in inv.targets
    with pytest.raises(Exception):
        t.gpus = 1  # frozen


@pytest.mark.parametrize("text, line, needle", [
    ("hosts:\n  a:\n    adress: x\n", 3, "hosts.a.adress: unknown key (did you mean 'address'?)"),
    ("hosts:\n  a: {}\n", 2, "hosts.a.address: missing required key"),
    ("targets:\n  t:\n    gpus: many\n", 3, "targets.t.gpus: expected an integer"),
    ("targets:\n  t:\n    gpus: true\n", 3, "targets.t.gpus: expected an integer"),
    ("targets:\n  t:\n    host: pve\n", 3, "targets.t.host: names a missing host 'pve'"),
    ("targets:\n  t: {}\n  t: {}\n", 3, "targets.t: duplicate name (first on line 2)"),
    ("hosts:\n  a:\n    address: x\n    jump: b\n  b:\n    address: y\n    jump: a\n", 7,
     "jump-host loop: a -> b -> a"),
    ("hosts:\n  a:\n    address: x\n    jump: a\n", 4, "hosts.a.jump: jump-host loop: a -> a"),
    ("hosts:\n  a:\n    address: x\n    jump: nowhere\n", 4, "names a missing host 'nowhere'"),
    ("targts: {}\n", 1, "targts: unknown key (did you mean 'targets'?)"),
    ("default: ct2\ntargets:\n  ct200: {}\n", 1, "default: names a missing target 'ct2' (did you mean 'ct200'?)"),
    ("targets:\n  t:\n    vmid: 5\n", 3, "must be a Proxmox VMID, 100..999999999 (got 5)"),
    ("hosts:\n  a:\n    address: x\n    port: 70000\n", 4, "must be 1..65535"),
    ("hosts: [1, 2]\n", 1, "hosts: expected a mapping, got a list"),
    ("targets:\n  t:\n    expect: 3\n", 3, "expected a mapping"),
    ("targets: {t: {host: [\n", None, "not valid YAML"),
    ("targets:\n  t:\n    workdir: reldflash\n", 3, "targets.t.workdir: must be an absolute path"),
    ("hosts:\n  a:\n    address: x\n    connect_timeout: 0\n", 4, "hosts.a.connect_timeout: must be"),
    ("hosts:\n  a:\n    address: x\n    connect_timeout: -5\n", 4, "hosts.a.connect_timeout: must be"),
    ("targets:\n  local:\n    gpus: 1\n", 2, "targets.local: 'local' is the built-in target"),
    ("targets:\n  t:\n    train_address: 10.0.0\n", 3,
     "targets.t.train_address: expected an IPv4 address or a host name"),
    ("targets:\n  t:\n    train_address: 'a b'\n", 3, "targets.t.train_address: expected an IPv4"),
    ("targets:\n  t:\n    train_port: 0\n", 3, "targets.t.train_port: must be 1..65535"),
    ("targets:\n  t: {}\ngroups:\n  g: [t, u]\n", 4, "groups.g: names a missing target 'u'"),
    ("targets:\n  t: {}\ngroups:\n  g: [t, t]\n", 4, "groups.g: names 't' twice"),
    ("targets:\n  t: {}\ngroups:\n  t: [t]\n", 4, "groups.t: a target has this name"),
    ("targets:\n  t: {}\ngroups:\n  g: t\n", 4, "groups.g: expected a list of target names"),
])
def test_bad_files_name_file_line_and_key(text, line, needle):
    with pytest.raises(InventoryError) as e:
        inventory.parse(text, "inv.yaml")
    msg = str(e.value)
    assert needle in msg
    assert msg.startswith("inv.yaml:" if line is None else f"inv.yaml:{line}:")
    assert "\n" not in msg


def test_local_exists_without_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DFLASH_OPS_INVENTORY", raising=False)
    inv = inventory.load(None)
    assert list(inv.targets) == ["local"]
    assert inv.default_target().name == "local"
    assert inv.targets["local"].python == sys.executable


def test_default_is_the_only_target_else_local():
    assert inventory.parse("targets:\n  a: {}\n").default_target().name == "a"
    assert inventory.parse("targets:\n  a: {}\n  b: {}\n").default_target().name == "local"


def test_several_targets_by_commas_or_group():
    inv = inventory.parse("targets:\n  a: {train_address: 10.0.0.1}\n  b: {train_address: node-b.lan}\n"
                          "groups:\n  pair: [b, a]\n")
    assert [t.name for t in inv.expand("pair")] == ["b", "a"]               # the group's order
    assert [t.name for t in inv.expand("a,b")] == ["a", "b"]
    assert [t.name for t in inv.select(["pair", "a"])] == ["b", "a"]
    assert inv.targets["a"].train_port == 29400
    with pytest.raises(UsageError, match="named twice"):
        inv.expand("a,a")
    with pytest.raises(UsageError, match="'pair' is a group"):
        inv.expand("a,pair")
    with pytest.raises(UsageError, match="unknown target 'c'"):
        inv.expand("a,c")
    # what exec takes for targets when a command is typed without `--`: what expand takes, nothing else
    assert all(inv.names_targets(w) for w in ("a", "pair", "a,b", "b,a"))
    assert not any(inv.names_targets(w) for w in ("c", "a,c", "a,a", "a,pair", ",", "ls"))


def test_unknown_target_suggests():
    inv = inventory.parse(GOOD)
    with pytest.raises(UsageError, match="did you mean 'ct200'"):
        inv.target("ct20")
    two = inventory.parse("targets:\n  ct200: {}\n  ct201: {}\n  gpu9: {}\n")
    with pytest.raises(UsageError, match=r"unknown target 'ct20' \(did you mean 'ct200' or 'ct201'\?\)"):
        two.target("ct20")     # as close as each other: both named, not the first one's
    assert yamlnodes.did_you_mean("ab", ["abc", "abd", "abe", "zzz"]) == " (did you mean 'abc', 'abd' or 'abe'?)"
    assert yamlnodes.did_you_mean("ct2001", ["ct200", "ct20"]) == " (did you mean 'ct200'?)"
    assert yamlnodes.did_you_mean("xyz", ["ct200"]) == "" and yamlnodes.did_you_mean("x", []) == ""


def test_cli_exit_2_one_line_no_traceback(tmp_path):
    bad = tmp_path / "hosts.yaml"
    bad.write_text("targets:\n  t:\n    gpu: 2\n")
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "-i", str(bad), "targets"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert f"{bad}:3: targets.t.gpu: unknown key (did you mean 'gpus'?)" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_refuses_a_file_that_is_not_utf8(tmp_path):
    bad = tmp_path / "hosts.yaml"
    bad.write_bytes(b"targets:\n  t:\n    python: /opt/\xff\xfe/python\n")
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "-i", str(bad), "targets"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"dflash-ops: {bad}:3: not UTF-8 text (byte 0xff); save the file as UTF-8"


def test_example_inventory_names_only_invalid_hosts():
    import pathlib
    import yaml
    example = pathlib.Path(__file__).parent.parent / "hosts.example.yaml"
    doc = yaml.safe_load(example.read_text())
    inventory.parse(example.read_text())
    # not the default inventory's name: from the checkout, commands see `local` only
    assert not (pathlib.Path(__file__).parent.parent / "hosts.yaml").exists()
    for h in doc["hosts"].values():
        assert h["address"].endswith(".invalid")
