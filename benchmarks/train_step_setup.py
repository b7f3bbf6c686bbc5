"""What train_step_bench.py's step runs on: the Qwen3-8B-shaped target with random weights built on
the device, the shapes, the batches, the clock around the target forward, and the checks that the
target's fast forwards (truncated, compiled, graphed) give the features they should."""
from __future__ import annotations

import threading
import time

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
SHAPES = {
    "8b": dict(layers=(1, 9, 17, 25, 33), draft_layers=5, batch=2, seq=768, anchors=256, block=16),
    # the trainer's `tiny` target (8 layers, hidden 64) with its default layers
    "tiny": dict(layers=None, draft_layers=2, batch=2, seq=128, anchors=8, block=16),
}


def build_target(args, device):
    """The frozen target on `device`, wrapped in trainer.run.target.Target."""
    import torch

    from trainer.run.target import Target, load_target

    if args.tiny:
        t = load_target("tiny", device=device, dtype=torch.float32)
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        # bf16 on a GPU, as the trainer loads a target; fp32 on the CPU (--cpu, tests), as it would there
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        cfg = Qwen3Config(**QWEN3_8B, attn_implementation="sdpa")
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # allocate bf16 from the start: 16 GB, not 33
        try:
            torch.manual_seed(0)
            with torch.device(device):
                model = Qwen3ForCausalLM(cfg)
        finally:
            torch.set_default_dtype(before)
        model = model.to(dtype=dtype).eval()  # as load_target does (casts the rotary buffer too)
        for p in model.parameters():
            p.requires_grad_(False)
        t = Target(model, None, SHAPES["8b"]["layers"], "qwen3-8b-random", "random")
    return t


class FeatureClock:
    """Times Target.features in whichever worker thread calls it: CUDA events on a GPU (read after
    the step's synchronize), the host clock on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.inference = False  # set between steps, while the workers are idle
        self._lock = threading.Lock()
        self._marks: dict[str, list] = {}

    def wrap(self, target) -> None:
        import torch

        inner = target.features  # the bound method; replicas on this device share this Target

        def features(input_ids, **kw):
            who = threading.current_thread().name
            if self.cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            else:
                t0 = time.perf_counter()
            if self.inference:
                with torch.inference_mode():
                    out = inner(input_ids, **kw)
                out = out.clone()  # outside inference mode: a tensor autograd may save
            else:
                out = inner(input_ids, **kw)
            if self.cuda:
                e1.record()
                mark = (e0, e1)
            else:
                mark = (time.perf_counter() - t0) * 1e3
            with self._lock:
                self._marks.setdefault(who, []).append(mark)
            return out

        target.features = features

    def take(self) -> dict[str, float]:
        """ms of each worker's target forward(s) since the last call (call after synchronizing)."""
        with self._lock:
            marks, self._marks = self._marks, {}
        return {who: sum(m if isinstance(m, float) else m[0].elapsed_time(m[1]) for m in ms)
                for who, ms in sorted(marks.items())}


def compare_compiled(first, ids, targets) -> dict:
    """Compile every target's layers; on `first`, compare compiled and eager features with the same
    forward at a higher precision (the model cast up in place, then back: bf16 -> fp32 -> bf16 is
    exact). The compiled error against the reference must be eager's own, not more."""
    import torch

    from trainer.engine.numerics import rel_l2

    for t in targets:
        t.compile_layers()
    t0 = time.perf_counter()
    compiled = first.features(ids)
    compile_s = time.perf_counter() - t0
    eager = first.features(ids, eager=True)
    dtype = next(first.model.parameters()).dtype
    high = torch.float32 if dtype != torch.float32 else torch.float64
    first.model.to(high)
    try:
        ref = first.features(ids, eager=True)
    finally:
        first.model.to(dtype)
    return {"compiled_vs_eager": rel_l2(compiled, eager), "eager_vs_reference": rel_l2(eager, ref),
            "compiled_vs_reference": rel_l2(compiled, ref), "reference_dtype": str(high),
            "first_compile_s": round(compile_s, 1)}


def make_batches(args, vocab: int, pos_weights, n: int = 4):
    """n global batches of random tokens (every position carries loss), anchors drawn per step."""
    import torch

    from trainer.run.data import Sample, make_batch

    sh = SHAPES[args.shape]
    B = sh["batch"] * args.workers
    g = torch.Generator().manual_seed(1234)
    out = []
    for k in range(n):
        ids = torch.randint(0, vocab - 1, (B, sh["seq"]), generator=g).tolist()
        samples = [Sample(tuple(row), (1,) * sh["seq"]) for row in ids]
        out.append(make_batch(samples, pad_len=sh["seq"], pad_id=0, step=k, seed=0, block_size=sh["block"],
                              anchors=sh["anchors"], pos_weights=pos_weights))
    return out


def check_features(first, ids, targets, modes, emit) -> dict:
    """Before timing, on this machine's transformers and this shape: the truncated forward gives the
    whole forward's features bit for bit; with a compiled mode, compare_compiled's errors; with
    `graphed`, the graph replays the compiled forward's bits (captured here, replayed in the
    worker; a failed capture warns and runs uncaptured, which this shows too)."""
    import torch

    out = {}
    first.truncate = False
    want = first.features(ids)
    first.truncate = True
    got = first.features(ids)
    out["truncated_equals_full"] = bool(torch.equal(got, want))
    out["truncated_max_abs_diff"] = float((got.float() - want.float()).abs().max())
    emit(f"truncated target features equal the whole forward's: {out['truncated_equals_full']} "
         f"(max abs diff {out['truncated_max_abs_diff']:g})")
    if any(m.startswith("compiled") or m == "graphed" for m in modes):
        out["compiled_features"] = compare_compiled(first, ids, targets)
        emit("compiled target layers, features relative L2: " + ", ".join(
            f"{k} {v:.3g}" for k, v in out["compiled_features"].items() if isinstance(v, float)))
    if "graphed" in modes:
        want = first.features(ids)
        first.graph_features()
        first.features(ids)  # captures
        got = first.features(ids)
        first.graphed = False
        out["graphed_equals_compiled"] = bool(torch.equal(got, want))
        out["graph_captured"] = any(v is not False for v in first._graphs.values())
        emit(f"graphed target features equal the compiled forward's: {out['graphed_equals_compiled']} "
             f"(graph captured: {out['graph_captured']})")
    return out
