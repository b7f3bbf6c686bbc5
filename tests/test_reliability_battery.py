"""scripts/reliability_battery.py: which case a test reproduces, and the verdict per case."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "reliability_battery.py"
spec = importlib.util.spec_from_file_location("reliability_battery", SCRIPT)
battery = importlib.util.module_from_spec(spec)
spec.loader.exec_module(battery)


def test_every_named_test_exists():
    tests = Path(__file__).resolve().parent
    for _, _, named in battery.CASES:
        for t in named:
            file, _, prefix = t.partition("::")
            text = (tests / file).read_text()
            assert not prefix or f"def {prefix}" in text, t


def test_a_failure_breaks_its_case_and_a_skip_alone_is_not_held(tmp_path):
    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.test_inventory_limits" name="test_yaml_1_1_integer_spellings_are_refused[0310]"/>'
        '<testcase classname="tests.test_ssh_trust" name="test_a_revoked_key_is_refused_even_when_also_listed">'
        '<failure message="x"/></testcase>'
        '<testcase classname="tests.test_rank_mesh" name="test_a_rank_waiting_for_its_peers_ends_on_sigterm">'
        '<skipped message="no gloo"/></testcase>'
        '<testcase classname="tests.test_inventory_limits" name="test_good_names_load"/>'
        '</testsuite></testsuites>')
    v = battery.verdicts(junit)
    assert v["5"] == {"passed": 1, "failed": [], "skipped": []}
    assert v["6"]["failed"] == ["test_a_revoked_key_is_refused_even_when_also_listed"]
    assert battery.line("6", "known_hosts", v["6"]).split()[1] == "BROKE"
    assert battery.line("8", "nodes", v["8"]).split()[1:3] == ["not", "run"]
    assert battery.line("5", "ints", v["5"]).split()[1] == "held"
    assert battery.case_of("tests.test_inventory_limits", "test_good_names_load") is None
    # a test named by one case inside a file another case takes whole counts for the named one
    assert battery.case_of("tests.test_launch_safety", "test_stop_of_an_unknown_run_is_1_as_readme_says") == "9"
    assert battery.case_of("tests.test_launch_safety", "test_a_trainer_without_its_supervisor_is_shown") == "1"
