"""benchmarks/decode_engines.py on the stored H200 measurements: ENGINES_1203
(docs/data/decode-engines-h200-2026-12-03), the run that found the per-prompt set-up, ENGINES_1203B
(docs/data/decode-engines-h200-2026-12-03b), the same recipe with each prompt's forward warmed, and
ENGINES_1205 (docs/data/decode-engines-h200-2026-12-05), both decodes compiled: the figures
docs/benchmarks.md section 16, docs/decoding.md,
docs/fidelity.md and docs/recipe.md quote come out of them, recomputed, and the current ones are found in
those documents as written."""
from __future__ import annotations

import contextlib
import io
import json
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from decode_engines import bar_scale, figures, main  # noqa: E402

ENGINES_1203 = REPO / "docs" / "data" / "decode-engines-h200-2026-12-03"
ENGINES_1203B = REPO / "docs" / "data" / "decode-engines-h200-2026-12-03b"  # the same recipe, prompts warmed
ENGINES_1205 = REPO / "docs" / "data" / "decode-engines-h200-2026-12-05"   # best against best: both compiled
ENGINES_1205B = REPO / "docs" / "data" / "decode-engines-h100-2026-12-05b"  # the same, both dtypes whole, an H100
SHAPES = REPO / "docs" / "data" / "decode-shapes-h200" / "qwen3-8b-bf16.json"


def test_the_stored_measurement_gives_the_documented_figures(capsys):
    assert main([str(ENGINES_1203), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    bf16, fp32, eager = rows["graphs-bf16"], rows["graphs-fp32"], rows["eager-fp32"]
    assert (bf16["prompts"], fp32["prompts"], eager["prompts"]) == (240, 240, 20)
    assert round(bf16["speedup"], 2) == 1.48 and [round(x, 2) for x in bf16["speedup_ci95"]] == [1.41, 1.55]
    assert round(bf16["tau"], 2) == 2.83 and round(bf16["model"]["tau_for_2x"], 2) == 3.14
    assert fp32["equal"] == 240 and bf16["equal"] == 132 and max(bf16["margins_where_differ"]) == 0.125
    assert round(eager["speedup"], 2) == 1.90 and round(rows["graphs-bf16@20"]["speedup"], 2) == 1.23
    # made before prefill was kept per prompt: what the rounds and the steps leave of the totals
    spec, alone = bf16["prefill_ms_per_prompt"]
    assert spec == pytest.approx(38.5, abs=0.05) and alone == pytest.approx(15.6, abs=0.05)


@pytest.fixture(scope="module")
def warmed() -> dict:
    """decode_engines.py's rows of ENGINES_1203B, once for the tests below (10,000 resamples each)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(ENGINES_1203B), "--json"]) == 0
    return json.loads(out.getvalue())


def test_the_warmed_measurement_gives_the_documented_figures(warmed):
    bf16, fp32 = warmed["graphs-bf16"], warmed["graphs-fp32"]
    assert set(warmed) == {"graphs-bf16", "graphs-fp32"}     # no eager run, so no run cut to its prompts
    assert (bf16["prompts"], fp32["prompts"]) == (240, 240)
    assert round(bf16["speedup"], 2) == 1.70 and [round(x, 2) for x in bf16["speedup_ci95"]] == [1.63, 1.78]
    assert round(bf16["speedup_median"], 2) == 1.54
    assert round(bf16["tau"], 2) == 2.90 and [round(x, 2) for x in bf16["tau_ci95"]] == [2.77, 3.04]
    assert round(bf16["model"]["speedup"], 2) == 1.82 and round(bf16["model"]["tau_for_2x"], 2) == 3.19
    assert round(bf16["ms_per_round"]["all"], 2) == 3.43 and round(bf16["ms_per_round"]["host"], 2) == 0.13
    margins = bf16["margins_where_differ"]
    assert bf16["equal"] == 137 and max(margins) == 0.125 and margins.count(0.0) == 48
    assert fp32["equal"] == 240 and fp32["margins_where_differ"] == []    # lossless
    assert round(fp32["speedup"], 2) == 1.40 and [round(x, 2) for x in fp32["speedup_ci95"]] == [1.34, 1.46]
    assert round(fp32["tau"], 2) == 2.88 and round(fp32["model"]["tau_for_2x"], 2) == 3.96
    docs = {k: json.loads((ENGINES_1203B / f"specdec-{k}.json").read_text()) for k in warmed}
    assert all(d["lossless"] is (k == "graphs-fp32") for k, d in docs.items())
    # 2x at this round cost: 2 x a round / a token alone, both as the document measured them
    doc = docs["graphs-bf16"]
    assert round(2 * doc["ms_per_round"]["all"] / doc["target_ms_per_token"], 2) == 3.19
    assert round(doc["target_ms_per_token"], 2) == 2.15
    # the first 20 prompts, where ENGINES_1203's eager run stopped
    first = {k: figures(d, 20) for k, d in docs.items()}
    assert [round(first[k]["speedup"], 2) for k in docs] == [1.56, 1.34] and first["graphs-bf16"]["equal"] == 8


def test_the_warmed_measurement_left_no_first_seen_cost(warmed):
    """ENGINES_1203's bf16 decode paid ~60 ms at a prompt length seen first (~16 after): with each prompt's forward run
    once untimed, the timed forwards are alike with and without the drafter, first-seen lengths included."""
    bf16 = warmed["graphs-bf16"]
    assert [round(x, 1) for x in bf16["prefill_ms_per_prompt"]] == [19.7, 18.8]
    rows = json.loads((ENGINES_1203B / "specdec-graphs-bf16.json").read_text())["per_prompt"]
    seen: set[int] = set()
    first = []
    for r in rows:
        first.append(r["prompt_tokens"] not in seen)
        seen.add(r["prompt_tokens"])

    def median_ms(key: str, which: bool | None = None) -> float:
        return round(statistics.median(1e3 * r[key] for r, f in zip(rows, first) if which in (None, f)), 1)

    assert (median_ms("spec_prefill_s"), median_ms("alone_prefill_s")) == (17.5, 17.1)
    assert sum(first) == 108
    assert (median_ms("spec_prefill_s", True), median_ms("alone_prefill_s", True)) == (17.2, 16.9)


DOCS = REPO / "docs"



def _text(name: str) -> str:
    return " ".join((DOCS / name).read_text().replace("**", "").split())    # bold and line wraps aside


def _x(block: dict) -> str:
    lo, hi = block["speedup_ci95"]
    return f"{block['speedup']:.2f}x ({lo:.2f}-{hi:.2f}"


def test_the_documents_lead_with_the_lossless_figure_and_label_the_bf16_one(warmed):
    """The figures the documents quote, recomputed from ENGINES_1203B's documents by decode_sample (the same
    code specdec's summary uses): the lossless float32 headline (one-token prompts left out) and
    the figure without loops, each where it is quoted; bf16's figure never without its "K/N equal"
    label; the best-against-best estimate and the tau 2x needs with the prompt's forward in."""
    from trainer.run.decode_model import RoundCosts, tau_for
    from trainer.run.decode_sample import split_figures

    docs = {k: json.loads((ENGINES_1203B / f"specdec-{k}.json").read_text()) for k in ("graphs-fp32", "graphs-bf16")}
    fp, bf = (split_figures(docs[k]["per_prompt"], resamples=10_000, seed=0) for k in docs)
    head, bare, bf_head = fp["excluding_one_token"], fp["excluding_one_token_and_loops"], bf["excluding_one_token"]
    assert fp["all"]["lossless"] and not bf["all"]["lossless"] and bf["all"]["equal_prompts"] == 137
    d = docs["graphs-bf16"]
    best = 0.9529130383858759 / (d["ms_per_round"]["all"] / d["tau"])   # the compiled target alone
    m, pre = d["ms_per_round"], d["prefill_ms_per_prompt"]
    costs = RoundCosts(step=d["target_ms_per_token"] / 1e3, draft=m["draft"] / 1e3, verify=m["verify"] / 1e3,
                       extend=m["extend"] / 1e3, round=m["all"] / 1e3, prefill_alone=pre["alone"] / 1e3,
                       prefill_spec=pre["spec"] / 1e3)
    rows = d["per_prompt"]
    need = tau_for(costs, 2.0, round(sum(r["alone_tokens"] for r in rows) / len(rows)))
    label = f"137/240 equal (near-ties, max margin {bf['all']['max_margin']:.3g}"
    want = {"decoding.md": [_x(head), _x(bare), _x(bf_head), label, f"{best:.2f}x", f"2x needs tau {need:.2f}"],
            "fidelity.md": [_x(head), _x(bare), label, f"{best:.2f}x", f"2x needs tau {need:.2f}"],
            "benchmarks.md": [_x(head), _x(bare), label, f"{best:.2f}x", f"tau {need:.2f}"],
            "recipe.md": [f"{head['speedup']:.2f}x lossless", f"2x needs tau {need:.2f}"],
            "trainer.md": [f"{head['speedup']:.2f}x lossless", f"{best:.2f}x"]}
    for name, strings in want.items():
        text = _text(name)
        missing = [x for x in strings if x not in text]
        assert not missing, (name, missing)
        # the lossless figure comes before any bf16 one, and a bf16 figure is never quoted without its label
        assert text.index(f"{head['speedup']:.2f}x") < text.index(f"{bf_head['speedup']:.2f}x"), name
        for hit in (i for i in range(len(text)) if text.startswith(f"{bf['all']['speedup']:.2f}x", i)):
            assert "137/240" in text[max(0, hit - 300): hit + 300], (name, text[hit - 80: hit + 40])



def test_the_best_against_best_figures_come_from_the_compiled_run_and_the_8b_shape():
    """The current figures the documents quote, recomputed: ENGINES_1205's lossless headline and the same
    without loops (decode_sample, from every prompt's rounds and seconds), the tau 2x needs at its costs
    with the prompt's forward in, and what ENGINES_1205's tau predicts at Qwen3-8B's measured step costs."""
    from trainer.run.decode_model import RoundCosts, speedup_at, tau_for
    from trainer.run.decode_sample import split_figures

    doc = json.loads((ENGINES_1205 / "specdec-graphs-fp32.json").read_text())
    assert doc["mode"] == {"alone": "graphs+compile", "spec": "graphs+compile"} and doc["dtype"] == "float32"
    fp = split_figures(doc["per_prompt"], resamples=10_000, seed=0)
    head, bare = fp["excluding_one_token"], fp["excluding_one_token_and_loops"]
    assert fp["all"]["lossless"] and fp["all"]["equal_prompts"] == 240
    model = doc["model"]
    need = tau_for(RoundCosts.from_ms(model["costs_ms"]), 2.0,
                   model["new_tokens"])
    assert need == pytest.approx(model["tau_for_2x"])
    shapes = json.loads(SHAPES.read_text())
    sc = RoundCosts.from_ms(shapes["costs_ms"])
    at8b = speedup_at(sc, doc["tau"], shapes["new_tokens"])
    need8b = tau_for(sc, 2.0, shapes["new_tokens"])
    x, xb = _x(head), _x(bare)
    want = {"decoding.md": [x, xb, f"2x needs tau {need:.2f}", f"{at8b:.2f}x", f"tau {need8b:.2f}",
                            f"verify / step {shapes['verify_over_step']:.2f}"],
            "fidelity.md": [x, xb, f"2x needs tau {need:.2f}", f"{at8b:.2f}x", f"tau {need8b:.2f}"],
            "benchmarks.md": [x, xb, f"tau {need:.2f}", f"{at8b:.2f}x"],
            "recipe.md": [f"{head['speedup']:.2f}x lossless", f"2x needs tau {need:.2f}", f"{at8b:.2f}x"],
            "trainer.md": [f"{head['speedup']:.2f}x lossless", f"{at8b:.2f}x"]}
    for name, strings in want.items():
        missing = [s for s in strings if s not in _text(name)]
        assert not missing, (name, missing)


def test_the_h100_run_gives_both_dtypes_figures_where_they_are_quoted_bf16_always_labelled():
    """ENGINES_1205B (G10): the three figures of each dtype (all prompts, the headline without one-token prompts,
    without loops too), recomputed from every prompt's rounds and seconds, are in the documents that quote G10;
    the table's rows (decode_engines.py) name the compiled mode; every bf16 figure sits beside its "139/240
    equal" label, and the lossless float32 figure comes first."""
    from trainer.run.decode_sample import split_figures

    docs = {k: json.loads((ENGINES_1205B / f"specdec-graphs-{k}.json").read_text()) for k in ("fp32", "bf16")}
    assert all(d["mode"] == {"alone": "graphs+compile", "spec": "graphs+compile"} for d in docs.values())
    fp, bf = (split_figures(docs[k]["per_prompt"], resamples=10_000, seed=0) for k in docs)
    assert fp["all"]["lossless"] and fp["all"]["equal_prompts"] == 240
    assert not bf["all"]["lossless"] and bf["all"]["equal_prompts"] == 139 and bf["all"]["max_margin"] == 0.125
    quoted = [_x(fp[k]) for k in ("all", "excluding_one_token", "excluding_one_token_and_loops")]
    bf_quoted = [_x(bf[k]) for k in ("all", "excluding_one_token", "excluding_one_token_and_loops")]
    assert quoted == ["1.09x (1.04-1.13", "1.09x (1.05-1.13", "1.05x (1.01-1.09"], quoted
    assert bf_quoted == ["1.51x (1.46-1.57", "1.52x (1.46-1.58", "1.45x (1.40-1.51"], bf_quoted
    for name in ("benchmarks.md", "decoding.md"):
        text = _text(name)
        missing = [x for x in quoted + bf_quoted if x not in text]
        assert not missing, (name, missing)
        at = text.index("G10, both compiled under graphs")
        assert text.index(quoted[1], at) < text.index(bf_quoted[1], at), name
        for x in bf_quoted:
            for hit in (i for i in range(len(text)) if text.startswith(x, i)):
                assert "139/240" in text[max(0, hit - 300): hit + 300], (name, x)
    fidelity = _text("fidelity.md")
    assert quoted[1] in fidelity and bf_quoted[1] in fidelity and "139/240 equal" in fidelity
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(ENGINES_1205B)]) == 0
    rows = [line for line in out.getvalue().splitlines() if line.startswith("| graphs-")]
    assert [r.split(" | ")[1] for r in rows] == ["graphs+compile, bfloat16", "graphs+compile, float32"], rows


def test_a_bench_decode_document_reads_as_specdecs(tmp_path, capsys):
    """`dflash-ops bench-decode --json` keeps specdec's round-cost model as cost_model ("model" is the run's
    --target there): the table reads it from either."""
    doc = json.loads((ENGINES_1203 / "specdec-graphs-bf16.json").read_text())
    bench = {**doc, "model": "small-code-gpu", "cost_model": doc["model"], "target": "ct200"}
    (tmp_path / "specdec-bench.json").write_text(json.dumps(bench))
    assert main([str(tmp_path), "--json"]) == 0
    assert round(json.loads(capsys.readouterr().out)["bench"]["model"]["tau_for_2x"], 2) == 3.14


def test_a_folder_of_graphs_runs_alone_plots_on_a_linear_axis(tmp_path, capsys):
    """ENGINES_1203B (2026-12-03b) made no eager run: the table and the plot come out of the two graphs documents,
    whose bars (~1.4 to ~2.3 ms) a log axis would cut off near the shortest; eager beside them keeps it."""
    pytest.importorskip("matplotlib")
    assert main([str(ENGINES_1203B), "-o", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines()[2:]] == ["| graphs-bf16",
                                                                                           "| graphs-fp32"]
    assert bar_scale([2.31, 1.36, 2.33, 1.67]) == "linear" and bar_scale([2.29, 1.55, 17.2, 9.1]) == "log"


def test_a_folder_without_documents_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no specdec-*.json" in capsys.readouterr().err


@pytest.mark.parametrize("folder, speedup, need", [(ENGINES_1203, "1.48x", "3.14"), (ENGINES_1203B, "1.70x", "3.19")])
def test_the_closing_lines_say_what_tau_2x_needs_where_it_was_not_reached(folder, speedup, need):
    """specdec's closing line and bench-decode's summary on the stored bf16 documents (ENGINES_1203,
    ENGINES_1203B): the tau at which these round costs would give 2x; a document at 2x or more says nothing of it."""
    pytest.importorskip("torch")
    from orchestrator.runs.bench_decode import summary
    from trainer.specdec import result_line

    doc = json.loads((folder / "specdec-graphs-bf16.json").read_text())
    # bench-decode's document: "model" is the run's --target, specdec's model of the costs "cost_model"
    bench = {**doc, "target": "ct200", "model": "small-code-gpu", "cost_model": doc["model"], "run": "R",
             "step": 5700, "prompts_source": "held-out"}
    for line in (result_line(doc), summary(bench)):
        assert f"speedup {speedup}" in line and f"; 2x needs tau {need}" in line, line
    fast = {"speedup": 2.1}
    assert "needs tau" not in result_line({**doc, **fast}) and "needs tau" not in summary({**bench, **fast})
