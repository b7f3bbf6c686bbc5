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

The objective (trainer/model/objective.py): CE against the data's tokens, or distillation from the
target (kd, ce+kd). Distilling, `feats` carries the target's final hidden state (after its final
norm) after the n layers' features, (B, S, n*H + H) (Target.final_hidden), and both loss backends
compute the same mix of CE and KD (tests/test_distill.py checks it). Under D-PACE position weights
(Objective.dpace) `pos_weights` are masks.flat_weights and both backends weigh each row by
masks.dpace_weights (tests/test_dpace.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.model import attention, fused_ce, masks
from trainer.model.drafter import Drafter
from trainer.model.linear import predicted_rows
from trainer.model.objective import Objective

ATTENTION_BACKENDS = ("auto", "flex", "sdpa")
LOSS_BACKENDS = ("auto", "chunked", "dense")


class DraftLoss(nn.Module):
    """The unit that gets compiled: blocks + mask + drafter + logits + loss for one shard."""

    pos_weights: torch.Tensor   # a buffer (register_buffer below), declared for the type checker

    def __init__(self, drafter: Drafter, pos_weights: torch.Tensor, *, attention: str = "auto",
                 loss: str = "auto", objective: Objective = Objective()):
        super().__init__()
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {attention!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
        if loss not in LOSS_BACKENDS:
            raise ValueError(f"loss backend {loss!r}: choose one of {', '.join(LOSS_BACKENDS)}")
        if float(pos_weights[0]) != 0.0:
            raise ValueError("block position 0 is the anchor and must carry no loss (pos_weights[0] == 0)")
        if objective.dpace and not bool((pos_weights[1:] == 1).all()):
            raise ValueError("D-PACE weighs the loss mask's rows itself: pos_weights must be masks.flat_weights")
        self.drafter = drafter
        self.attention = attention
        self.loss = loss
        self.objective = objective
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
        # feats (B, S, n*H) target features, with the target's final hidden state after them (B, S,
        # n*H + H) when distilling; input_ids, loss_mask (B, S); anchors, valid (B, N)
        cfg = self.drafter.cfg
        B, S = input_ids.shape
        att, loss = self.backends(input_ids.device)
        feats, final = self._split(feats)
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
        teacher = None
        if final is not None:  # (B, n * (Bs-1), H): the target's output at the position before each token
            at = predicted_rows(masks.teacher_positions(anchors, bs, S), bs)
            teacher = torch.gather(final, 1, at[..., None].expand(-1, -1, final.shape[-1]))
        head = self._fp8_head()
        lm_w = self.drafter.lm_head.weight
        if loss == "chunked":
            loss_sum, correct, count = fused_ce.block_loss(hidden, self.drafter.norm, lm_w, labels, weights, bs - 1,
                                                           fp8=head, teacher=teacher, objective=self.objective)
        elif head is not None:
            raise ValueError("the lm_head's fp8 matmuls (--precision fp8-lmhead) need the chunked loss")
        else:
            logits = self.drafter.logits(hidden)
            dpace = self.objective.dpace_alpha if self.objective.dpace else None
            loss_sum, correct, count = masks.block_loss(logits, labels, weights, bs - 1, dpace=dpace)
            if teacher is not None:
                ce_weight, kd_weight = self.objective.weights
                kd_sum = masks.block_kd(logits, F.linear(teacher, lm_w), weights, self.objective.kd_temperature)
                loss_sum = ce_weight * loss_sum + kd_weight * kd_sum
        zero = correct.new_zeros(1)   # per-position counts keep position 0 (always 0 of 0)
        return loss_sum, torch.cat([zero, correct]), torch.cat([zero, count])

    def _split(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """feats -> (the n layers' features (B, S, n*H), the target's final hidden state (B, S, H) or
        None); a ValueError when their width is not what the objective needs."""
        cfg = self.drafter.cfg
        width = cfg.num_target_layers * cfg.hidden_size
        want = width + cfg.hidden_size if self.objective.distills else width
        if feats.shape[-1] != want:
            raise ValueError(f"objective {self.objective.name}: expected target features of width {want}, got "
                             f"{feats.shape[-1]}" + (" (a distilling objective needs the target's final hidden "
                                                     "state after them: Target.final_hidden)"
                                                     if self.objective.distills else ""))
        if not self.objective.distills:
            return feats, None
        # contiguous: the drafter's fc reads the same layout as without the final state
        return feats[..., :width].contiguous(), feats[..., width:]
