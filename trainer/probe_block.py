"""The probe's drafter-shaped block and its batches (field notes 5).

Self-contained on purpose: the trainer's model may change, and the probe must still measure the
same thing. A few layers shaped like the drafter (Qwen3-style attention over [context; block],
frozen embedding/norm/lm_head, decay-weighted CE) and CPU batches with the DFlash mask.
Sizes: CPU_CONFIG for a quick run on any machine, GPU_CONFIG for a realistic step on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SEED = 1234


@dataclass(frozen=True)
class BlockConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    taps: int          # target layers whose hidden states condition the drafter
    batch: int
    context: int       # Tc: target tokens
    blocks: int        # anchors per sequence
    block_size: int
    gamma: float       # loss decay over block positions


CPU_CONFIG = BlockConfig(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256,
                         layers=2, taps=3, batch=2, context=32, blocks=2, block_size=8, gamma=4.0)
GPU_CONFIG = BlockConfig(hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=2816,
                         vocab=32768, layers=2, taps=5, batch=4, context=512, blocks=16,
                         block_size=16, gamma=7.0)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight.to(x.dtype)


def _rope(x, cos, sin):  # x (B, h, T, d), cos/sin (B, 1, T, d)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Layer(nn.Module):
    """Qwen3-style: q/k norm, RoPE, GQA; keys/values over [context; block], queries from the block."""

    def __init__(self, c: BlockConfig):
        super().__init__()
        self.c = c
        self.attn_norm, self.mlp_norm = RMSNorm(c.hidden), RMSNorm(c.hidden)
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        self.q_norm, self.k_norm = RMSNorm(c.head_dim), RMSNorm(c.head_dim)
        self.gate = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x, ctx, mask, cos_q, sin_q, cos_k, sin_k):
        c = self.c
        B, Q, _ = x.shape
        h = self.attn_norm(x)
        kv = torch.cat([ctx, h], dim=1)                                          # (B, Tc+Q, H)
        T = kv.shape[1]
        q = self.q_norm(self.q_proj(h).view(B, Q, c.heads, c.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv).view(B, T, c.kv_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(kv).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rope(q, cos_q, sin_q), _rope(k, cos_k, sin_k)
        rep = c.heads // c.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, heads, T, d)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)             # (B, heads, Q, d)
        x = x + self.o_proj(o.transpose(1, 2).reshape(B, Q, c.heads * c.head_dim))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class ProbeDrafter(nn.Module):
    """Frozen target embedding/norm/lm_head; trainable context projection and layers; weighted CE."""

    def __init__(self, c: BlockConfig, amp_dtype: torch.dtype | None):
        super().__init__()
        self.amp_dtype = amp_dtype
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.fc = nn.Linear(c.taps * c.hidden, c.hidden, bias=False)
        self.ctx_norm = RMSNorm(c.hidden)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        for m in (self.embed, self.norm, self.lm_head):
            m.requires_grad_(False)

    def forward(self, ctx_hidden, block_ids, mask, cos_q, sin_q, cos_k, sin_k, labels, weights):
        if self.amp_dtype is None:
            logits = self._logits(ctx_hidden, block_ids, mask, cos_q, sin_q, cos_k, sin_k)
        else:
            with torch.autocast(device_type="cuda", dtype=self.amp_dtype):   # bf16 only on GPU
                logits = self._logits(ctx_hidden, block_ids, mask, cos_q, sin_q, cos_k, sin_k)
        ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        w = weights.flatten()
        return (ce * w).sum() / w.sum()

    def _logits(self, ctx_hidden, block_ids, mask, cos_q, sin_q, cos_k, sin_k):
        ctx = self.ctx_norm(self.fc(ctx_hidden))                                 # (B, Tc, H)
        x = self.embed(block_ids)                                                # (B, Q, H)
        for layer in self.layers:
            x = layer(x, ctx, mask, cos_q, sin_q, cos_k, sin_k)
        return self.lm_head(self.norm(x))                                        # (B, Q, V)


def make_batches(c: BlockConfig, n: int, seed: int = SEED) -> list[tuple[torch.Tensor, ...]]:
    """n CPU batches: random target features/tokens, anchors, the DFlash mask (a block sees context
    strictly before its anchor and itself), labels token[anchor+k], weights exp(-(k-1)/gamma)."""
    g = torch.Generator().manual_seed(seed)
    B, C, nb, bs, d = c.batch, c.context, c.blocks, c.block_size, c.head_dim
    Q = nb * bs
    k = torch.arange(bs)
    w_block = torch.where(k > 0, torch.exp(-(k - 1).clamp(min=0) / c.gamma), torch.zeros(bs))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    out = []
    for _ in range(n):
        tokens = torch.randint(1, c.vocab, (B, C), generator=g)                 # 0 is MASK
        ctx_hidden = torch.randn(B, C, c.taps * c.hidden, generator=g)
        anchors = torch.stack([torch.randperm(C - bs, generator=g)[:nb].sort().values + 1
                               for _ in range(B)])                              # (B, nb) in [1, C-bs]
        pos_q = (anchors[:, :, None] + k).reshape(B, Q)                         # (B, Q)
        labels = torch.gather(tokens, 1, pos_q.clamp(max=C - 1))
        block_ids = torch.zeros(B, nb, bs, dtype=torch.long)
        block_ids[:, :, 0] = torch.gather(tokens, 1, anchors)
        block_of_q = torch.arange(Q) // bs
        sees_ctx = torch.arange(C)[None, None, :] < anchors.repeat_interleave(bs, 1)[:, :, None]
        sees_blk = (block_of_q[:, None] == block_of_q[None, :]).expand(B, Q, Q)
        mask = torch.cat([sees_ctx, sees_blk], dim=2)[:, None]                  # (B, 1, Q, C+Q)
        pos_k = torch.cat([torch.arange(C).expand(B, C), pos_q], dim=1)         # (B, C+Q)

        def rope(pos):
            f = pos[:, None, :, None].float() * inv_freq                        # (B, 1, T, d/2)
            f = torch.cat([f, f], dim=-1)
            return f.cos(), f.sin()

        cos_q, sin_q = rope(pos_q)
        cos_k, sin_k = rope(pos_k)
        out.append((ctx_hidden, block_ids.reshape(B, Q), mask, cos_q, sin_q, cos_k, sin_k,
                    labels, w_block.repeat(B, nb)))
    return out
