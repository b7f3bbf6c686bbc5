"""The reliability battery: each fault case's reproductions, run as tests, and what held.

    .venv/bin/python scripts/reliability_battery.py            # minutes on 2 cores
    .venv/bin/python scripts/reliability_battery.py --list     # the cases and their tests, no run

Every case is a fault that once broke the tool (a killed agent, a hostile inventory, an unsafe
workdir, a loopback training address, ...). Its reproductions are ordinary tests in tests/ that run
against the real loopback sshd and the pct stand-in; this script runs them in one pytest call and
prints one line per case: held (every reproduction passed), BROKE (which did not), or not run
(skipped, with why). Exit 0 when every case held.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (case, what broke, the tests that reproduce it: "file.py" or "file.py::name-prefix")
CASES = (
    ("1", "runs agent SIGKILLed at each point of the launch: no orphan trainer, no double-booked slot",
     ("test_runs_agent_launch.py::test_a_launch_killed_at_any_point", "test_launch_safety.py")),
    ("2", "inventory without bounds: 50 MB, /dev/zero, deep nesting, python tags",
     ("test_inventory_limits.py::test_what_is_not_plain_data", "test_inventory_limits.py::test_size_limit",
      "test_inventory_limits.py::test_hostile_yaml", "test_inventory_limits.py::test_playbooks_have")),
    ("3", "unsafe workdir: /, /etc, .., ~ resolving to /; //etc, //, /usr/../etc normalised first (controller, agent)",
     ("test_inventory_limits.py::test_unsafe_workdirs", "test_inventory_limits.py::test_home_is_resolved")),
    ("4", "target names that cannot be used, or shadow a run id",
     ("test_inventory_limits.py::test_names_outside", "test_inventory_limits.py::test_a_target_named_like")),
    ("5", "YAML 1.1 integer spellings (0310, 0xC8, 3:20, 2_00)",
     ("test_inventory_limits.py::test_yaml_1_1_integer",)),
    ("6", "OpenSSH's known_hosts: markers, @revoked, @cert-authority, hashed entries",
     ("test_ssh_trust.py::test_markers", "test_ssh_trust.py::test_hashed", "test_ssh_trust.py::test_a_revoked",
      "test_ssh_trust.py::test_a_host_certificate")),
    ("7", "logs of a job on several nodes: a follower that raises must not hang it",
     ("test_follow_fan_in.py",)),
    ("8", "two nodes whose hostname resolves to loopback; ranks that cannot meet; a job whose node failed, froze "
          "or was stopped mid-collective ends on every node within seconds",
     ("test_node_network.py", "test_rank_mesh.py", "test_nodes.py::test_a_node_whose_ranks",
      "test_nodes.py::test_ranks_that_cannot_meet", "test_job_ends_as_one.py",
      "test_follow_fan_in.py::test_the_first_failure_is")),
    ("9", "smaller: exec 128+N on the node, disk full in blocks, sparse files, names faking lines, stop 102, "
          "outages counted",
     ("test_exec_env.py::test_a_command_killed_by_a_signal", "test_deploy_reliability.py::test_many_small_files",
      "test_deploy_reliability.py::test_a_sparse_file", "test_launch_safety.py::test_stop_of_an_unknown_run",
      "test_launch_safety.py::test_follow_counts_outages")),
    ("10", "two writers of one output (regen --out, export -o): the second refused by name, a dead one's taken over",
     ("test_writer_lock.py", "test_small_target.py::test_a_second_regen_of_the_same_out")),
    ("11", "prompts: empty, lone surrogate, 10 MB refused at file:line; what tokenizer or context cannot take: skipped",
     ("test_small_target.py::test_rows_no_tokenizer", "test_small_target.py::test_a_row_the_tokenizer_refuses",
      "test_small_target.py::test_a_row_longer_than", "test_regen_remote.py::test_a_bad_prompts_file")),
    ("12", "export -o / or . refused before the transfer; partials of dead exports swept; a full disk named",
     ("test_export_remote.py::test_export_streams_the_latest", "test_export_remote.py::test_an_output_that_holds")),
    ("13", "a run that filled the disk named disk full, not killed with SIGKILL",
     ("test_runs_agent.py::test_a_run_that_filled_the_disk",)),
    ("14", "a playbook value landing in \"...\", '...' or a comment of a step's script: literal text, never run; "
           "a here-document or $'...' refused",
     ("test_play.py::test_a_value_lands_in_the_script", "test_play.py::test_a_template_where_no_quoting")),
    ("15", "rm of one node's half of a job: the whole job removed, on every node",
     ("test_nodes.py::test_two_nodes_train_one_job",)),
    ("16", "a launch's upload (regen's prompts) killed midway: no run; what the dead agent left swept by the next",
     ("test_runs_agent_launch.py::test_an_upload_killed_midway",)),
    ("17", "a play killed in a step: the steps that ended recorded, --from resumes; a second player refused",
     ("test_play.py::test_one_player_per_playbook",)),
    ("18", "exec interrupted: Ctrl-C, SIGTERM or SIGKILL of the controller left the command running on the target",
     ("test_exec_signals.py",)),
    ("19", "bench-decode outliving its controller (SIGKILL, SIGTERM, Ctrl-C), its agent or worker killed: nothing "
           "left running, slot free, no folder left; status shows it, stop ends it",
     ("test_bench_decode_remote.py::test_bench_decode_measures_a_trained_run",
      "test_transport_ssh.py::test_a_held_stdin_stays_open")),
    ("20", "a play interrupted mid-step (Ctrl-C, SIGTERM, SIGKILL): it hung (Ctrl-C) or died (SIGTERM) with the step's "
           "command running on; now the command ended, one line, lock free, steps that ended recorded, --from resumes",
     ("test_play_signals.py",)),
    ("21", "export's controller, agent or worker killed (INT, TERM, KILL) while the target exports or mid-transfer: "
           "the agent ran on; now nothing left running, no partial that looks whole, the next export sweeps",
     ("test_export_signals.py",)),
    ("22", "numbers, bytes and files the loader let through: a 5000-digit port/vmid/gpus/connect_timeout (a "
           "ValueError crash), 1.0e+400 / 1.0e-320, a NUL in env:, a FIFO as inventory, playbook, prompts, --config "
           "or ssh_config (waited forever), ssh_config and jump ports out of range: one line FILE:LINE, exit 2",
     ("test_inventory_limits.py::test_numbers_and_text_outside", "test_inventory_limits.py::test_bounds_through",
      "test_inventory_limits.py::test_what_is_not_a_regular_file", "test_inventory_limits.py::test_the_ssh_config_is",
      "test_inventory_limits.py::test_a_jump_port_outside", "test_launch_options.py::test_a_config_is_a_bounded")),
    ("23", "one bad state file on the target (run.json 100k levels deep, a list, cut short; exit.json of wrong types) "
           "broke status, logs, prune and rm for the whole target: now that run is unreadable with the reason, every "
           "other run works, rm removes it; replies and log lines bounded the same way",
     ("test_runs_agent.py::test_a_bad_state_file_makes", "test_runs_agent.py::test_an_unreadable_run_whose_slot",
      "test_runs_agent.py::test_state_files_are_read_in_one_place", "test_launch_safety.py::test_a_bad_state_file_on",
      "test_agent.py::test_a_reply_that_is_not", "test_runs_unit.py::test_a_log_line_nested_beyond")),
    ("24", "refusals that disagreed: --gpus beyond the target exit 1 where --gpu-ids -1 was 2; a --var reading a "
           "step's result or not UTF-8 failed in the step: every impossible request and --var problem is exit 2, "
           "before any step",
     ("test_runs_unit.py::test_launch_refuses_more_gpus", "test_launch_options.py::test_the_spec_is_one_document",
      "test_play.py::test_every_var_problem", "test_exec_env.py::test_env_is_one_argv")),
    ("25", "export -o DIR --force replaced whatever DIR held (a home folder, through export and through play's "
           "train.yaml): only an earlier export (or an empty folder) is replaced, atomically; anything else is "
           "refused, untouched",
     ("test_owned.py", "test_export_provenance.py::test_an_existing_output_folder_needs_force",
      "test_export_remote.py::test_export_streams_the_latest")),
    ("26", "output without bounds: exec --json of 300 MB took 5.8 GB, two targets of 100 MB without newlines 219 s, "
           "a play step's record held its 80 MB twice: 1 MiB kept per stream and target, linear time",
     ("test_exec_output.py",)),
    ("27", "launch and regen interrupted at the controller (Ctrl-C, SIGTERM, SIGKILL) with the agent held at a point "
           "of the launch: Ctrl-C hung until the agent's call ended (a regen's upload went on, its run started) and "
           "said nothing; now the connection closes at once, one line names the run that may have started (130 / "
           "143), and the run runs holding its slot or nothing does; the next launch works",
     ("test_controller_signals.py::test_a_launch_interrupted", "test_controller_signals.py::test_a_regen_interrupted")),
    ("28", "logs --follow interrupted (INT, TERM, KILL): the run goes on, no follow agent left, SIGTERM says so as "
           "Ctrl-C does (it died silently); the node's sshd killed under a follow (it resumes) and an exec (one "
           "line, exit 1, the command's group ended); the next command works",
     ("test_controller_signals.py::test_a_follow_interrupted", "test_controller_signals.py::test_sshd_killed")),
    ("29", "rm of a running run (exit 1) and of an id that is a path (../x, /srv/ct/dflash/x, ..: exit 2): nothing "
           "removed",
     ("test_controller_signals.py::test_rm_refuses",)),
    ("30", "prompts files: a million tiny rows (the controller kept them all: 626 MB, 25 s), a line without end (read "
           "whole), raw NUL bytes and bytes not UTF-8 (no column), JSON cut short (wrong column): streamed, one line "
           "FILE:LINE, exit 2 at the controller and in trainer.regen (before torch loads)",
     ("test_prompts_files.py",)),
    ("31", "scale: play --dry-run of a 10,000-step playbook took 31 s (5,000: 5.5 s), each step rebuilding the set "
           "of the names before it: linear now (10,000 steps 2.8 s)",
     ("test_play.py::test_a_playbook_of_many_steps",)),
    ("-", "earlier rounds: overlapping deploys, dead deploys, damaged releases, full disks",
     ("test_deploy_reliability.py::test_overlapping", "test_deploy_reliability.py::test_a_dead_deploy",
      "test_deploy_reliability.py::test_damage", "test_deploy_reliability.py::test_a_full_disk")),
)


def selected(tests: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(files, -k name prefixes) that pytest must run for these tests."""
    files = sorted({t.split("::")[0] for t in tests})
    return files, [t.split("::")[1] for t in tests if "::" in t]


def case_of(classname: str, name: str) -> str | None:
    """The case a junit testcase (classname `tests.test_x`, name `test_y[param]`) reproduces."""
    file = classname.rsplit(".", 1)[-1] + ".py"
    matches = [(len(prefix), case) for case, _, tests in CASES for f, _, prefix in (t.partition("::") for t in tests)
               if f == file and name.startswith(prefix)]
    return max(matches)[1] if matches else None    # the most specific: a named test over its whole file


def verdicts(junit: Path) -> dict[str, dict]:
    """{case: {"passed": n, "failed": [names], "skipped": [reasons]}} from a junit XML report."""
    out = {case: {"passed": 0, "failed": [], "skipped": []} for case, _, _ in CASES}
    for tc in ET.parse(junit).getroot().iter("testcase"):
        case = case_of(tc.get("classname", ""), tc.get("name", ""))
        if case is None:
            continue
        if tc.find("failure") is not None or tc.find("error") is not None:
            out[case]["failed"].append(tc.get("name"))
        elif (skip := tc.find("skipped")) is not None:
            out[case]["skipped"].append(skip.get("message", "skipped"))
        else:
            out[case]["passed"] += 1
    return out


def line(case: str, what: str, v: dict) -> str:
    if v["failed"]:
        state = f"BROKE ({', '.join(v['failed'])})"
    elif v["passed"]:
        state = f"held ({v['passed']} reproductions" + (f", {len(v['skipped'])} skipped)" if v["skipped"] else ")")
    else:
        state = "not run" + (f" ({v['skipped'][0]})" if v["skipped"] else "")
    return f"{case:>2}  {state:<28}  {what}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="print the cases and their tests; run nothing")
    a = p.parse_args(argv)
    if a.list:
        for case, what, tests in CASES:
            print(f"{case:>2}  {what}\n      " + "\n      ".join(tests))
        return 0
    files, prefixes = set(), []
    for _, _, tests in CASES:
        f, k = selected(tests)
        files.update(f)
        prefixes += k
    whole = {t.split("::")[0] for _, _, tests in CASES for t in tests if "::" not in t}
    # a file named whole runs whole; others only their named tests
    keep = " or ".join(sorted(set(prefixes)) + [f.removesuffix(".py") for f in sorted(whole)])
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "-k", keep,
               *(f"tests/{f}" for f in sorted(files))]
        print("running:", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
        if not junit.exists():
            print("reliability_battery: pytest wrote no report", file=sys.stderr)
            return 2
        result = verdicts(junit)
    for case, what, _ in CASES:
        print(line(case, what, result[case]))
    return 0 if all(v["passed"] and not v["failed"] for v in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
