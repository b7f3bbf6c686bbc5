"""The graphs engine (trainer/run/decode_graphs.py) against transformers and against the eager engine, on
a CPU: there nothing is captured (the same functions run uncaptured: `graphed` is False), so these
check the arithmetic of the static caches, the position masks and the round; the GPU measurement
(scripts/decode_engines_gpu.sh) checks the captured graphs against eager on the same prompts."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from trainer.model.drafter import Drafter  # noqa: E402
from trainer import specdec  # noqa: E402
from trainer.run.decode_graphs import GraphDecoder, StaticTarget, unsupported  # noqa: E402
from trainer.run.target import load_target  # noqa: E402

CPU = torch.device("cpu")
TEXTS = ("def f(x):\n    return x + 1\n", "import os\nimport sys\n", "class A:\n    def __init__(self):\n")


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return load_target("tiny", device=CPU, dtype=torch.float32)


def _drafter(target, *, block=8, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    d = Drafter(target.drafter_config(num_layers=2, block_size=block, mask_token_id=None))
    d.init_norm(target.head_weights()[1])
    d.borrow_target_head(*target.head_weights())
    return d.to(dtype=dtype).eval()


def _ids(target, text):
    return target.tokenizer.encode(text)


def test_the_static_target_computes_transformers_forward(target):
    """Prefill and then one token at a time over the static cache: the same greedy choices, top-2 margins
    and tapped features as transformers' own cached forward. The tolerance is float32 rounding (the
    difference measured here is ~3e-8; a wrong position, mask or RoPE moves features by ~1e-1)."""
    ids = _ids(target, TEXTS[0])
    st = StaticTarget(target, 64)
    choice, margin, feats = st.forward(torch.tensor([ids]), torch.arange(len(ids)))
    logits, hs, cache = target.decode(torch.tensor([ids]), hidden=True)
    ref = torch.cat([hs[i + 1] for i in target.layer_ids], dim=-1)[0]
    assert torch.equal(choice, logits[0].argmax(-1))
    top2 = logits[0].topk(2).values
    assert torch.allclose(margin, top2[:, 0] - top2[:, 1], atol=1e-4)
    assert torch.allclose(feats, ref, atol=1e-5)
    tok = int(choice[-1])
    for p in range(len(ids), len(ids) + 5):  # incremental steps see the cached prefix, nothing past p
        c, _, f = st.forward(torch.tensor([[tok]]), torch.tensor([p]))
        logits, hs, cache = target.decode(torch.tensor([[tok]]), cache, hidden=True)
        assert int(c[0]) == int(logits[0, -1].argmax())
        assert torch.allclose(f[0], torch.cat([hs[i + 1] for i in target.layer_ids], dim=-1)[0, -1], atol=1e-5)
        tok = int(c[0])


def test_stale_positions_past_the_prefix_are_never_seen(target):
    """A verify writes keys past the tokens it accepts; the next step at an earlier position must not see
    them: the same step after garbage was written ahead gives the same result."""
    ids = _ids(target, TEXTS[1])
    st = StaticTarget(target, 64)
    st.forward(torch.tensor([ids]), torch.arange(len(ids)))
    clean = st.forward(torch.tensor([[5]]), torch.tensor([len(ids)]))
    st.forward(torch.randint(0, 200, (1, 8)), torch.arange(len(ids) + 1, len(ids) + 9))  # ahead of the next step
    again = st.forward(torch.tensor([[5]]), torch.tensor([len(ids)]))
    assert all(torch.equal(x, y) for x, y in zip(clean, again))


@pytest.mark.parametrize("block", [4, 8])
def test_graphs_and_eager_decode_the_same_tokens_round_for_round(target, block):
    """On a CPU the graphs engine runs uncaptured (graphed False) and must agree with the eager engine
    token for token and round for round, on both decodes, with budgets that cut the last round short."""
    d = _drafter(target, block=block)
    prompts = [_ids(target, t) for t in TEXTS]
    g = GraphDecoder(target, d, max(map(len, prompts)) + 40)
    e = specdec.EagerDecoder(target, d)
    assert g.graphed is False
    for p in prompts:
        for n in (1, 7, 40):
            a, b = g.speculative(p, n), e.speculative(p, n)
            assert (a.tokens, a.produced, a.drafts) == (b.tokens, b.produced, b.drafts)
            ra, rb = g.target_alone(p, n), e.target_alone(p, n)
            assert ra.tokens == rb.tokens == a.tokens
            assert ra.margins == pytest.approx(rb.margins, abs=1e-4)


def test_a_decode_longer_than_the_caches_is_refused_by_name(target):
    """A budget-cut round verifies the full block past the budget: the caches hold it for any decode that
    fits max_len, the longest one included, and a longer one is refused before it writes anything."""
    d = _drafter(target, block=8)
    p = _ids(target, TEXTS[0])
    g = GraphDecoder(target, d, len(p) + 9)
    e = specdec.EagerDecoder(target, d)
    a, b = g.speculative(p, 9), e.speculative(p, 9)
    assert (a.tokens, a.produced, a.drafts) == (b.tokens, b.produced, b.drafts)
    for decode in (g.speculative, g.target_alone):
        with pytest.raises(ValueError, match="does not fit the static caches"):
            decode(p, 10)


def test_the_document_keeps_every_prompts_tokens_and_rounds_and_intervals_per_prompt(target):
    d = _drafter(target)
    prompts = [_ids(target, t) for t in TEXTS]
    lines = []
    doc = specdec.measure(target, d, prompts, max_new_tokens=12, warmup=0, resamples=500, log=lines.append)
    json.dumps(doc, allow_nan=False)
    assert doc["engine"] == "graphs" and doc["graphed"] is False and doc["strict"] and doc["lossless"]
    assert [len(r["tokens"]) for r in doc["per_prompt"]] == [12] * 3
    for r in doc["per_prompt"]:
        assert sum(r["rounds"]) == len(r["tokens"]) - 1  # the prompt's forward gives the first token
        assert len(r["accepted"]) == len(r["rounds"]) and r["equal"]
    assert doc["rounds"] == sum(len(r["rounds"]) for r in doc["per_prompt"])
    lo, hi = doc["tau_ci95"]
    assert lo <= doc["tau"] <= hi and doc["bootstrap"] == {"unit": "prompt", "resamples": 500, "seed": 0}
    assert doc["speedup_median"] is not None and doc["model"]["tau_for_2x_long_outputs"] > 0
    assert all(f"{i + 1}/3: 12 tokens, " in line for i, line in enumerate(lines[:3]))
    # both decodes in one mode, the fastest the engine has here (a CPU: uncaptured, not compiled)
    assert doc["mode"] == {"alone": "graphs (uncaptured)", "spec": "graphs (uncaptured)"} and not doc["compiled"]
    # every prompt's target-alone tokens are kept: equality is checked again from the document alone
    assert all(r["target_tokens"] == r["tokens"] for r in doc["per_prompt"])
    # the model: each step's cost timed alone, the prediction beside the measurement, the prompt's forward in both
    m = doc["model"]
    assert m["source"] == "each step replayed alone" and m["prompts"] == 3
    assert all(m["costs_ms"][k] > 0 for k in ("step", "draft", "verify", "extend", "round", "prefill_alone",
                                              "prefill_spec"))
    assert m["measured"]["alone_s"] == pytest.approx(sum(r["alone_s"] for r in doc["per_prompt"]))
    assert m["measured"]["speedup"] == pytest.approx(doc["speedup"])
    # a prompt with no rounds (one new token: the prompt's own forward) says so, not "tau 1.00"
    specdec.measure(target, d, prompts[:1], max_new_tokens=1, warmup=0, resamples=200, log=lines.append)
    assert "0 rounds, no rounds" in lines[-2]


def test_each_prompts_forward_runs_once_untimed_before_its_two_timed_decodes(target, monkeypatch):
    """A prompt length seen for the first time costs a per-shape set-up in its forward (on a GPU: a
    bucket's graph capture), paid by whichever decode runs first (docs/decoding.md, "Per prompt"). Each
    prompt's forward runs once untimed for each decode, so both timed decodes find its length warm, and
    each decode's prefill seconds are kept per prompt."""
    calls = []
    real = specdec.decoder

    class Spy:
        def __init__(self, dec):
            self.dec, self.graphed = dec, dec.graphed

        def speculative(self, p, n):
            calls.append(("spec", len(p), n))
            return self.dec.speculative(p, n)

        def target_alone(self, p, n):
            calls.append(("alone", len(p), n))
            return self.dec.target_alone(p, n)

    monkeypatch.setattr(specdec, "decoder", lambda *a, **k: Spy(real(*a, **k)))
    prompts = [_ids(target, t) for t in TEXTS]
    doc = specdec.measure(target, _drafter(target), prompts, max_new_tokens=8, warmup=0, resamples=200,
                          log=lambda s: None)
    assert calls == [c for p in prompts for c in (("spec", len(p), 1), ("alone", len(p), 1), ("spec", len(p), 8),
                                                  ("alone", len(p), 8))]
    for r in doc["per_prompt"]:
        assert 0 < r["spec_prefill_s"] < r["spec_s"] and 0 < r["alone_prefill_s"] < r["alone_s"]
    per = doc["prefill_ms_per_prompt"]
    assert per["spec"] == pytest.approx(1e3 * sum(r["spec_prefill_s"] for r in doc["per_prompt"]) / 3)
    assert per["alone"] == pytest.approx(1e3 * sum(r["alone_prefill_s"] for r in doc["per_prompt"]) / 3)


def test_in_bf16_a_difference_is_reported_with_the_targets_margin_not_fatal(target, monkeypatch):
    """bf16: a verify of 16 tokens and a 1-token step may round a near-tie apart, so a difference is a
    finding per prompt (first position, the target's top-2 margin there), not an exit; float32 is strict."""
    t16 = load_target("tiny", device=CPU, dtype=torch.bfloat16)
    d = _drafter(t16, dtype=torch.bfloat16)
    prompts = [_ids(t16, t) for t in TEXTS[:2]]
    monkeypatch.setenv("DFLASH_TRAINER_FAULTS", "specdec_differ=1")  # the target alone's last token changed
    doc = specdec.measure(t16, d, prompts, max_new_tokens=10, warmup=0, resamples=200, log=lambda s: None)
    assert not doc["strict"] and doc["lossless"] is False and doc["equal_prompts"] == 1
    row = doc["per_prompt"][1]
    assert row["equal"] is False and row["first_diff"] == 9 and row["margin"] is not None and row["margin"] >= 0
    assert row["target_tokens"][:9] == row["tokens"][:9]
    with pytest.raises(specdec.NotLossless, match="top-2 margin"):
        specdec.measure(target, _drafter(target), [_ids(target, t) for t in TEXTS[:2]], max_new_tokens=10, warmup=0,
                        resamples=200, log=lambda s: None)


def test_an_unsupported_target_is_named_and_eager_offered(target, monkeypatch):
    assert unsupported(target) is None
    monkeypatch.setattr(target.config, "layer_types", ["sliding_attention"] * target.num_layers, raising=False)
    assert "sliding" in unsupported(target)
    with pytest.raises(Exception, match="--engine eager"):
        GraphDecoder(target, _drafter(target), 32)
