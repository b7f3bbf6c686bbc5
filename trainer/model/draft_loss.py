"""The unit that gets compiled: blocks + mask + drafter + logits + loss for one shard.

Kept apart from engine/step.py (which owns replicas and the update) so the fast paths of the forward
(block-sparse attention, fused linear + cross-entropy) change here and nowhere else.

Backends (both give the same loss; tests/test_trainer_kernels.py checks it):
- attention: "sdpa" (dense bool mask, F.scaled_dot_product_attention) or "flex" (block-sparse
  FlexAttention, trainer/model/attention.py).
- loss: "dense" (full logits, masks.block_loss) or "chunked" (trainer/model/fused_ce.py: norm + lm_head +
  CE chunk by chunk, never all the logits; needs the target's lm_head frozen, which it always is).
- "auto" (the default), same loss: on CUDA flex + chunked, the fastest on the H200
  (docs/benchmarks.md); elsewhere sdpa + dense (FlexAttention has no CPU backward).
"""
from __future__ import annotations

import torch
from torch import nn

from trainer.model import attention, fused_ce, masks
from trainer.model.drafter import Drafter
from trainer.model.linear import predicted_rows

ATTENTION_BACKENDS = ("auto", "flex", "sdpa")
LOSS_BACKENDS = ("auto", "chunked", "dense")


class DraftLoss(nn.Module):
    """The unit that gets compiled: blocks + mask + drafter + logits + loss for one shard."""

    def __init__(self, drafter: Drafter, pos_weights: torch.Tensor, *, attention: str = "auto",
                 loss: str = "auto"):
        super().__init__()
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {attention!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
        if loss not in LOSS_BACKENDS:
            raise ValueError(f"loss backend {loss!r}: choose one of {', '.join(LOSS_BACKENDS)}")
        if float(pos_weights[0]) != 0.0:
            raise ValueError("block position 0 is the anchor and must carry no loss (pos_weights[0] == 0)")
        self.drafter = drafter
        self.attention = attention
        self.loss = loss
        self.register_buffer("pos_weights", pos_weights, persistent=False)

    def backends(self, device: torch.device) -> tuple[str, str]:
        """(attention, loss) that forward uses on `device`, "auto" resolved; log it once per replica."""
        fast = torch.device(device).type == "cuda"
        att = self.attention
        if att == "auto":
            att = "flex" if fast and attention.FLEX else "sdpa"
        loss = self.loss
        if loss == "auto":
            frozen = not self.drafter.lm_head.weight.requires_grad
            # the lm_head's fp8 matmuls (--precision fp8-lmhead) live in the chunked loss
            loss = "chunked" if (fast or self._fp8_head()) and frozen else "dense"
        return att, loss

    def _fp8_head(self):
        """The lm_head's fp8 matmuls (fp8.Fp8Head) while gradients are computed; None otherwise."""
        return getattr(self.drafter.lm_head, "fp8", None) if torch.is_grad_enabled() else None

    def forward(self, feats, input_ids, loss_mask, anchors, valid):
        # feats (B, S, n*H) target features; input_ids, loss_mask (B, S); anchors, valid (B, N)
        cfg = self.drafter.cfg
        B, S = input_ids.shape
        att, loss = self.backends(input_ids.device)
        block_ids = masks.block_inputs(input_ids, anchors, cfg.block_size, cfg.mask_token_id)  # (B, Tq)
        block_pos = masks.block_positions(anchors, cfg.block_size)  # (B, Tq)
        labels, weights = masks.block_labels(input_ids, loss_mask, anchors, valid, self.pos_weights)  # (B, Tq)
        if att == "flex":
            mask = attention.sparse_mask(anchors, S, cfg.block_size)
        else:
            mask = masks.attention_mask(anchors, S, cfg.block_size)  # (B, Tq, S + Tq)
        ctx_pos = torch.arange(S, device=input_ids.device).expand(B, S)
        # Block position 0 is the anchor, given as input: weight 0, nothing to predict. The head
        # (a 4096 x 151936 matmul per token at the 8B shape) and the last layer's o_proj and MLP see
        # positions 1..Bs-1 only.
        bs = cfg.block_size
        hidden = self.drafter(block_ids, block_pos, feats, ctx_pos, mask, masked_blocks=True,
                              predicted_only=True)  # (B, n * (Bs-1), H)
        labels, weights = predicted_rows(labels, bs), predicted_rows(weights, bs)
        head = self._fp8_head()
        if loss == "chunked":
            loss_sum, correct, count = fused_ce.block_loss(hidden, self.drafter.norm, self.drafter.lm_head.weight,
                                                           labels, weights, bs - 1, fp8=head)
        elif head is not None:
            raise ValueError("the lm_head's fp8 matmuls (--precision fp8-lmhead) need the chunked loss")
        else:
            loss_sum, correct, count = masks.block_loss(self.drafter.logits(hidden), labels, weights, bs - 1)
        zero = correct.new_zeros(1)   # per-position counts keep position 0 (always 0 of 0)
        return loss_sum, torch.cat([zero, correct]), torch.cat([zero, count])
