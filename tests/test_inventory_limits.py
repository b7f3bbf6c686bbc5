"""The bounds of hosts.yaml and playbooks (docs/reliability.md, "Limits"): size, nesting, plain data only,
plain-decimal numbers, the names targets/hosts/groups may have, and what a workdir may be, on
the controller at load and on the target once `~` is resolved there (real sshd)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from trainer_quick import CLI_MAIN

from orchestrator import inventory
from orchestrator.errors import FileError
from orchestrator.play import playbook as pb


def cli(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI_MAIN, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


# A hang guard, not a timing (issue 52): a hostile file (an alias inside its own anchor, 50,000 levels,
# a 5000-digit number, a FIFO) worked on without its bound would take minutes, or forever; the tests
# that load one fail after 120 s instead. The refusal's own words (the needle) name the bound that held.
BOUNDED = pytest.mark.timeout(120)


def refused(text: str, line: int | None, needle: str, file: str = "inv.yaml") -> str:
    with pytest.raises(FileError) as e:
        inventory.parse(text, file)
    msg = str(e.value)
    assert msg.startswith(f"{file}:{line}: " if line else f"{file}:"), msg
    assert needle in msg and "\n" not in msg, msg
    return msg


T = "targets:\n  t:\n    host: h\n    vmid: {}\nhosts:\n  h: {{address: h.invalid}}\n"


@pytest.mark.parametrize("spelling", ["0310", "0o310", "0xC8", "3:20", "2_00", "+0310"])
@BOUNDED
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
@BOUNDED
def test_what_is_not_plain_data_is_refused_at_its_line(text, line, needle):
    refused(text, line, needle)


def test_size_limit_through_the_cli(tmp_path):
    big = tmp_path / "hosts.yaml"
    big.write_text("# comment\n" * 110_000)            # 1.1 MB of comments
    r = cli("-i", big, "targets")      # refused by the size check before it is parsed (its message)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"dflash-ops: {big}: larger than 1 MB; an inventory or a playbook is a few KB"
    big.write_text("# comment\n" * 100_000)            # under 1 MB: read
    assert cli("-i", big, "targets").returncode == 0


def test_what_is_not_a_regular_file_is_refused_before_it_is_read(tmp_path):
    """A FIFO (nobody writing: an open would wait forever), a device (/dev/zero never ends), a
    socket, a folder: one line, exit 2, at once; as an inventory, a playbook or a prompts file."""
    import socket

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    good = tmp_path / "hosts.yaml"
    good.write_text("targets:\n  t: {}\n")
    # What waited on the FIFO (an open with no writer) or read /dev/zero would never end: cli's timeout
    # turns that into a failure; the message names the file's kind, which only the check before the
    # open can say.
    for path, kind in ((fifo, "a FIFO"), ("/dev/zero", "a character device"), ("/dev/null", "a character device"),
                       (tmp_path / "sock", "a socket"), (tmp_path, "a folder")):
        for args in (("-i", path, "targets"), ("-i", good, "play", path, "--dry-run"),
                     ("-i", good, "regen", "t", "--prompts", path, "--model", "tiny")):
            if args[2] == "play" and path == tmp_path:
                continue        # click's own check of the argument (dir_okay=False), exit 2 too
            r = cli(*args)
            assert r.returncode == 2, (args, r.stderr)
            assert r.stderr.strip().endswith(f"{path}: not a regular file ({kind}); name a file"), (args, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1
    sock.close()


BIG = "9" * 5000


@pytest.mark.parametrize("text, line, needle", [
    pytest.param(f"hosts:\n  h:\n    address: h.invalid\n    port: {BIG}\n", 4,
                 "hosts.h.port: an integer of 5000 digits (at most 18)", id="port-5000-digits"),
    pytest.param(f"targets:\n  t:\n    vmid: {BIG}\n", 3, "targets.t.vmid: an integer of 5000 digits", id="vmid"),
    pytest.param(f"targets:\n  t:\n    gpus: {BIG}\n", 3, "targets.t.gpus: an integer of 5000 digits", id="gpus"),
    pytest.param(f"hosts:\n  h:\n    address: h.invalid\n    connect_timeout: {BIG}\n", 4,
                 "hosts.h.connect_timeout: an integer of 5000 digits", id="timeout-5000-digits"),
    pytest.param(f"targets:\n  t:\n    env: {{A: {BIG}}}\n", 3, "targets.t.env.A: an integer of 5000", id="env-int"),
    pytest.param(f"{BIG}: x\n", 1, "an integer of 5000 digits", id="a-key"),
    pytest.param("targets:\n  t:\n    gpus: 1234567890123456789\n", 3, "an integer of 19 digits", id="19-digits"),
    pytest.param("targets:\n  t:\n    gpus: 1025\n", 3, "targets.t.gpus: must be 0..1024 (got 1025)", id="gpus-range"),
    pytest.param("targets:\n  t:\n    vmid: 1000000000\n", 3, "targets.t.vmid: must be a Proxmox VMID, "
                 "100..999999999", id="vmid-range"),
    pytest.param("hosts:\n  h:\n    address: x\n    connect_timeout: 1.0e+400\n", 4,
                 "hosts.h.connect_timeout: '1.0e+400': a decimal is 0 or between 1e-12 and 1e+18", id="timeout-inf"),
    pytest.param("hosts:\n  h:\n    address: x\n    connect_timeout: 1.0e-320\n", 4,
                 "hosts.h.connect_timeout: '1.0e-320': a decimal is 0 or between", id="timeout-subnormal"),
    pytest.param("hosts:\n  h:\n    address: x\n    connect_timeout: 0.001\n", 4,
                 "hosts.h.connect_timeout: must be a number of seconds, 0.1..3600 (got 0.001)", id="timeout-range"),
    pytest.param("hosts:\n  h:\n    address: x\n    connect_timeout: 86400\n", 4,
                 "must be a number of seconds, 0.1..3600 (got 86400.0)", id="timeout-a-day"),
    pytest.param("hosts:\n  h:\n    address: x\n    connect_timeout: .nan\n", 4, "plain decimal", id="nan"),
    pytest.param('targets:\n  t:\n    env: {A: "x\\0y"}\n', 3,
                 "targets.t.env.A: a NUL character (\\0) in a value", id="env-nul"),
    pytest.param('targets:\n  t:\n    python: "\\x00"\n', 3, "targets.t.python: a NUL character", id="python-nul"),
    pytest.param('groups:\n  g: [a, "b\\0"]\n', 2, "groups.g[1]: a NUL character", id="list-item-nul"),
    pytest.param('hosts:\n  h:\n    "a\\0": x\n', 3, "hosts.h.a\x00: a NUL character", id="key-nul"),
])
@BOUNDED
def test_numbers_and_text_outside_their_bounds_are_refused_at_their_line(text, line, needle):
    """Every number a file holds has at most 18 digits and a decimal a size (no inf, no 1e-320),
    then each key its range; no value holds a NUL: FILE:LINE: KEY, never an internal error."""
    refused(text, line, needle)


@pytest.mark.parametrize("config, needle", [
    ("Host h\n  Port 99999999999999999999999\n", "Port '99999999999999999999'... (for h): expected a number 1..65535"),
    ("Host h\n  Port abc\n", "Port 'abc' (for h): expected a number 1..65535"),
    ("Host h\n  Port 70000\n", "expected a number 1..65535"),
    ("Host h\n  ConnectTimeout 1e400\n", "ConnectTimeout '1e400' (for h): expected a number 0.1..3600"),
    ("Host h\n  ConnectTimeout nan\n", "ConnectTimeout 'nan'"),
    (None, "not a regular file (a FIFO)"),
])
@BOUNDED
def test_the_ssh_config_is_held_to_the_same_bounds(tmp_path, config, needle):
    """What ~/.ssh/config (or -F) fills in takes the range hosts.yaml gives its key; a FIFO named as
    the ssh_config is refused, not waited on: one line naming the inventory and the ssh_config."""
    cfg = tmp_path / "ssh_config"
    if config is None:
        os.mkfifo(cfg)
    else:
        cfg.write_text(config)
    with pytest.raises(FileError) as e:     # a FIFO opened to be read (no writer) would wait forever
        inventory.parse("hosts:\n  h: {address: h}\n", "inv.yaml", ssh_config=str(cfg))
    msg = str(e.value)
    assert msg.startswith(f"inv.yaml: ssh_config: {cfg}") and needle in msg and "\n" not in msg, msg


@pytest.mark.parametrize("jump", ["ops@b.invalid:" + "9" * 5000, "ops@b.invalid:99999", "b.invalid:0"])
@BOUNDED
def test_a_jump_port_outside_1_65535_is_refused_at_its_line(jump):
    refused(f"hosts:\n  h:\n    address: h.invalid\n    jump: {json.dumps(jump)}\n", 4,
            "hosts.h.jump: jump ")


def test_numbers_inside_their_bounds_load():
    inv = inventory.parse("hosts:\n  h: {address: h.invalid, port: 65535, connect_timeout: 0.1}\n"
                          "targets:\n  t: {host: h, vmid: 999999999, gpus: 1024, env: {A: 123456789012345678}}\n")
    t = inv.targets["t"]
    assert (t.vmid, t.gpus, t.env["A"], inv.hosts["h"].connect_timeout) == (999999999, 1024, "123456789012345678", 0.1)


def test_bounds_through_the_cli_are_one_line_exit_2(tmp_path):
    for text in (f"hosts:\n  h:\n    address: h.invalid\n    port: {BIG}\n",
                 'targets:\n  t:\n    env: {A: "x\\0y"}\n'):
        p = tmp_path / "hosts.yaml"
        p.write_text(text)
        r = cli("-i", p, "targets")
        assert r.returncode == 2 and r.stderr.startswith(f"dflash-ops: {p}:"), r.stderr
        assert "internal error" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_hostile_yaml_through_the_cli_is_one_line_exit_2(tmp_path):
    for text, needle in [("targets:\n  t:\n    python: !!python/name:os.system\n", ":3: targets.t.python: YAML tag"),
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
@BOUNDED
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
@BOUNDED
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
