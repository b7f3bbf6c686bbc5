"""The DFlash drafter: pure model, no data, no devices, no Hugging Face (docs/background.md#dflash).

A few Qwen3-style layers (RMSNorm, q/k norm, RoPE, SwiGLU, GQA) that denoise blocks of
[anchor, MASK x (B-1)] in one non-causal pass. Conditioning: hidden states of n target layers,
concatenated, projected by one Linear(n*H -> H) + RMSNorm, and injected as extra keys/values in
every layer (K = k_proj([context; block]), same weights); queries come from the block only.
The token embedding and the lm_head are the target's, borrowed and frozen: they are not trained and
not saved in checkpoints (`trainable_state_dict`). The final norm is the drafter's own, trained and
initialised from the target's (`init_norm`), as in the reference implementation (z-lab's `dflash`,
docs/export.md); `DrafterConfig.own_norm=False` keeps the older behaviour, the target's norm
borrowed and frozen.

Shapes: B batch, Tq query (block) tokens, Tc context tokens, H hidden, V vocab, n target layers.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from trainer.model import attention
from trainer.model.linear import Linear, block_rows_linear, predicted_rows

# Submodules that belong to the target (frozen, shared, never checkpointed).
FROZEN_PREFIXES = ("embed_tokens.", "lm_head.")
# The final norm, the drafter's own unless DrafterConfig.own_norm is False (then borrowed too).
NORM_PREFIX = "norm."


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int                 # H: must equal the target's (embedding and lm_head are shared)
    vocab_size: int                  # V: the target's
    mask_token_id: int               # the token id whose embedding fills positions 1..B-1 of a block
    num_target_layers: int = 5       # n: target features are (B, Tc, n*H)
    num_layers: int = 5
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 12288
    rms_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    block_size: int = 16
    init_std: float = 0.02
    own_norm: bool = True            # train the final norm (init: the target's); False = borrow it frozen

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")


class RMSNorm(nn.Module):
    """Same arithmetic as Qwen3/Llama RMSNorm (so the target's final norm weight drops in)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


@torch.library.custom_op("dflash::rope_cos_sin", mutates_args=())
def _rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # (B, T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, hd)
    return emb.cos(), emb.sin()


@_rope_tables.register_fake
def _(positions, head_dim, theta):
    shape = (*positions.shape, head_dim)
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions (B, T) int -> cos, sin (B, 1, T, head_dim), HF's half-rotation layout.

    One opaque op: under torch.compile the tables are computed once per step and saved for the
    backward. As plain pointwise math, inductor inlines pow/sin/cos into every q/k norm + RoPE
    kernel and recomputes them in the backward, making those kernels compute-bound
    (docs/decisions.md). Eager computes the same values either way.
    """
    cos, sin = _rope_tables(positions, head_dim, float(theta))
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        H = cfg.hidden_size
        self.q_proj = Linear(H, self.nh * self.hd, bias=False)
        self.k_proj = Linear(H, self.nkv * self.hd, bias=False)
        self.v_proj = Linear(H, self.nkv * self.hd, bias=False)
        self.o_proj = Linear(self.nh * self.hd, H, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_eps)

    def forward(self, x, ctx, rope_q, rope_k, mask, block_size: int = 0, predicted: int = 0):
        # x (B, Tq, H) block stream; ctx (B, Tc, H) projected target features;
        # mask (B, Tq, Tc+Tq) bool, or the same rule as an attention.SparseMask.
        # block_size > 0: x is the stream's compact rows instead (B, n + 1, H), expand_blocks' layout.
        # predicted > 0 (the block size): o_proj runs on, and the output holds, predicted_rows only.
        kv_in = torch.cat([ctx, x], dim=1)  # (B, Tk, H), Tk = Tc + Tq (compact: Tc + n + 1)
        if block_size:
            B, Tc, n = x.shape[0], ctx.shape[1], x.shape[1] - 1
            q, k, v = (block_rows_linear(proj, inp, lead, n, block_size)
                       for proj, inp, lead in ((self.q_proj, x, 0), (self.k_proj, kv_in, Tc), (self.v_proj, kv_in, Tc)))
            Tq = n * block_size     # the keys: Tc + n * block_size rows
        else:
            B, Tq = x.shape[0], x.shape[1]
            q, k, v = self.q_proj(x), self.k_proj(kv_in), self.v_proj(kv_in)
        q = self.heads(q, self.nh, self.q_norm, rope_q)     # (B, nh, Tq, hd)
        k = self.heads(k, self.nkv, self.k_norm, rope_k)    # (B, nkv, Tk, hd)
        v = self.heads(v, self.nkv)                         # (B, nkv, Tk, hd)
        o = attention.attend(q, k, v, mask)  # (B, nh, Tq, hd): dense SDPA or block-sparse flex
        o = o.transpose(1, 2).reshape(B, Tq, self.nh * self.hd)
        return self.o_proj(predicted_rows(o, predicted) if predicted else o)

    # The pieces the decoders (run/acceptance.py, run/decode_graphs.py) assemble with their own caches: the
    # same projections, norms and RoPE as forward, written once here.

    def heads(self, t: torch.Tensor, n: int, norm: RMSNorm | None = None, rope=None) -> torch.Tensor:
        """(B, T, n*hd) projected rows -> (B, n, T, hd), RMS-normed and rotated when given norm, rope."""
        B, T = t.shape[:2]
        t = t.view(B, T, n, self.hd)
        t = (norm(t) if norm is not None else t).transpose(1, 2)
        return apply_rope(t, *rope) if rope is not None else t

    def kv(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, RoPE) and values of rows x (B, T, H): (B, nkv, T, hd) each."""
        return self.heads(self.k_proj(x), self.nkv, self.k_norm, rope), self.heads(self.v_proj(x), self.nkv)

    def qkv(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, nh, T, hd), keys and values (B, nkv, T, hd) of rows x (B, T, H)."""
        return (self.heads(self.q_proj(x), self.nh, self.q_norm, rope), *self.kv(x, rope))

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output (B, nh, T, hd) -> o_proj's (B, T, H)."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size  # noqa: E741 - I: the intermediate size, as in shapes
        self.gate_proj = Linear(H, I, bias=False)
        self.up_proj = Linear(H, I, bias=False)
        self.down_proj = Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, ctx, rope_q, rope_k, mask, block_size: int = 0, predicted: int = 0):
        # block_size > 0: every block of x is [its own row, one row repeated] (masked_blocks): the
        # norm and the q/k/v projections run on the distinct rows only.
        # predicted > 0 (the block size): after attention, which reads every row's K/V, the layer
        # goes on with predicted_rows only (o_proj, residual, MLP) and returns those.
        if block_size:
            B, T, H = x.shape
            blocks = x.view(B, T // block_size, block_size, H)
            h = self.input_layernorm(torch.cat([blocks[:, :, 0], blocks[:, :1, 1]], dim=1))  # (B, n + 1, H)
        else:
            h = self.input_layernorm(x)
        a = self.self_attn(h, ctx, rope_q, rope_k, mask, block_size, predicted)
        x = (predicted_rows(x, predicted) if predicted else x) + a
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = Linear(cfg.num_target_layers * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_eps)
        # an nn.ModuleList (registered, compiled as one), typed as its items: a ModuleList's type as Module
        self.layers = cast("Sequence[DraftLayer]", nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers)))
        # Borrowed from the target by `borrow_target_head`; placeholders on the meta device until then
        # (a real target's embedding and lm_head are GBs: never allocate them twice).
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
            self.lm_head = nn.Linear(H, cfg.vocab_size, bias=False)
        if cfg.own_norm:
            self.norm = RMSNorm(H, cfg.rms_eps)  # ones until init_norm copies the target's
        else:
            with torch.device("meta"):
                self.norm = RMSNorm(H, cfg.rms_eps)
        self._init_weights()

    @property
    def frozen_prefixes(self) -> tuple[str, ...]:
        return FROZEN_PREFIXES if self.cfg.own_norm else FROZEN_PREFIXES + (NORM_PREFIX,)

    def _init_weights(self):
        for name, p in self.named_parameters():
            if name.startswith(self.frozen_prefixes):
                continue
            if p.dim() == 2:
                nn.init.normal_(p, std=self.cfg.init_std)
            else:
                nn.init.ones_(p)

    def init_norm(self, norm: torch.Tensor) -> None:
        """Start the drafter's own final norm from the target's (H,) weight (a copy, trained after).

        Call before loading a checkpoint: one that predates the own norm leaves this value in place.
        """
        if not self.cfg.own_norm:
            return
        if tuple(norm.shape) != (self.cfg.hidden_size,):
            raise ValueError(f"target final norm has shape {tuple(norm.shape)}, drafter expects "
                             f"({self.cfg.hidden_size},)")
        with torch.no_grad():
            self.norm.weight.copy_(norm.detach().to(self.norm.weight.device, self.norm.weight.dtype))

    def borrow_target_head(self, embed: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Share the target's frozen embedding (V, H) and lm_head (V, H) weights, and its final norm
        (H,) when the drafter has no own norm (`own_norm=False`).

        The tensors are shared, not copied: call with the target's weights on this replica's device.
        """
        V, H = self.cfg.vocab_size, self.cfg.hidden_size
        for name, w, shape in (("embedding", embed, (V, H)), ("final norm", norm, (H,)), ("lm_head", lm_head, (V, H))):
            if tuple(w.shape) != shape:
                raise ValueError(f"target {name} has shape {tuple(w.shape)}, drafter expects {shape}")
        self.embed_tokens.weight = nn.Parameter(embed.detach(), requires_grad=False)
        if not self.cfg.own_norm:
            self.norm.weight = nn.Parameter(norm.detach(), requires_grad=False)
        self.lm_head.weight = nn.Parameter(lm_head.detach(), requires_grad=False)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith(self.frozen_prefixes)}

    def load_trainable_state_dict(self, sd: dict[str, torch.Tensor]) -> list[str]:
        """Load weights saved by `trainable_state_dict`; the key sets must match exactly, except that
        a checkpoint from before the drafter had its own final norm may lack `norm.weight` (the norm
        then keeps its value, the target's after `init_norm`). Returns the keys it kept that way."""
        want, got = set(self.trainable_state_dict()), set(sd)
        kept = sorted(k for k in want - got if k.startswith(NORM_PREFIX))
        if want - set(kept) != got:
            raise ValueError(f"weights do not fit this drafter: missing {sorted(want - got - set(kept))[:3]}, "
                             f"unexpected {sorted(got - want)[:3]}")
        self.load_state_dict(sd, strict=False)
        return kept

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(k, p) for k, p in self.named_parameters() if not k.startswith(self.frozen_prefixes)]

    def forward(self, block_ids, block_pos, ctx_feats, ctx_pos, mask, masked_blocks: bool = False,
                predicted_only: bool = False) -> torch.Tensor:
        # block_ids, block_pos (B, Tq) int; ctx_feats (B, Tc, n*H); ctx_pos (B, Tc) int;
        # mask (B, Tq, Tc+Tq) bool, True = may attend (or an attention.SparseMask). Returns hidden (B, Tq, H).
        # The residual stream runs in the drafter's own dtype (fp32 master weights; matmuls follow autocast),
        # even where the borrowed embedding is bf16.
        # masked_blocks: block_ids are masks.block_inputs' blocks, [anchor, MASK x (Bs-1)] each. Then
        # the first layer's input repeats one row Bs-1 times per block, and its norm and q/k/v
        # projections run on the anchors' rows and that row only (15/16 of their matmuls skipped at
        # Bs 16); every later layer sees distinct rows. Same function (tests/test_trainer_model.py).
        # predicted_only: return the hidden states of block positions 1..Bs-1 only, (B, n * (Bs-1), H)
        # (predicted_rows; position 0 is the anchor, with nothing to predict). The last layer then
        # runs its o_proj, residual and MLP on those rows only (1/Bs of its o_proj + MLP skipped).
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)  # (B, Tq, H)
        ctx = self.hidden_norm(self.fc(ctx_feats.to(self.fc.weight.dtype)))  # (B, Tc, H)
        hd, theta = self.cfg.head_dim, self.cfg.rope_theta
        rope_q = rope_cos_sin(block_pos, hd, theta, x.dtype)
        rope_k = rope_cos_sin(torch.cat([ctx_pos, block_pos], dim=1), hd, theta, x.dtype)
        bs = self.cfg.block_size if masked_blocks and self.cfg.block_size > 1 else 0
        if predicted_only and self.cfg.block_size < 2:
            raise ValueError("predicted_only needs blocks of 2 or more positions")
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, rope_q, rope_k, mask, bs if i == 0 else 0,
                      self.cfg.block_size if predicted_only and i == last else 0)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (B, T, H) -> logits (B, T, V) through the final norm and the target's frozen lm_head."""
        return self.lm_head(self.norm(hidden))


def flops_per_sample(cfg: DrafterConfig, seq_len: int, query_tokens: int) -> float:
    """Training FLOPs of one sample (forward + backward = 3x forward), SpecForge-style dense count.

    seq_len S context tokens, query_tokens Tq = anchors * block. Counts every matmul of the drafter,
    dense attention over all S + Tq keys, and the lm_head over the Tq block tokens; not the target's
    forward. For the Qwen3-8B benchmark shape (S 768, Tq 4096) this gives ~45 TFLOP.
    """
    H, S, Tq = cfg.hidden_size, seq_len, query_tokens
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = (2 * H * q_dim * Tq * 2            # q_proj, o_proj
                 + 2 * 2 * H * kv_dim * (S + Tq)   # k_proj, v_proj over context + block
                 + 3 * 2 * H * cfg.intermediate_size * Tq   # SwiGLU
                 + 2 * 2 * q_dim * Tq * (S + Tq))  # scores and weighted sum
    forward = cfg.num_layers * per_layer + 2 * cfg.num_target_layers * H * H * S + 2 * H * cfg.vocab_size * Tq
    return 3.0 * forward


def flops_needed(cfg: DrafterConfig, seq_len: int, query_tokens: int, attended_pairs: float | None = None) -> float:
    """Training FLOPs of one sample that the work actually requires (compare flops_per_sample).

    The differences from the dense count: the lm_head is frozen, so its backward is the input
    gradient only (2x its forward, not 3x); it runs on block positions 1..Bs-1 only (position 0 is
    the anchor, with no loss: trainer/model/draft_loss.py); attention counts only the (query, key) pairs
    the mask allows, `attended_pairs` per sample (attention.attended_pairs / batch), dense if None;
    the fc projection of the frozen target's features has no input gradient (2x); and the first
    layer's q/k/v projections of the block run on its distinct rows only, the anchors' and the MASK
    row (Drafter.forward masked_blocks); the last layer's o_proj and MLP run on positions 1..Bs-1
    only (Drafter.forward predicted_only). For the 8B shape (S 768, 256 anchors x 16, ~390 keys per
    query) this gives ~33.3 TFLOP (33.5 before the last layer's rows were counted, ~34.2 before the
    first layer's and the fc's, ~34.9 before the anchor rows were skipped at the head).
    """
    H, S, Tq = cfg.hidden_size, seq_len, query_tokens
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    dense_pairs = Tq * (S + Tq)
    pairs = dense_pairs if attended_pairs is None else attended_pairs
    head = 2 * H * cfg.vocab_size * Tq
    attn_dense = cfg.num_layers * 2 * 2 * q_dim * dense_pairs
    attn = cfg.num_layers * 2 * 2 * q_dim * pairs
    fc = 2 * cfg.num_target_layers * H * H * S
    repeated = Tq - Tq // cfg.block_size - 1 if cfg.block_size > 1 else 0  # first-layer rows not computed
    first = (2 * H * q_dim + 2 * 2 * H * kv_dim) * repeated
    anchors = Tq // cfg.block_size if cfg.block_size > 1 else 0     # last-layer rows not computed
    last = (2 * q_dim * H + 3 * 2 * H * cfg.intermediate_size) * anchors
    rest = flops_per_sample(cfg, seq_len, query_tokens) / 3.0 - head - attn_dense
    return 3.0 * (rest + attn - first - last) - fc + 2.0 * head * (cfg.block_size - 1) / cfg.block_size
