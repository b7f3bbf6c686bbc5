"""Decoding as serving engines decode: a static KV cache and CUDA graphs, for the target and the drafter.

`trainer.specdec --engine graphs` (the default) decodes with these; `--engine eager` keeps the
transformers-cache path of trainer/run/acceptance.py. The arithmetic is the same (tests/test_decode_graphs.py
compares both token for token, and the target's logits with transformers' own forward); what changes
is what a step costs on a GPU. In eager code a step is mostly Python and kernel launches, so a 16-token
verify costs what a 1-token step costs; serving engines (vLLM, SGLang) replay CUDA graphs over a static
cache, where the step costs its kernels, and the drafter's own cost decides the speedup.

- `StaticTarget`: the target's decoder layers (transformers' own modules: norms, projections, MLP,
  rotary tables) over a KV cache of fixed length, addressed by position: a step of T tokens at
  positions pos writes their keys and values at pos and attends to every cached key at a position
  <= its own. Nothing is ever cropped: a rejected draft's keys sit past the accepted prefix, masked,
  until the next step overwrites them.
- `StaticDrafter`: the drafter's context keys and values the same way (`extend`), and a block drafted
  against every context position before the anchor (`draft`): eval.py's extend_context/draft_block
  with a mask in place of a slice.
- `GraphDecoder`: one round of speculative decoding as three captured graphs (draft the block, verify
  it, give the verified positions' features to the drafter), replayed with one host synchronisation
  per round (the accept decision); and the target alone as one captured one-token step. A round cut
  short by the token budget (the last of a prompt) drafts its shorter block from a graph of its own
  and verifies the full block (the target is causal: the extra positions change nothing before them).
  On a CPU nothing is captured: the same functions run eagerly (the CPU suite checks them against eager).
  The prompt's forward is padded to a length bucket and replayed from a graph per bucket too, so the
  decode alone and the decode with the drafter pay the same for it, and neither pays eager launches.
- `GraphDecoder.step_costs`: each captured step replayed alone, the costs the model of a decode
  (trainer/run/decode_model.py) predicts from, printed beside what the decodes measured.
"""
from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from trainer.errors import UsageError
from trainer.model.drafter import Drafter, apply_rope, rope_cos_sin
from trainer.run.decode_model import RoundCosts
from trainer.run.acceptance import Timing


def unsupported(target) -> str | None:
    """Why the static engine cannot run this target (None when it can): it needs a Llama/Qwen-style
    decoder (base_model.layers of self_attn + mlp, a rotary table, a final norm) whose every layer
    attends to the full context."""
    base = target.model.base_model
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, name):
            return f"{type(base).__name__} has no {name}"
    attn = base.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not hasattr(attn, name):
            return f"{type(attn).__name__} has no {name}"
    cfg = target.config
    types = getattr(cfg, "layer_types", None) or ()
    if any(t != "full_attention" for t in types) or getattr(cfg, "use_sliding_window", False):
        return "it has sliding-window layers"
    return None


class StaticTarget:
    """The target's forward over a static, position-addressed KV cache of `max_len` positions."""

    def __init__(self, target, max_len: int):
        base, cfg = target.model.base_model, target.config
        self.embed, self.layers, self.norm, self.rotary = base.embed_tokens, base.layers, base.norm, base.rotary_emb
        self.lm_head = target.model.get_output_embeddings()
        self.layer_ids = tuple(target.layer_ids)
        self.nh = cfg.num_attention_heads
        self.nkv = getattr(cfg, "num_key_value_heads", None) or self.nh
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.max_len = max_len
        w = self.embed.weight
        shape = (len(self.layers), 1, self.nkv, max_len, self.hd)
        self.k = torch.zeros(shape, device=w.device, dtype=w.dtype)
        self.v = torch.zeros_like(self.k)
        self.key_pos = torch.arange(max_len, device=w.device)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, *, features: bool = True):
        """ids (1, T) at positions pos (T,) -> (greedy choice (T,), top-2 logit margin (T,) float32,
        features (T, n*H) at the tapped layers or None): transformers' hidden_states[i + 1] for each
        tapped layer i, the last layer's after the final norm, as Target.features gives them."""
        T = ids.shape[1]
        x = self.embed(ids)  # (1, T, H)
        cos, sin = self.rotary(x, pos[None])  # (1, T, hd) each
        cos, sin = cos[:, None], sin[:, None]  # (1, 1, T, hd)
        mask = (self.key_pos[None, :] <= pos[:, None])[None, None]  # (1, 1, T, max_len): causal by position
        last = len(self.layers) - 1
        taps = {}
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(1, T, self.nh, self.hd)
            k = a.k_proj(h).view(1, T, self.nkv, self.hd)
            v = a.v_proj(h).view(1, T, self.nkv, self.hd).transpose(1, 2)
            if hasattr(a, "q_norm"):  # Qwen3; Llama, Qwen2 and Mistral have none
                q, k = a.q_norm(q), a.k_norm(k)
            q = apply_rope(q.transpose(1, 2), cos, sin)  # (1, nh, T, hd)
            k = apply_rope(k.transpose(1, 2), cos, sin)  # (1, nkv, T, hd)
            self.k[i].index_copy_(2, pos, k)
            self.v[i].index_copy_(2, pos, v)
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask,
                                               scale=getattr(a, "scaling", None), enable_gqa=self.nh != self.nkv)
            x = x + a.o_proj(o.transpose(1, 2).reshape(1, T, self.nh * self.hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if features and i in self.layer_ids and i != last:
                taps[i] = x
        x = self.norm(x)
        logits = self.lm_head(x)[0].float()  # (T, V)
        top2 = logits.topk(2, dim=-1).values  # (T, 2)
        feats = torch.cat([x if i == last else taps[i] for i in self.layer_ids], dim=-1)[0] if features else None
        return logits.argmax(-1), top2[:, 0] - top2[:, 1], feats


class StaticDrafter:
    """The drafter's context keys/values in a static cache of `max_len` positions, and its block draft."""

    def __init__(self, drafter: Drafter, max_len: int):
        self.d = drafter
        a = drafter.layers[0].self_attn
        self.nh, self.nkv, self.hd = a.nh, a.nkv, a.hd
        w = drafter.fc.weight
        self.k = torch.zeros((len(drafter.layers), 1, self.nkv, max_len, self.hd), device=w.device, dtype=w.dtype)
        self.v = torch.zeros_like(self.k)
        self.key_pos = torch.arange(max_len, device=w.device)

    @torch.no_grad()
    def extend(self, feats: torch.Tensor, start: torch.Tensor) -> None:
        """The target features (T, n*H) of positions start .. start+T-1 into the context cache."""
        d, T = self.d, feats.shape[0]
        pos = start + torch.arange(T, device=feats.device)  # (T,)
        ctx = d.hidden_norm(d.fc(feats[None].to(d.fc.weight.dtype)))  # (1, T, H)
        rope = rope_cos_sin(pos[None], self.hd, d.cfg.rope_theta, ctx.dtype)
        for i, layer in enumerate(d.layers):
            k, v = layer.self_attn.kv(ctx, rope)
            self.k[i].index_copy_(2, pos, k)
            self.v[i].index_copy_(2, pos, v)

    @torch.no_grad()
    def draft(self, block: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """block (1, T) = [anchor, MASK...] at positions start.., seeing every context position before
        start and the whole block -> the drafter's greedy tokens for block positions 1..T-1, (T-1,)."""
        d, T = self.d, block.shape[1]
        pos = start + torch.arange(T, device=block.device)
        x = d.embed_tokens(block).to(d.fc.weight.dtype)  # (1, T, H)
        rope = rope_cos_sin(pos[None], self.hd, d.cfg.rope_theta, x.dtype)
        seen = torch.cat([self.key_pos < start, torch.ones(T, dtype=torch.bool, device=block.device)])
        mask = seen[None, None, None]  # (1, 1, 1, max_len + T): context before the anchor, the whole block
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            q, k, v = a.qkv(layer.input_layernorm(x), rope)
            k, v = torch.cat([self.k[i], k], dim=2), torch.cat([self.v[i], v], dim=2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=a.nh != a.nkv)
            x = x + a.out(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return d.logits(x[:, 1:])[0].argmax(-1)


def prefill_bucket(n: int, room: int) -> int:
    """The padded length a prompt of n tokens is run at: powers of two from 16 up to 256, then multiples
    of 256 (a graph per bucket, at most twice the tokens of the prompt, few graphs for long prompts),
    never past the caches' `room`."""
    b = 16
    while b < n:
        b = b * 2 if b < 256 else b + 256
    return min(b, room)


# --------------------------------------------------------------------------- capture

class _Graph:
    """fn() captured as a CUDA graph over the static tensors it reads and writes; replay() reruns it.
    Where capture fails (or on a CPU), replay() runs fn() itself: the same result, uncaptured."""

    def __init__(self, fn, device: torch.device, pool=None):
        self.fn, self.graph = fn, None
        if device.type != "cuda":
            return
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside the graph: cuBLAS handles, the allocator
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                fn()
        except Exception as e:  # noqa: BLE001 - the uncaptured call is always right
            first = (str(e).strip().splitlines() or [""])[0][:200]
            warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {first}); running uncaptured",
                          RuntimeWarning, stacklevel=2)
            return
        self.graph = graph

    def replay(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()


class _Clock:
    """Marks on the device's timeline (CUDA events; perf_counter on a CPU, where work is synchronous),
    read after the round's synchronisation: seconds between consecutive marks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def between(self, a, b) -> float:
        return (b - a) if not self.cuda else a.elapsed_time(b) / 1e3


@dataclass
class Decoded:
    """One prompt's decode: the new tokens, and with the drafter its rounds."""
    tokens: list[int]
    spent: Timing
    produced: list[int] = field(default_factory=list)   # tokens each round produced (accepted + 1, capped)
    drafts: list[tuple[int, int]] = field(default_factory=list)  # (drafts accepted, drafts offered)
    margins: list[float] = field(default_factory=list)  # the target alone: top-2 logit margin per new token


class GraphDecoder:
    """Greedy decoding at batch 1 with the target alone or with the drafter, on static caches, each
    step replayed from a CUDA graph (on a GPU). `max_len`: the longest prompt + new tokens it must hold.
    compile: each captured step is compiled by inductor first (torch.compile, static shapes), which fuses
    the norms, RoPE and residual adds that leave a graph-replayed step launch-bound at small sizes; the
    prompt's forward and a budget-cut round's shorter draft stay uncompiled (their shapes vary)."""

    def __init__(self, target, drafter: Drafter, max_len: int, *, graphs: bool = True, compile: bool = False):
        why = unsupported(target)
        if why:
            raise UsageError(f"--engine graphs cannot run this target ({why}); use --engine eager")
        self.dev = target.device
        self.B, self.mask_id = drafter.cfg.block_size, drafter.cfg.mask_token_id
        self.max_len = max_len
        room = max_len + self.B + 2  # a verify at the last position writes B positions past it
        self.t = StaticTarget(target, room)
        self.d = StaticDrafter(drafter, room)
        self.eos = target.eos_ids()
        dev, B = self.dev, self.B
        # The graphs' inputs and outputs: the anchor token and its position, set before each replay
        self.anchor = torch.zeros(1, dtype=torch.long, device=dev)
        self.p = torch.zeros(1, dtype=torch.long, device=dev)
        self.masks = torch.full((B - 1,), self.mask_id, dtype=torch.long, device=dev)
        self.drafted = torch.zeros(B - 1, dtype=torch.long, device=dev)
        self.choice = torch.zeros(B, dtype=torch.long, device=dev)
        self.feats: torch.Tensor | None = None      # the target's features of a verify (made by the first)
        self.margins = torch.zeros(room + 1, dtype=torch.float32, device=dev)  # by the predicted token's position
        # The prompt's forward: padded to a length bucket (prefill_bucket) and replayed from a graph per
        # bucket, captured at its first use, so neither decode pays the launches of an eager forward
        self.room = room
        self.prompt_ids = torch.zeros(room, dtype=torch.long, device=dev)
        self.positions = torch.arange(room, device=dev)
        self.zero = torch.zeros((), dtype=torch.long, device=dev)
        self.pre_choice = torch.zeros(room, dtype=torch.long, device=dev)
        self.pre_margin = torch.zeros(room, dtype=torch.float32, device=dev)
        self.g_prefill: dict[tuple[int, bool], _Graph] = {}
        self.captured = graphs and dev.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if self.captured else None
        make = (lambda fn: _Graph(fn, dev, pool)) if self.captured else (lambda fn: _Graph(fn, torch.device("cpu")))
        self._make = make
        self.clock = _Clock(dev)
        # Shapes are fixed before capture: one full round's verify gives feats its (B, n*H) shape
        self._verify(B)
        steps = [lambda: self._draft(B), lambda: self._verify(B), lambda: self._extend(B), self._step]
        if compile:
            steps = [torch.compile(fn, dynamic=False) for fn in steps]
        self.compiled = compile
        self.g_draft, self.g_verify, self.g_extend, self.g_step = map(make, steps)
        # A round the token budget cuts short drafts a shorter block, as the reference does (the block's
        # positions see each other: a shorter one drafts other tokens), from a graph of its own, eager
        # under compile too (inductor would recompile per length). Its verify and extend replay the full
        # block's graphs: the target is causal, so its choices at the first vs positions are the same,
        # and what lands past them in the caches is never seen (masked by position, then overwritten).
        # Uncaptured, these rounds would pay eager launches: most of a prompt's last B tokens (docs/decoding.md).
        self.g_short = {vs: make(lambda vs=vs: self._draft(vs)) for vs in range(2, B)}
        self.graphed = self.captured and all(g.graph is not None for g in (self.g_draft, self.g_verify,
                                                                          self.g_extend, self.g_step,
                                                                          *self.g_short.values()))

    # -- the round's parts, over the static tensors (vs: the block's length, B in a captured round)
    def _draft(self, vs: int) -> None:
        block = torch.cat([self.anchor, self.masks[: vs - 1]])[None]
        self.drafted[: vs - 1].copy_(self.d.draft(block, self.p))

    def _verify(self, vs: int) -> None:
        ids = torch.cat([self.anchor, self.drafted[: vs - 1]])[None]
        pos = self.p + torch.arange(vs, device=self.dev)
        choice, margin, feats = self.t.forward(ids, pos)
        self.choice[:vs].copy_(choice)
        self.margins.index_copy_(0, pos + 1, margin)
        if self.feats is None:
            self.feats = torch.zeros((self.B, feats.shape[-1]), dtype=feats.dtype, device=self.dev)
        self.feats[:vs].copy_(feats)

    def _extend(self, vs: int) -> None:
        assert self.feats is not None       # a verify came first
        self.d.extend(self.feats[:vs], self.p)

    def _step(self) -> None:  # the target alone: the token at p, its successor into anchor, p + 1
        choice, margin, _ = self.t.forward(self.anchor[None], self.p, features=False)
        self.margins.index_copy_(0, self.p + 1, margin)
        self.anchor.copy_(choice)
        self.p.add_(1)

    def _prefill_bucket(self, n: int, features: bool) -> None:
        """The prompt's forward over the first n positions of prompt_ids (n: a bucket's length). Past the
        prompt, the padding's keys and features land at positions no step sees before it overwrites
        them (the verify's argument above), and the target is causal: the prompt's choices are its own."""
        choice, margin, feats = self.t.forward(self.prompt_ids[:n][None], self.positions[:n], features=features)
        self.pre_choice[:n].copy_(choice)
        self.pre_margin[:n].copy_(margin)
        if features:
            self.d.extend(feats, self.zero)

    def _prefill(self, prompt: list[int], *, features: bool) -> int:
        n = len(prompt)
        b = prefill_bucket(n, self.room)
        self.prompt_ids[:n].copy_(torch.tensor(prompt), non_blocking=False)
        key = (b, features)
        if key not in self.g_prefill:   # captured at the first prompt of this bucket (a warm-up, untimed)
            self.g_prefill[key] = self._make(lambda: self._prefill_bucket(b, features))
        self.g_prefill[key].replay()
        self.margins[n] = self.pre_margin[n - 1]
        return int(self.pre_choice[n - 1])

    def _fits(self, prompt: list[int], max_new_tokens: int) -> None:
        if len(prompt) + max_new_tokens > self.max_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens + {max_new_tokens} new ones does not fit the "
                             f"static caches of {self.max_len} positions this decoder was built for")

    def _sync(self) -> float:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        return time.perf_counter()

    # -- what each step costs alone (the model of trainer/run/decode_model.py)
    @torch.no_grad()
    def step_costs(self, prompt_len: int, *, reps: int = 20, batches: int = 5) -> RoundCosts:
        """Each step on its own, in seconds: the one-token step and a whole round each with their host
        synchronisation, as the decodes make them; draft, verify and extend replayed back to back (the
        host launches ahead: their device cost); the prompt's forward at prompt_len's bucket without and
        with the drafter's features. Leaves the caches holding garbage: call it after the decodes."""
        p0 = max(1, min(prompt_len, self.max_len - 1))
        n = max(1, reps // batches)
        slow = max(1, n // 5)     # a prompt's forward costs many steps

        def step() -> None:
            self.g_step.replay()
            int(self.anchor)

        def round_() -> None:      # as speculative() runs one: set anchor and position, three replays, one read
            self._at(p0)
            self.g_draft.replay()
            self.g_verify.replay()
            self.g_extend.replay()
            torch.cat([self.drafted, self.choice]).tolist()

        prompt = [0] * p0
        costs = self._timed(
            {"step": (step, max(1, min(n, self.room - p0 - 2))),   # each replay moves p on by one
             "draft": (self.g_draft.replay, n), "verify": (self.g_verify.replay, n),
             "extend": (self.g_extend.replay, n), "round": (round_, n),
             "prefill_alone": (lambda: self._prefill(prompt, features=False), slow),
             "prefill_spec": (lambda: self._prefill(prompt, features=True), slow)}, p0, batches)
        return RoundCosts(**costs)

    @torch.no_grad()
    def prefill_costs(self, prompt_len: int, *, reps: int = 20, batches: int = 5) -> tuple[float, float]:
        """Seconds of the prompt's forward at prompt_len's bucket, (without, with) the drafter's features,
        host synchronisation included, as the decodes pay it."""
        prompt = [0] * max(1, min(prompt_len, self.max_len - 1))
        slow = max(1, reps // batches // 5)
        c = self._timed({"alone": (lambda: self._prefill(prompt, features=False), slow),
                         "spec": (lambda: self._prefill(prompt, features=True), slow)}, len(prompt), batches)
        return c["alone"], c["spec"]

    def _at(self, p: int) -> None:
        self.anchor.fill_(0)
        self.p.fill_(p)

    def _timed(self, parts: dict, p0: int, batches: int) -> dict[str, float]:
        """{name: (one call, calls a batch)} -> seconds a call, the median of `batches` batch means. The
        parts' batches take turns after one untimed round (which captures a new bucket's prefill), so a
        change in a shared machine's load reaches every part alike."""
        means: dict[str, list[float]] = {k: [] for k in parts}
        for b in range(batches + 1):
            for name, (once, calls) in parts.items():
                self._at(p0)
                t0 = self._sync()
                for _ in range(calls):
                    once()
                if b:
                    means[name].append((self._sync() - t0) / calls)
        return {k: statistics.median(v) for k, v in means.items()}

    # -- decoding
    @torch.no_grad()
    def target_alone(self, prompt: list[int], max_new_tokens: int) -> Decoded:
        """The target alone: one captured one-token step per token, greedy, stopping at EOS."""
        self._fits(prompt, max_new_tokens)
        spent = Timing()
        t0 = self._sync()
        tok = self._prefill(prompt, features=False)
        spent.prefill = self._sync() - t0
        out = [tok]
        self.anchor.fill_(tok)
        self.p.fill_(len(prompt))
        while len(out) < max_new_tokens and tok not in self.eos:
            self.g_step.replay()
            tok = int(self.anchor)  # the host's one synchronisation per token
            out.append(tok)
        spent.total = spent.verify = self._sync() - t0
        margins = self.margins[len(prompt): len(prompt) + len(out)].tolist()
        return Decoded(out, spent, margins=margins)

    @torch.no_grad()
    def speculative(self, prompt: list[int], max_new_tokens: int) -> Decoded:
        """Greedy speculative decoding, round for round as eval.speculative_generate (the reference's
        dflash_generate): verify min(B, budget left) tokens, accept the longest matching prefix of
        drafts plus the target's token after it, stop at EOS."""
        self._fits(prompt, max_new_tokens)
        B, clock, spent = self.B, self.clock, Timing()
        t0 = self._sync()
        c0 = clock.mark()
        anchor = self._prefill(prompt, features=True)
        c1 = clock.mark()  # read after the decode's last synchronisation: CUDA events complete only then
        p = len(prompt)
        end = p + max_new_tokens
        new, produced, drafts = [anchor], [], []
        stopped = anchor in self.eos
        while p + 1 < end and not stopped:
            vs = min(B, end - p)
            self.anchor.fill_(anchor)
            self.p.fill_(p)
            m0 = clock.mark()
            (self.g_draft if vs == B else self.g_short[vs]).replay()
            m1 = clock.mark()
            self.g_verify.replay()  # the full block: past vs, its choices are read by no one
            m2 = clock.mark()
            self.g_extend.replay()
            m3 = clock.mark()
            got = torch.cat([self.drafted[: vs - 1], self.choice[:vs]]).tolist()  # the round's one sync
            draft, choice = got[: vs - 1], got[vs - 1:]
            a = next((j for j, (x, y) in enumerate(zip(draft, choice)) if x != y), vs - 1)
            step = (draft[:a] + [choice[a]])[: end - p - 1]
            hit = next((j for j, t in enumerate(step) if t in self.eos), None)
            if hit is not None:
                step, stopped = step[: hit + 1], True
            new += step
            produced.append(len(step))
            drafts.append((a, vs - 1))
            anchor, p = step[-1], p + len(step)
            spent.draft += clock.between(m0, m1)
            spent.verify += clock.between(m1, m2)
            spent.extend += clock.between(m2, m3)
        spent.total = self._sync() - t0
        spent.prefill = clock.between(c0, c1)
        spent.verify += spent.prefill
        spent.rounds = len(produced)
        return Decoded(new[:max_new_tokens], spent, produced, drafts)
