"""The unit that gets compiled: blocks + mask + drafter + logits + loss for one shard.

Kept apart from step.py (which owns replicas and the update) so the fast paths of the forward
(block-sparse attention, fused linear + cross-entropy) change here and nowhere else.
"""
from __future__ import annotations

import torch
from torch import nn

from trainer import masks
from trainer.model import Drafter


class DraftLoss(nn.Module):
    """The unit that gets compiled: blocks + mask + drafter + logits + loss for one shard."""

    def __init__(self, drafter: Drafter, pos_weights: torch.Tensor):
        super().__init__()
        self.drafter = drafter
        self.register_buffer("pos_weights", pos_weights, persistent=False)

    def forward(self, feats, input_ids, loss_mask, anchors, valid):
        # feats (B, S, n*H) target features; input_ids, loss_mask (B, S); anchors, valid (B, N)
        cfg = self.drafter.cfg
        B, S = input_ids.shape
        block_ids = masks.block_inputs(input_ids, anchors, cfg.block_size, cfg.mask_token_id)  # (B, Tq)
        block_pos = masks.block_positions(anchors, cfg.block_size)  # (B, Tq)
        labels, weights = masks.block_labels(input_ids, loss_mask, anchors, valid, self.pos_weights)  # (B, Tq)
        mask = masks.attention_mask(anchors, S, cfg.block_size)  # (B, Tq, S + Tq)
        ctx_pos = torch.arange(S, device=input_ids.device).expand(B, S)
        hidden = self.drafter(block_ids, block_pos, feats, ctx_pos, mask)  # (B, Tq, H)
        return masks.block_loss(self.drafter.logits(hidden), labels, weights, cfg.block_size)
