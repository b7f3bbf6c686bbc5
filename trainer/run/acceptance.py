"""Acceptance length: speculative decoding of the drafter against the target, greedy verification.

One round: the drafter fills a block [anchor, MASK x (B-1)] from the target features of every
position before the anchor (the same mask rule as training); the target scores anchor + drafts in
one pass; the longest prefix of drafts equal to the target's own greedy choices is accepted, plus
the target's token after it. tau = mean over rounds of (accepted + 1), between 1 and B, with its
normal 95% interval over rounds (`interval95`), and the acceptance rate of each block position
(`accept_rates`: of the rounds that drafted position k, the share whose drafts 1..k all matched);
trainer/specdec.py reports the same two. The output is exactly the target's greedy continuation
(lossless), which tests check. The rounds are those of the reference implementation's
`dflash_generate` (tests/test_export_parity.py runs both).

`python -m trainer.eval --out DIR` measures the latest checkpoint of a run on the run's held-out
prompts (OUT/eval_prompts.json) and prints one JSON line with "acceptance_length".
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from trainer.model import masks
from trainer.errors import UsageError
from trainer.model.drafter import Drafter, rope_cos_sin
from trainer.run.target import Target


@dataclass
class Timing:
    """Seconds a decode spent in all (wall clock, device-synchronised) and per part."""
    verify: float = 0.0    # the target's forwards, the prompt's included
    draft: float = 0.0     # the drafter's (its context keys/values included, except where `extend` has them)
    total: float = 0.0
    extend: float = 0.0    # the graphs engine: the drafter's context keys/values of the verified positions
    prefill: float = 0.0   # the prompt's forward (part of verify)
    rounds: int = 0

    def add(self, other: "Timing") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def clock(dev: torch.device) -> float:
    """Wall clock after the device's queued work (CUDA runs asynchronously)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


class DraftCache:
    """Per layer, the context's keys and values (B=1): (1, nkv, Tc, hd) each, after k_norm and RoPE."""

    def __init__(self, n_layers: int):
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]


@torch.no_grad()
def extend_context(drafter: Drafter, cache: DraftCache, feats: torch.Tensor, start: int) -> None:
    """Add the target features of positions start .. start+T-1 (feats (1, T, n*H)) to the cache."""
    if feats.shape[1] == 0:
        return
    assert cache.length == start, (cache.length, start)
    ctx = drafter.hidden_norm(drafter.fc(feats.to(drafter.fc.weight.dtype)))  # (1, T, H)
    T = ctx.shape[1]
    pos = torch.arange(start, start + T, device=feats.device)[None]
    rope = rope_cos_sin(pos, drafter.cfg.head_dim, drafter.cfg.rope_theta, ctx.dtype)
    for i, layer in enumerate(drafter.layers):
        k, v = layer.self_attn.kv(ctx, rope)
        old_k, old_v = cache.k[i], cache.v[i]
        cache.k[i] = k if old_k is None else torch.cat([old_k, k], dim=2)
        cache.v[i] = v if old_v is None else torch.cat([old_v, v], dim=2)


@torch.no_grad()
def draft_block(drafter: Drafter, cache: DraftCache, block: torch.Tensor, start: int) -> torch.Tensor:
    """block (1, T) = [anchor, MASK...] at positions start..start+T-1, seeing every cached context
    position (all < start) and itself -> the drafter's greedy tokens for positions 1..T-1, (T-1,).
    The same function as Drafter.forward with the decoding mask (tests/test_small_target.py)."""
    x = drafter.embed_tokens(block).to(drafter.fc.weight.dtype)  # (1, T, H)
    T = block.shape[1]
    pos = torch.arange(start, start + T, device=block.device)[None]
    rope = rope_cos_sin(pos, drafter.cfg.head_dim, drafter.cfg.rope_theta, x.dtype)
    for i, layer in enumerate(drafter.layers):
        a = layer.self_attn
        q, k, v = a.qkv(layer.input_layernorm(x), rope)
        old_k, old_v = cache.k[i], cache.v[i]
        assert old_k is not None and old_v is not None     # extend_context gave it the context
        k, v = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        if a.nh != a.nkv:
            k = k.repeat_interleave(a.nh // a.nkv, dim=1)
            v = v.repeat_interleave(a.nh // a.nkv, dim=1)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype))  # no mask: all visible
        x = x + a.out(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.logits(x[:, 1:])[0].argmax(-1)


class _FullContext:
    """Drafting through Drafter.forward over every context position each round, under the
    training mask and (on CUDA) bf16 autocast: the path training computes."""

    def __init__(self, drafter: Drafter, dev: torch.device):
        self.drafter = drafter
        self.feats: torch.Tensor | None = None
        self.amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()

    def __call__(self, block: torch.Tensor, p: int, new_feats: torch.Tensor) -> torch.Tensor:
        self.feats = new_feats if self.feats is None else torch.cat([self.feats, new_feats], dim=1)
        dev, vs = block.device, block.shape[1]
        mask = masks.attention_mask(torch.tensor([[p]], device=dev), p, vs)  # (1, vs, p + vs): context < p
        with self.amp:
            hidden = self.drafter(block, torch.arange(p, p + vs, device=dev)[None], self.feats,
                                  torch.arange(p, device=dev)[None], mask)
            return self.drafter.logits(hidden)[0, 1:].argmax(-1)  # (vs-1,): guesses for p+1 .. p+vs-1


class _Cached:
    """Drafting with the drafter's KV cache: each round adds only the new context positions."""

    def __init__(self, drafter: Drafter):
        self.drafter, self.cache = drafter, DraftCache(len(drafter.layers))

    def __call__(self, block: torch.Tensor, p: int, new_feats: torch.Tensor) -> torch.Tensor:
        extend_context(self.drafter, self.cache, new_feats, self.cache.length)
        return draft_block(self.drafter, self.cache, block, p)


@torch.no_grad()
def speculative_generate(target: Target, drafter: Drafter, prompt: list[int], *, max_new_tokens: int,
                         eos: Collection[int] = frozenset(), cached: bool = False, timing: Timing | None = None,
                         ) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """Greedy speculative decoding of one prompt: (new tokens, tokens produced per round, (drafts
    accepted, drafts offered) per round).

    Round for round what the reference's `dflash_generate` does (docs/export.md): the block is cut
    to the tokens still wanted (min(B, budget left)), a round produces the accepted drafts plus the
    target's own token, capped at the budget and ending at the first EOS, and that count is the
    round's acceptance length. cached: draft with the drafter's KV cache (decoding speed) instead of
    the full forward (the training path). timing: add the seconds spent here (device-synchronised).
    """
    dev, B, mask_id = target.device, drafter.cfg.block_size, drafter.cfg.mask_token_id
    draft_fn = _Cached(drafter) if cached else _FullContext(drafter, dev)
    t0 = clock(dev) if timing else 0.0
    logits, hs, cache = target.decode(torch.tensor([prompt], device=dev), hidden=True)
    feats = _features(target, hs)  # (1, P, n*H): positions 0..P-1, not yet given to the drafter
    anchor = int(logits[0, -1].argmax())
    p = len(prompt)  # the anchor's position
    end = p + max_new_tokens  # the reference's max_length: new tokens occupy positions p .. end-1
    new, produced, drafts = [anchor], [], []
    stopped = anchor in eos
    spent = Timing(verify=clock(dev) - t0 if timing else 0.0)  # the prompt's forward is the target's
    spent.prefill = spent.verify
    while p + 1 < end and not stopped:
        vs = min(B, end - p)  # the verified block: anchor + vs-1 drafts
        block = torch.tensor([[anchor] + [mask_id] * (vs - 1)], device=dev)  # (1, vs)
        td = clock(dev) if timing else 0.0
        draft = draft_fn(block, p, feats)  # vs >= 2: the loop runs while two positions are left
        tv = clock(dev) if timing else 0.0
        logits, hs, cache = target.decode(torch.cat([block[0, :1], draft])[None], cache, hidden=True)
        choice = logits[0].argmax(-1)  # (vs,): the target's token for p+1 .. p+vs
        a = int(torch.cumprod((draft == choice[:-1]).int(), 0).sum())  # drafts accepted
        step_tokens = (draft[:a].tolist() + [int(choice[a])])[: end - p - 1]
        hit = next((i for i, t in enumerate(step_tokens) if t in eos), None)
        if hit is not None:
            step_tokens, stopped = step_tokens[: hit + 1], True
        n = len(step_tokens)  # tokens this round produced: positions p+1 .. p+n
        feats = _features(target, hs)[:, :n]  # features of p .. p+n-1, for the next round's draft
        if vs - n > 0:
            cache.crop(-(vs - n))  # keep p .. p+n-1 (negative: tokens to remove)
        new += step_tokens
        produced.append(n)
        drafts.append((a, vs - 1))
        anchor, p = step_tokens[-1], p + n
        if timing:
            spent.draft += tv - td
            spent.verify += clock(dev) - tv
    if timing:
        spent.total = clock(dev) - t0
        timing.add(spent)
    return new[:max_new_tokens], produced, drafts


def _features(target: Target, hidden_states) -> torch.Tensor:
    return torch.cat([hidden_states[i + 1] for i in target.layer_ids], dim=-1)


def acceptance_length(target: Target, drafter: Drafter, prompts: list[list[int]], *, max_new_tokens: int,
                      should_stop=lambda: False) -> dict:
    """tau over all rounds of all prompts with its 95% interval ("tau_ci95"), the acceptance rate
    per block position 1..B-1, the per-prompt means and each prompt's rounds ("acceptance_lengths",
    as dflash_generate reports them); stops early if should_stop()."""
    was_training = drafter.training
    drafter.eval()
    rounds, per_prompt, per_round, drafts = [], [], [], []
    eos = target.eos_ids()
    try:
        for prompt in prompts:
            if should_stop():
                break
            _, acc, d = speculative_generate(target, drafter, prompt, max_new_tokens=max_new_tokens, eos=eos)
            rounds += acc
            drafts += d
            per_prompt.append(sum(acc) / max(1, len(acc)))
            per_round.append(acc)
    finally:
        drafter.train(was_training)
    return {**summarize(rounds, drafts, drafter.cfg.block_size),
            "prompts": len(prompts), "per_prompt": per_prompt, "acceptance_lengths": per_round}


def summarize(rounds: list[int], drafts: list[tuple[int, int]], block_size: int) -> dict:
    """tau ("acceptance_length") over the rounds, their count, tau's 95% interval (None for fewer
    than two rounds) and the acceptance rate per block position."""
    tau, half = interval95(rounds)
    ci = [tau - half, tau + half] if math.isfinite(half) else None
    return {"acceptance_length": tau, "rounds": len(rounds), "tau_ci95": ci,
            "accept_rate_by_position": accept_rates(drafts, block_size)}


def interval95(xs: list[int]) -> tuple[float, float]:
    """Mean and the half-width of its normal 95% interval (inf with fewer than two values)."""
    n = len(xs)
    if n == 0:
        return 0.0, 0.0
    m = sum(xs) / n
    if n < 2:
        return m, float("inf")
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, 1.96 * math.sqrt(var / n)


def accept_rates(drafts: list[tuple[int, int]], block_size: int) -> list[float | None]:
    """Per block position k = 1..B-1: of the rounds that drafted position k, the share that accepted
    it (drafts 1..k all equal to the target's choices); None where no round drafted it. `drafts` is
    (drafts accepted, drafts offered) per round; a round cut to the token budget offers fewer."""
    offered, taken = [0] * block_size, [0] * block_size
    for accepted, drafted in drafts:
        for k in range(1, drafted + 1):
            offered[k] += 1
            taken[k] += k <= accepted
    return [round(taken[k] / offered[k], 4) if offered[k] else None for k in range(1, block_size)]


# --------------------------------------------------------------------------- python -m trainer.eval

def main(argv: list[str] | None = None) -> int:
    from trainer.run import checkpoint
    from trainer.run.config import RUN_CONFIG, TrainConfig, layer_ids
    from trainer.run.flags import OneLineParser
    from trainer.run.target import load_target

    p = OneLineParser(prog="python -m trainer.eval",
                      description="Acceptance length of a trained drafter on a run's held-out prompts.")
    p.add_argument("--out", required=True, help="the training run's output folder")
    p.add_argument("--checkpoint", help="a checkpoint folder (default: the run's latest)")
    p.add_argument("--untrained", action="store_true", help="measure the freshly initialised drafter instead")
    p.add_argument("--prompts", type=int, help="use only the first N held-out prompts")
    p.add_argument("--new-tokens", type=int, help="tokens to generate per prompt (default: the run's)")
    p.add_argument("--gpus", type=int, default=None, help="0 = CPU (default: the run's setting, if a GPU is there)")
    p.add_argument("--target-changed-ok", action="store_true",
                   help="measure even when the target at the run's --target is not the one the checkpoint records")
    a = p.parse_args(argv)

    out = Path(a.out)
    try:
        cfg = TrainConfig(**json.loads((out / RUN_CONFIG).read_text()))
        prompts = json.loads((out / "eval_prompts.json").read_text())
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"--out {a.out}: not a training run folder ({e})") from None
    if a.prompts is not None:
        prompts = prompts[: a.prompts]
    if not prompts:
        raise UsageError(f"--out {a.out}: the run has no eval prompts")
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    gpus = cfg.gpus if a.gpus is None else a.gpus
    device = torch.device("cuda:0" if gpus > 0 and torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ck = None
    if not a.untrained:
        path = Path(a.checkpoint) if a.checkpoint else checkpoint.find_latest(out)
        if path is None or not checkpoint.verify(path):
            raise UsageError(f"no complete checkpoint {'at ' + a.checkpoint if a.checkpoint else 'in ' + a.out}")
        ck = checkpoint.load(path)
    # What the checkpoint was trained with (layers read, mask token), not what the target gives now
    record = ck.meta.get("target") if ck is not None else None
    layers = tuple(record["layer_ids"]) if record else layer_ids(cfg)
    mask = record["mask_token_id"] if record else None if cfg.mask_token_id < 0 else cfg.mask_token_id
    target = load_target(cfg.target, device=device, dtype=dtype, layers=layers)
    if record:
        assert ck is not None       # the record is its
        from trainer.run import provenance

        provenance.check(record, provenance.changes(record, provenance.identity(target)), cfg.target,
                         target.num_layers, a.target_changed_ok,
                         refused=f"the target {cfg.target} is not the one {ck.path} was trained against",
                         anyway="to measure against it")
    dcfg = target.drafter_config(num_layers=cfg.draft_layers, block_size=cfg.block_size, mask_token_id=mask,
                                 own_norm=not cfg.freeze_draft_norm)
    torch.manual_seed(cfg.seed)
    drafter = Drafter(dcfg)
    drafter.init_norm(target.head_weights()[1])
    step = 0
    if ck is not None:
        drafter.load_trainable_state_dict(ck.model)
        step = ck.step
    drafter.borrow_target_head(*target.head_weights())
    drafter.to(device)
    result = acceptance_length(target, drafter, prompts, max_new_tokens=a.new_tokens or cfg.eval_new_tokens)
    print(json.dumps({"step": step, "untrained": a.untrained, **result}), flush=True)
    return 0

