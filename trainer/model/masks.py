"""Blocks, anchors, labels, loss weights and the training attention mask, as pure functions.

The rules (docs/background.md#dflash), in one place because getting any of them wrong trains to high accuracy and
terrible acceptance (SpecForge #455, fixed in #473):

- A block is [anchor token, MASK x (B-1)] at positions anchor+0 .. anchor+B-1.
- Block position k predicts the token at anchor+k; position 0 (the anchor itself) has no loss.
- A block sees target context strictly before its anchor (kv < anchor, not <=), itself
  bidirectionally, and no other block.
- Loss = sum(w_k * CE) / sum(w_k), w_k = exp(-(k-1)/gamma), times the sequence's loss mask.
  Under D-PACE (--position-weights dpace): loss = sum(d_k * CE) / sum(m_k), m_k the loss mask (0 at
  the anchor) and d_k = dpace_weights(CE, m), from the drafter's own confidence in the block.
- Distilled (trainer/model/objective.py): the target's distribution over the token at anchor+k is
  its logits at position anchor+k-1 (a causal LM predicts the next token), same weights.
- Anchors: up to N per sequence, uniformly from positions with loss mask 1 and pos <= len - B,
  resampled every step.

Shapes: B sequences, S padded sequence length, N anchors per sequence, Bs block size,
Tq = N * Bs query tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# gamma per block size from the DFlash recipe (docs/recipe.md, with its source).
_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """gamma of the decay w_k = exp(-(k-1)/gamma): the recipe's value, else ~7/16 of the block."""
    return _GAMMA.get(block_size, max(1.0, block_size * 7.0 / 16.0))


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(Bs,) float: w_0 = 0 (the anchor), w_k = exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def flat_weights(block_size: int) -> torch.Tensor:
    """(Bs,) float: 0 at the anchor, 1 at every predicted position. D-PACE's rows (dpace_weights
    weighs them) and what its loss divides by: the count of loss-bearing tokens, as speculators'
    loss_function divides by the loss mask's sum."""
    w = torch.ones(block_size, dtype=torch.float32)
    w[0] = 0.0
    return w


def dpace_weights(ce: torch.Tensor, mask: torch.Tensor, block: int, alpha: float) -> torch.Tensor:
    """D-PACE's weight of each predicted row, from the drafter's confidence in its block (no gradient).

    ce, mask (..., R): the rows' cross-entropy and loss mask (0 or 1), R = n * block rows, block
    after block (linear.predicted_rows' layout: block positions 1..Bs-1, so block = Bs - 1). Per
    block, with q_i = exp(-CE_i) the drafter's probability of the data's token at position i:

        s_i = (1 - alpha) q_i + alpha where m_i > 0, else 1      (smoothed confidence, Eq. 7)
        w_k = m_k * sum_{j >= k} m_j prod_{i <= j} s_i           (Eq. 8)

    With E = sum_j prod_{i<=j} s_i the block's expected accepted length under the smoothed
    confidences, w_k = d E / d log s_k: what position k's token is worth to the run through it. A row
    past a masked one keeps its weight (the mask's 1 passes the product through), as upstream.
    Returns (..., R) in float32 (float64 for a float64 ce).

    The arithmetic is speculators 0.9.0's dpace_loss_decay (speculators/losses/utils.py), on rows
    without the anchor's (weight 0 there, a factor 1 in the product: the same weights), whose loss
    then is sum(CE * m * w) / sum(m); with a 0/1 mask that is this sum(CE * w) / sum(m).
    """
    with torch.no_grad():
        dt = torch.promote_types(ce.dtype, torch.float32)
        q = torch.exp(-ce.detach().to(dt)).unflatten(-1, (-1, block))  # (..., n, block)
        m = mask.detach().to(dt).reshape(q.shape)
        s = torch.where(m > 0, (1.0 - alpha) * q + alpha, torch.ones_like(q))
        prefix = torch.cumprod(s, dim=-1)
        suffix = torch.flip(torch.cumsum(torch.flip(prefix * m, dims=[-1]), dim=-1), dims=[-1])
        return (suffix * m).flatten(-2)


def anchor_candidates(loss_mask: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """loss_mask (S,) -> positions p with loss_mask[p] == 1 and p <= length - block_size, ascending."""
    last = length - block_size
    if last < 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.nonzero(loss_mask[: last + 1] > 0).flatten()


def sample_anchors(loss_mask: torch.Tensor, length: int, block_size: int, n: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to n distinct anchors drawn uniformly from the candidates, sorted; padded to n.

    Returns anchors (n,) long and valid (n,) bool; padding entries are anchor 0 with valid False.
    """
    cand = anchor_candidates(loss_mask, length, block_size)
    anchors = torch.zeros(n, dtype=torch.long)
    valid = torch.zeros(n, dtype=torch.bool)
    if len(cand) == 0:
        return anchors, valid
    pick = torch.randperm(len(cand), generator=generator)[:n]
    chosen = cand[pick].sort().values
    anchors[: len(chosen)] = chosen
    valid[: len(chosen)] = True
    return anchors, valid


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """anchors (B, N) -> positions (B, N*Bs): anchor + k for k in 0..Bs-1, block after block."""
    k = torch.arange(block_size, device=anchors.device)
    return (anchors[..., None] + k).flatten(-2)


def block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 mask_token_id: int) -> torch.Tensor:
    """input_ids (B, S), anchors (B, N) -> block token ids (B, N*Bs): [anchor token, MASK x (Bs-1)]."""
    anchor_tok = torch.gather(input_ids, 1, anchors)  # (B, N)
    blocks = torch.full((*anchors.shape, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    blocks[..., 0] = anchor_tok
    return blocks.flatten(-2)


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                 pos_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and loss weights for every block token.

    input_ids, loss_mask (B, S); anchors (B, N); valid (B, N); pos_weights (Bs,).
    Returns labels (B, N*Bs) = input_ids[anchor + k] and weights (B, N*Bs) =
    w_k * loss_mask[anchor + k] * valid (0 at k = 0). Positions past S are clamped (weight 0 there
    only if invalid; valid anchors satisfy anchor + Bs - 1 < length <= S by construction).
    """
    S = input_ids.shape[1]
    pos = block_positions(anchors, len(pos_weights)).clamp(max=S - 1)  # (B, N*Bs)
    labels = torch.gather(input_ids, 1, pos)
    lm = torch.gather(loss_mask, 1, pos).to(pos_weights.dtype)
    w = pos_weights.to(lm.device).repeat(anchors.shape[1])  # (N*Bs,)
    v = valid.repeat_interleave(len(pos_weights), dim=1).to(lm.dtype)  # (B, N*Bs)
    return labels, w * lm * v


def teacher_positions(anchors: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """anchors (B, N) -> (B, N*Bs): the position whose target output predicts each block token,
    anchor + k - 1 (clamped into 0..seq_len-1: block position 0, the anchor, carries no loss)."""
    return (block_positions(anchors, block_size) - 1).clamp(0, seq_len - 1)


def attention_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """anchors (B, N) -> bool (B, N*Bs, S + N*Bs); True means the query may attend to the key.

    Keys are [context positions 0..S-1; block tokens]. A block's queries see context kv < anchor
    (strictly), all tokens of their own block, and nothing of any other block.
    """
    N = anchors.shape[1]
    dev = anchors.device
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # (B, Tq)
    ctx = torch.arange(seq_len, device=dev)[None, None, :] < q_anchor[..., None]  # (B, Tq, S)
    blk = torch.arange(N, device=dev).repeat_interleave(block_size)  # (Tq,)
    own = (blk[:, None] == blk[None, :]).expand(anchors.shape[0], -1, -1)  # (B, Tq, Tq)
    return torch.cat([ctx, own], dim=-1)


def block_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, block_size: int,
               dpace: float | None = None):
    """Weighted cross entropy and per-position accuracy counts.

    logits (B, Tq, V); labels, weights (B, Tq). Returns loss_sum (scalar: sum w*CE, to be divided by
    the GLOBAL sum of weights so shards of a batch add up exactly), correct (Bs,) and count (Bs,):
    per block position, how many loss-bearing (weight > 0) tokens were predicted right / seen.
    dpace (its alpha): `weights` are the loss mask (flat_weights') and each row's CE is weighted by
    dpace_weights(CE, weights, block_size, dpace) instead.
    """
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view_as(weights)
    w = weights if dpace is None else dpace_weights(ce, weights, block_size, dpace)
    loss_sum = (ce * w).sum()
    live = (weights > 0).view(weights.shape[0], -1, block_size)  # (B, N, Bs)
    hit = (logits.argmax(-1) == labels).view_as(live) & live
    return loss_sum, hit.sum(dim=(0, 1)), live.sum(dim=(0, 1))


def block_kd(logits: torch.Tensor, teacher_logits: torch.Tensor, weights: torch.Tensor, temperature: float):
    """Weighted distillation loss, the reference of fused_ce's chunked one (trainer/model/objective.py).

    logits (B, Tq, V) the drafter's; teacher_logits (B, Tq, V) the target's at the same rows (no
    gradient flows to them); weights (B, Tq). Returns the scalar sum of w * T^2 * KL(p_T || q_T),
    p_T = softmax(teacher / T), q_T = softmax(logits / T), to be divided as block_loss's sum is.
    """
    t = float(temperature)
    log_q = F.log_softmax(logits.float() / t, dim=-1)
    log_p = F.log_softmax(teacher_logits.detach().float() / t, dim=-1)
    kl = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)  # (B, Tq)
    return (kl * weights).sum() * (t * t)
