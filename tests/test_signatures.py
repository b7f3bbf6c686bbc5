"""The failure-signature catalog: every entry matches a real sample, nothing matches a clean log,
the streaming matcher agrees with whole-text scans, and a malformed catalog is refused clearly."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.errors import NotFound, UsageError
from orchestrator.targets.scan import scan_files
from trainer.signatures import (Catalog, CatalogError, Signature, WindowPattern, classify,
                                load_catalog, parse_catalog, scan_text, version_in)

DATA = Path(__file__).resolve().parent / "data"
SAMPLES = DATA / "signatures"
CLEAN = DATA / "clean_train.log"
REPO = Path(__file__).resolve().parent.parent


def samples_of(sig_id: str) -> list[Path]:
    """tests/data/signatures/<id>.txt and its variants <id>--<variant>.txt."""
    return sorted(p for p in SAMPLES.glob("*.txt") if p.stem.split("--")[0] == sig_id)


CATALOG = load_catalog()
IDS = CATALOG.ids


def test_catalog_loads_and_ids_are_unique():
    assert len(IDS) == len(set(IDS)) >= 20
    for sig in CATALOG:
        assert sig.severity in ("fatal", "warning")
        assert sig.line_patterns or sig.window_patterns
        assert sig.meaning and sig.remedy


def test_every_sample_file_names_a_catalog_entry():
    stray = [p.name for p in SAMPLES.glob("*.txt") if p.stem.split("--")[0] not in IDS]
    assert not stray, f"samples for unknown signatures: {stray}"


@pytest.mark.parametrize("sig_id", IDS)
def test_entry_matches_its_samples(sig_id):
    files = samples_of(sig_id)
    assert files, f"no sample in tests/data/signatures/{sig_id}.txt"
    sig = CATALOG.get(sig_id)
    for f in files:
        text = f.read_text()
        found = [s.id for _, s in CATALOG.scan_text(text)]
        assert sig_id in found, f"{f.name}: found {found}"
        # a fatal sample is NAMED by it, even when the text also holds what it leads to
        # (a trees assertion, then a segfault) or what wraps it (BackendCompilerFailed)
        if sig.fatal:
            assert classify(text, None) == sig_id, f.name
        else:
            assert classify(text, None) is None, f.name


@pytest.mark.parametrize("sig_id", IDS)
def test_every_pattern_is_exercised_by_a_sample(sig_id):
    """Each regex / multi-line pattern of an entry matches one of its samples on its own."""
    sig = CATALOG.get(sig_id)
    texts = [f.read_text() for f in samples_of(sig_id)]
    alone = [Signature(id=sig.id, severity=sig.severity, meaning="m", remedy="r", line_patterns=(rx,))
             for rx in sig.line_patterns]
    alone += [Signature(id=sig.id, severity=sig.severity, meaning="m", remedy="r", window_patterns=(wp,))
              for wp in sig.window_patterns]
    for one in alone:
        cat = Catalog((one,))
        pat = one.line_patterns or one.window_patterns
        assert any(cat.scan_text(t) for t in texts), f"{sig_id}: no sample exercises {pat}"


def test_clean_training_log_matches_nothing():
    text = CLEAN.read_text()
    assert len(text.splitlines()) > 30
    assert scan_text(text) == []
    assert classify(text, 0) is None
    assert all(CATALOG.match_line(line) is None for line in text.splitlines())


def test_trees_failure_in_thread_then_segfault_is_named_by_its_root_cause():
    text = (SAMPLES / "cudagraph-trees-tls.txt").read_text()
    hits = [(n, s.id) for n, s in scan_text(text)]
    assert ("segfault" in [i for _, i in hits]) and ("thread-died" in [i for _, i in hits])
    # reported on the line that completes the pattern: the bare AssertionError
    n = next(n for n, i in hits if i == "cudagraph-trees-tls")
    assert text.splitlines()[n - 1] == "AssertionError"
    assert classify(text, -11) == "cudagraph-trees-tls"


@pytest.mark.parametrize("code, expected", [(-11, "segfault"), (139, "segfault"), (-6, "abort"),
                                            (134, "abort"), (-9, "killed"), (137, "killed"),
                                            (1, None), (0, None), (None, None), (143, None)])
def test_exit_code_alone(code, expected):
    assert classify("", code) == expected
    assert classify("all fine\n", code) == expected


def test_match_line_is_single_line_only():
    assert CATALOG.match_line("RuntimeError: CUDA error: an illegal memory access was encountered").id \
        == "cuda-illegal-memory-access"       # the specific entry wins over generic cuda-error
    assert CATALOG.match_line("RuntimeError: CUDA error: misaligned address").id == "cuda-error"
    assert CATALOG.match_line("AssertionError") is None     # needs its traceback context
    # a re-record skip that mentions static inputs is the warning, not the fatal error
    line = ("skipping cudagraph due to function 3 exceeding max re-recording limit due to static input "
            "data pointer changed.")
    assert CATALOG.match_line(line).id == "cudagraph-skipped"


def test_window_pattern_needs_its_parts_close_together():
    far = "  File \"x/cudagraph_trees.py\", line 383, in get_obj\n" + "filler\n" * 10 + "AssertionError\n"
    assert "cudagraph-trees-tls" not in [s.id for _, s in scan_text(far)]
    near = "  File \"x/cudagraph_trees.py\", line 383, in get_obj\n    x\nAssertionError\n"
    assert [s.id for _, s in scan_text(near)] == ["cudagraph-trees-tls"]
    # an AssertionError from somewhere else is not the trees failure
    other = "  File \"model.py\", line 3, in forward\n    assert x.shape[0] == 2\nAssertionError\n"
    assert scan_text(other) == []


def test_one_traceback_counts_once():
    text = (SAMPLES / "cudagraph-trees-tls--get_obj.txt").read_text()   # both window patterns fit
    assert [s.id for _, s in scan_text(text)].count("cudagraph-trees-tls") == 1


ALL_SAMPLE_TEXT = "\n".join(p.read_text() for p in sorted(SAMPLES.glob("*.txt"))) + CLEAN.read_text()


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(ALL_SAMPLE_TEXT)), max_size=60))
def test_streaming_chunks_give_the_same_hits_as_a_whole_scan(cuts):
    """Live logs arrive in arbitrary chunks; the matcher must not care where they are cut."""
    text = ALL_SAMPLE_TEXT
    bounds = sorted(set([0, len(text), *cuts]))
    m = CATALOG.matcher()
    got = []
    for a, b in zip(bounds, bounds[1:]):
        got += m.feed_text(text[a:b])
    got += m.close()
    assert [(n, s.id) for n, s in got] == [(n, s.id) for n, s in CATALOG.scan_text(text)]


def test_signature_versions():
    trees = CATALOG.get("cudagraph-trees-tls")
    assert trees.affects("2.11.0+cu130") and trees.affects("2.5.1")
    assert not trees.affects("2.13.0") and not trees.affects("2.14.1+cu130")
    assert version_in("2.12.0a0+git123", ">=2.12")
    assert version_in("13.0", "13.0") and version_in("2.11.0", "2.11") and not version_in("2.1.0", "2.11")
    assert version_in("anything", "any")
    with pytest.raises(ValueError):
        version_in("2.11", "~>2")


# ---- validation -----------------------------------------------------------------------------

GOOD = """signatures:
  - id: x
    severity: fatal
    patterns: ['boom']
    meaning: m
    remedy: r
"""


@pytest.mark.parametrize("edit, needle", [
    (lambda s: s.replace("remedy: r", "remedy: r\n    colour: red"), r":2: signature 'x': unknown key\(s\) colour"),
    (lambda s: s.replace("['boom']", "['(unclosed']"), r"signature 'x': patterns: bad regex '\(unclosed'"),
    (lambda s: s.replace("fatal", "deadly"), r"severity: must be one of fatal, warning"),
    (lambda s: s.replace("    remedy: r\n", ""), r"remedy: missing"),
    (lambda s: s.replace("['boom']", "[{all: ['a', 'b']}]"),
     r"patterns: a multi-line pattern has exactly the keys all, within"),
    (lambda s: s.replace("['boom']", "[{all: ['a'], within: 0}]"), r"'within' must be a positive number"),
    (lambda s: s.replace("    remedy: r\n", "    remedy: r\n    torch: 'about 2.5'\n"), r"torch: bad version clause"),
    (lambda s: s.replace("id: x", "id: Bad_Id"), r"id: must be lowercase"),
    (lambda s: s + s.split("\n", 1)[1], r"signature 'x': id: duplicate"),
    (lambda s: s.replace("signatures:", "signature:"), r"only the key 'signatures'"),
    (lambda s: s + "  - [unbalanced\n", r"not valid YAML"),
])
def test_bad_catalog_is_refused_with_file_line_and_key(tmp_path, edit, needle):
    parse_catalog(GOOD, "ok.yaml")
    bad = tmp_path / "sigs.yaml"
    bad.write_text(edit(GOOD))
    with pytest.raises(CatalogError) as e:
        load_catalog(bad)
    assert str(bad) in str(e.value)
    assert re.search(needle, str(e.value)), str(e.value)


def test_missing_catalog_file(tmp_path):
    with pytest.raises(CatalogError, match="cannot read"):
        load_catalog(tmp_path / "nope.yaml")


def test_catalog_is_frozen_data():
    sig = CATALOG.get("segfault")
    with pytest.raises(AttributeError):
        sig.severity = "warning"  # type: ignore[misc]
    assert isinstance(CATALOG.get("cudagraph-trees-tls").window_patterns[0], WindowPattern)
    assert sig.as_dict()["exit_codes"] == [-11, 139]


def test_catalog_and_scan_need_no_torch():
    code = ("import sys, trainer.signatures, orchestrator.targets.scan; "
            "trainer.signatures.load_catalog(); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# ---- scan_files (dflash-ops scan) -----------------------------------------------------------

def test_scan_files_shape(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(CLEAN.read_text() + (SAMPLES / "cudagraph-trees-tls.txt").read_text()
                   + (SAMPLES / "cudagraph-skipped.txt").read_text())
    clean_lines = len(CLEAN.read_text().splitlines())
    out = scan_files([str(log), str(CLEAN)])
    assert set(out["files"]) == {str(log), str(CLEAN)}
    assert out["files"][str(CLEAN)] == []
    items = out["files"][str(log)]
    for item in items:
        assert set(item) >= {"line", "signature", "severity", "meaning", "remedy", "text"}
        assert isinstance(item["line"], int) and item["severity"] in ("fatal", "warning")
        assert log.read_text().splitlines()[item["line"] - 1] == item["text"]
        assert item["line"] > clean_lines
    ids = [i["signature"] for i in items]
    assert {"cudagraph-trees-tls", "segfault", "cudagraph-skipped"} <= set(ids)
    assert out["fatal"] == sum(i["severity"] == "fatal" for i in items) >= 2
    assert out["warnings"] == sum(i["severity"] == "warning" for i in items) >= 1
    assert out["signatures"]["cudagraph-trees-tls"] == 1


def test_scan_files_odd_bytes_and_crlf(tmp_path):
    log = tmp_path / "odd.log"
    log.write_bytes(b"ok \xff\xfe line\r\nprogress 10%\rprogress 20%\r\n"
                    b"RuntimeError: CUDA error: unspecified launch failure\r\n")
    items = scan_files([log])["files"][str(log)]
    assert [(i["line"], i["signature"]) for i in items] == [(3, "cuda-error")]
    assert items[0]["text"] == "RuntimeError: CUDA error: unspecified launch failure"


def test_scan_files_errors(tmp_path):
    with pytest.raises(NotFound, match="no such file"):
        scan_files([str(tmp_path / "missing.log")])
    with pytest.raises(UsageError, match="directory"):
        scan_files([str(tmp_path)])
    with pytest.raises(UsageError):
        scan_files([])
