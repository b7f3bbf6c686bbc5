"""The bounds of hosts.yaml and playbooks (docs/reliability.md, "Limits"): size, nesting, plain data only,
plain-decimal numbers, the names targets/hosts/groups may have, and what a workdir may be, on
the controller at load and on the target once `~` is resolved there (real sshd)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from trainer_quick import CLI_MAIN

from orchestrator import inventory
from orchestrator.errors import FileError
from orchestrator.play import playbook as pb


def cli(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI_MAIN, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def refused(text: str, line: int | None, needle: str, file: str = "inv.yaml") -> str:
    start = time.monotonic()
    with pytest.raises(FileError) as e:
        inventory.parse(text, file)
    msg = str(e.value)
    assert msg.startswith(f"{file}:{line}: " if line else f"{file}:"), msg
    assert needle in msg and "\n" not in msg, msg
    assert time.monotonic() - start < 5
    return msg


T = "targets:\n  t:\n    host: h\n    vmid: {}\nhosts:\n  h: {{address: h.invalid}}\n"


@pytest.mark.parametrize("spelling", ["0310", "0o310", "0xC8", "3:20", "2_00", "+0310"])
def test_yaml_1_1_integer_spellings_are_refused_at_their_line(spelling):
    msg = refused(T.format(spelling), 4, spelling)
    assert "expected an integer" in msg or "plain decimal" in msg
    assert inventory.parse(T.format("200")).targets["t"].vmid == 200


@pytest.mark.parametrize("text, line, needle", [
    pytest.param("targets:\n  t:\n    python: !!python/name:os.system\n",
                 3, "YAML tag 'tag:yaml.org,2002:python/name:os.system'", id="python-name-tag"),
    pytest.param("targets:\n  t:\n    python: !!str /usr/bin/python3\n", 3, "only plain data", id="str-tag"),
    pytest.param("targets: !mine\n  t: {}\n", 1, "YAML tag '!mine'", id="local-tag"),
    pytest.param("hosts:\n  a: &a {address: a.invalid}\n  b:\n    <<: *a\n",
                 4, "merge keys (<<) are not supported", id="merge-key"),
    pytest.param("targets:\n  t:\n    env: &e {A: [*e]}\n", 3, "alias *e inside its own anchor", id="alias-loop"),
    pytest.param("hosts:\n  a:\n    address: x\n    connect_timeout: 1:30.5\n",
                 4, "plain decimal", id="sexagesimal-float"),
    pytest.param("hosts:\n  a:\n    address: x\n    connect_timeout: .inf\n", 4, "plain decimal", id="inf"),
    pytest.param("x: " + "[" * 40 + "]" * 40 + "\n", 1, "nested more than 32 levels deep", id="flow-40-deep"),
    pytest.param("x:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 40)),
                 33, "nested more than 32 levels deep", id="block-40-deep"),
    pytest.param("x: " + "[" * 50000 + "]" * 50000 + "\n", 1, "nesting depth", id="flow-50000-deep"),
])
def test_what_is_not_plain_data_is_refused_at_its_line(text, line, needle):
    refused(text, line, needle)


def test_size_limit_and_dev_zero_through_the_cli(tmp_path):
    big = tmp_path / "hosts.yaml"
    big.write_text("# comment\n" * 110_000)            # 1.1 MB of comments
    for path in (big, "/dev/zero"):
        start = time.monotonic()
        r = cli("-i", path, "targets")
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip() == f"dflash-ops: {path}: larger than 1 MB; an inventory or a playbook is a few KB"
        assert time.monotonic() - start < 20
    big.write_text("# comment\n" * 100_000)            # under 1 MB: read
    assert cli("-i", big, "targets").returncode == 0


def test_hostile_yaml_through_the_cli_is_one_line_exit_2(tmp_path):
    for text, needle in [("targets:\n  t:\n    python: !!python/name:os.system\n", ":3: YAML tag"),
                         ("x: " + "[" * 50000 + "]" * 50000 + "\n", ":1: not valid YAML")]:
        p = tmp_path / "hosts.yaml"
        p.write_text(text)
        r = cli("-i", p, "targets")
        assert r.returncode == 2 and needle in r.stderr, r.stderr
        assert "internal error" not in r.stderr and "Error" not in r.stderr.split(":", 2)[-1]
        assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("old, new, line, needle", [
    ("deploy: {}", "deploy: !!python/object:os.system {}", 3, "YAML tag"),
    ("gpus: 1", "gpus: 0x10", 6, "'0x10': write numbers as plain decimals"),
    ("gpus: 1", "gpus: 0010", 6, "plain decimals"),
    ("gpus: 1", "<<: {gpus: 1}", 6, "merge keys"),
])
def test_playbooks_have_the_same_bounds(tmp_path, old, new, line, needle):
    good = "steps:\n  - name: deploy\n    deploy: {}\n  - name: launch\n    launch:\n      gpus: 1\n"
    path = tmp_path / "play.yaml"
    path.write_text(good)
    pb.load(str(path))
    path.write_text(good.replace(old, new))
    with pytest.raises(FileError) as e:
        pb.load(str(path))
    assert str(e.value).startswith(f"{path}:{line}: ") and needle in str(e.value), str(e.value)
    path.write_text("# c\n" * 300_000)
    with pytest.raises(FileError, match="larger than 1 MB"):
        pb.load(str(path))


# --- names --------------------------------------------------------------------------------------

BAD_NAMES = ["a,b", "a b", "--help", "-x", "", "x\ny", "a\u202eb", "é", "a/b", "a" * 65,
             "20250101-120000-3fa9c1", "latest"]


@pytest.mark.parametrize("name", BAD_NAMES)
@pytest.mark.parametrize("section", ["targets", "hosts", "groups"])
def test_names_outside_the_documented_set_are_refused(name, section):
    key = json.dumps(name)
    text = {"targets": f"targets:\n  {key}: {{}}\n",
            "hosts": f"hosts:\n  {key}: {{address: h.invalid}}\n",
            "groups": f"targets:\n  t: {{}}\ngroups:\n  {key}: [t]\n"}[section]
    line = 4 if section == "groups" else 2
    msg = refused(text, line, f"{section}.{name!r}:")
    assert ("looks like a run id" in msg) == (name in ("latest", "20250101-120000-3fa9c1"))


def test_good_names_load():
    inv = inventory.parse("hosts:\n  pve-1.lab: {address: h.invalid}\ntargets:\n  ct_200.a-b: {host: pve-1.lab}\n"
                          "  9x: {}\ngroups:\n  all-2: [ct_200.a-b, 9x]\n")
    assert [t.name for t in inv.expand("all-2")] == ["ct_200.a-b", "9x"]


def test_a_target_named_like_a_run_id_cannot_shadow_the_run_in_logs(tmp_path):
    p = tmp_path / "hosts.yaml"
    p.write_text("targets:\n  20250101-120000-3fa9c1: {workdir: /tmp/x}\n")
    r = cli("-i", p, "logs", "20250101-120000-3fa9c1")
    assert r.returncode == 2 and ":2: targets.'20250101-120000-3fa9c1': looks like a run id" in r.stderr


# --- workdir ------------------------------------------------------------------------------------

@pytest.mark.parametrize("workdir, needle", [
    ("/", "/ is a system folder"),
    ("/etc", "/etc is a system folder"),
    ("/proc/self", "/proc is a system folder"),
    ("/usr/local/dflash", "/usr is a system folder"),
    ("/lib64/x", "/lib64 is a system folder"),
    ("/var/lib", "/var/lib is a system folder"),
    ("/root/../..", "/ is a system folder"),      # normalised before the system-folder check
    ("//", "/ is a system folder"),               # normpath keeps a leading //; Linux reads it as /
    ("//etc", "/etc is a system folder"),
    ("//usr/lib", "/usr is a system folder"),
    ("/etc/.", "/etc is a system folder"),
    ("/usr/../etc", "/etc is a system folder"),
    ("//root/dflash", "must be normalised"),
    ("~//etc", "must be normalised"),
    ("/root/dflash/", "must be normalised"),
    ("/root//dflash", "must be normalised"),
    ("~/../..", "must be normalised"),
    ("~root/x", "~ must be followed by /"),
    ("dflash", "must be an absolute path"),
    ("/root/a\nb", "contains a control character"),
    ("/root/a\u202eb", "contains a control character"),
])
def test_unsafe_workdirs_are_refused_at_load(workdir, needle):
    refused(f"targets:\n  t:\n    workdir: {json.dumps(workdir)}\n", 3, f"targets.t.workdir: {needle}")


@pytest.mark.parametrize("workdir", ["/root/dflash", "/var/lib/dflash", "/srv/ct/dflash", "~", "~/dflash",
                                     "/library/x"])
def test_ordinary_workdirs_load(workdir):
    assert inventory.parse(f"targets:\n  t: {{workdir: {json.dumps(workdir)}}}\n").targets["t"].workdir == workdir


def test_home_is_resolved_and_checked_on_the_target(sshd, fakepct, make_inventory, tmp_path):
    """`~` is the target user's home, as the target sees it (here HOME set by the target's env:):
    a home of / or inside /etc is refused there, before anything is created; a home of its own works."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("A = 1\n")
    home = tmp_path / "home"
    path = make_inventory({
        "slash": {"host": "node", "python": sys.executable, "workdir": "~", "env": {"HOME": "/"}},
        "etc": {"host": "node", "python": sys.executable, "workdir": "~/dflash", "env": {"HOME": "/etc"}},
        "slashes": {"host": "node", "python": sys.executable, "workdir": "~", "env": {"HOME": "//"}},
        "etc2": {"host": "node", "python": sys.executable, "workdir": "~/dflash", "env": {"HOME": "//etc"}},
        "up": {"host": "node", "python": sys.executable, "workdir": "~/dflash", "env": {"HOME": "/usr/../etc/."}},
        "mine": {"host": "node", "python": sys.executable, "workdir": "~/dflash", "env": {"HOME": str(home)}},
    })
    # --dry-run: without the check this would not write either (a real deploy would create /releases)
    r = cli("-i", path, "deploy", "slash", "--dry-run", "--source", src)
    assert r.returncode == 1 and "slash: workdir '~' is / here, a system folder" in r.stdout, r.stdout
    r = cli("-i", path, "deploy", "etc", "--dry-run", "--source", src)
    assert r.returncode == 1 and "workdir '~/dflash' is /etc/dflash here" in r.stdout, r.stdout
    for name, seen in (("slashes", "'~' is / here"), ("etc2", "'~/dflash' is /etc/dflash here"),
                       ("up", "'~/dflash' is /etc/dflash here")):   # normalised there too before the check
        r = cli("-i", path, "deploy", name, "--dry-run", "--source", src)
        assert r.returncode == 1 and f"{name}: workdir {seen}, a system folder" in r.stdout, r.stdout
    assert not os.path.exists("/etc/dflash") and not os.path.exists("/releases")
    r = cli("-i", path, "deploy", "mine", "--source", src)
    assert r.returncode == 0, r.stderr
    assert (home / "dflash" / "current" / "a.py").read_text() == "A = 1\n"
