"""Target.features stops after the last tapped layer and returns exactly what the whole forward did."""
from __future__ import annotations

import dataclasses
import threading

import pytest

torch = pytest.importorskip("torch")

from trainer.run.target import load_target  # noqa: E402
from tolerance import bound  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_target("tiny", device=torch.device("cpu"), dtype=torch.float32)


def _ids(seed: int = 0, B: int = 2, S: int = 24) -> torch.Tensor:
    return torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(seed))


def _full(target, ids):
    """The old features: the whole base model, hidden_states[i + 1] per tapped layer."""
    out = target.model.base_model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i + 1] for i in target.layer_ids], dim=-1)


@pytest.mark.parametrize("layers", [(1, 2, 3, 4, 5), (0,), (3,), (0, 7), (7,), (2, 6, 7), (5, 1)])
def test_truncated_features_equal_the_whole_forward(tiny, layers):
    """Bit for bit, including the last layer (whose hidden state HF returns after the final norm)."""
    t = dataclasses.replace(tiny, layer_ids=layers)
    ids = _ids()
    with torch.no_grad():
        want = _full(t, ids)
    got = t.features(ids)
    assert torch.equal(got, want)
    assert torch.equal(dataclasses.replace(t, truncate=False).features(ids), want)


def test_truncated_features_skip_the_layers_above_the_last_tap(tiny):
    ran = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(i))
             for i, layer in enumerate(tiny.model.base_model.layers)]
    norm = tiny.model.base_model.norm.register_forward_pre_hook(lambda *a: ran.append("norm"))
    try:
        dataclasses.replace(tiny, layer_ids=(1, 3)).features(_ids())
        assert ran == [0, 1, 2, 3]
        ran.clear()
        tiny.model.base_model(input_ids=_ids(), use_cache=False)  # outside features(): untouched
        assert ran == list(range(8)) + ["norm"]
    finally:
        for h in hooks + [norm]:
            h.remove()


def test_features_can_be_saved_for_the_drafters_backward(tiny):
    feats = tiny.features(_ids())
    assert not feats.requires_grad and not feats.is_inference()
    w = torch.randn(feats.shape[-1], 3, requires_grad=True)
    (feats @ w).sum().backward()  # saves feats: an inference-mode tensor would be refused here
    assert w.grad is not None


def test_threads_sharing_one_target_each_get_their_own_features(tiny):
    """Replicas on one device share a Target: one thread's truncated forward must not cut another's
    full forward short, nor see its hidden states."""
    ids = [_ids(seed) for seed in range(4)]
    with torch.no_grad():
        want = [_full(tiny, x) for x in ids]
    full = dataclasses.replace(tiny, truncate=False)  # the same model object
    got, errors = {}, []

    def work(k):
        try:
            for _ in range(5):
                got[k] = (full if k % 2 else tiny).features(ids[k])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for k in range(4):
        assert torch.equal(got[k], want[k])


def test_a_copy_on_another_device_keeps_the_setting_and_the_taps(tiny):
    t = dataclasses.replace(tiny, truncate=False)
    tiny.features(_ids())  # hooks installed before the copy
    c = t.to(torch.device("meta"))
    assert c.truncate is False and c.layer_ids == t.layer_ids and c.model is not t.model


def test_compiled_layers_give_eager_features_and_leave_other_callers_eager():
    """compile_layers(): one inductor graph for every layer (regional compilation), used only
    inside features(); eager=True and decode() stay eager; a copy drops the original's compiled
    forwards (they are bound to the original's weights)."""
    import torch._dynamo.utils as du

    from trainer.engine.numerics import rel_l2

    t = load_target("tiny", device=torch.device("cpu"), dtype=torch.float32)
    ids = _ids(3, B=2, S=32)
    want = t.features(ids)
    logits_before, _, _ = t.decode(ids[:, :6])
    graphs = du.counters["stats"]["unique_graphs"]
    t.compile_layers()
    assert t.compiled
    got = t.features(ids)
    assert du.counters["stats"]["unique_graphs"] - graphs == 1  # 8 layers, one graph
    # fp32 on the CPU: fused kernels reassociate the sums of 8 layers (hidden 64, MLP 128, 32 keys).
    # Features of a wrong layer or stale weights are off by O(1).
    assert rel_l2(got, want) <= bound(torch.float32, 8 * (4 * 64 + 16 + 32 + 64 + 128))
    assert not torch.equal(got, _full(t, _ids(4, B=2, S=32)))
    assert torch.equal(t.features(ids, eager=True), want)
    logits_after, _, _ = t.decode(ids[:, :6])
    assert torch.equal(logits_after, logits_before)  # decode ran the layers' own forward
    assert du.counters["stats"]["unique_graphs"] - graphs == 1
    c = t.to(torch.device("meta"))
    assert not c.compiled and all("forward" not in layer.__dict__ for layer in c.model.base_model.layers)
    assert all("forward" in layer.__dict__ for layer in t.model.base_model.layers)


def test_features_build_no_attention_mask_and_read_nothing_back(tiny, monkeypatch):
    """The prepared "no mask" mapping: transformers' per-call packed-sequence check (a host read of
    a device value, which no CUDA graph can be captured across) never runs, and the features are
    the whole forward's, which builds its mask the usual way."""
    import transformers.masking_utils as mu

    from trainer.run.target import _no_mask

    assert _no_mask(tiny.model.base_model) == {"attention_mask": {"full_attention": None}}
    calls = []
    real = mu.find_packed_sequence_indices
    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = _ids(3)
    got = tiny.features(ids)
    assert calls == []
    with torch.no_grad():
        want = _full(tiny, ids)
    assert calls, "the whole forward no longer checks for packed sequences: this test checks nothing"
    assert torch.equal(got, want)


def test_graph_features_change_nothing_off_a_gpu(tiny):
    t = dataclasses.replace(tiny)
    t.graph_features()
    ids = _ids(4)
    assert t.graphed and torch.equal(t.features(ids), tiny.features(ids)) and t._graphs == {}
    t._graphs["stand-in for a captured shape"] = False
    c = t.to(torch.device("meta"))  # a copy on another device captures its own graphs, if asked to
    assert not c.graphed and c._graphs == {} and t.graphed and t._graphs
