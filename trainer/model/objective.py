"""What the drafter learns at each predicted block position: the knobs, checked once, without torch.

- ce: the cross-entropy against the data's token there (regen rows: the target's own greedy answer).
- kd: distillation from the target: the forward KL from the target's distribution at that position
  (its logits at the position before the token, masks.teacher_positions) to the drafter's, both at
  temperature T, scaled by T^2 so that its gradient keeps its size as T changes (Hinton, Vinyals and
  Dean, "Distilling the Knowledge in a Neural Network", arXiv 1503.02531):
  T^2 * sum_v p_T(v) (log p_T(v) - log q_T(v)), p_T = softmax(target logits / T), q_T likewise.
- ce+kd: (1 - mix) * CE + mix * KD.

Every row carries the same weight under each (the block position's decay times the loss mask,
masks.block_labels), and the sum is divided by the same total. The dense loss computes KD on the
full logits (masks.block_kd, the reference); the chunked one chunk by chunk (trainer/model/fused_ce.py).

How much each block position counts (--position-weights):
- exp: the recipe's fixed decay w_k = exp(-(k-1)/gamma) (masks.position_weights), the same for every block.
- dpace: D-PACE ("Dynamic Position-Aware Cross-Entropy for Parallel Speculative Drafting", arXiv
  2605.18810), as vLLM's speculators 0.9.0 trains DFlash (speculators/losses/utils.py,
  dpace_loss_decay): each row's weight is computed from the drafter's own confidence in the block,
  detached, at every step (masks.dpace_weights), with the rows' CE it weighs. It needs ce: the
  confidence is exp(-CE) of the data's token (speculators' TrainConfig refuses dpace without its ce
  loss too).

The fields are the trainer's flags (--objective, --kd-temperature, --kd-mix, --position-weights,
--dpace-alpha); no torch here, so the trainer's config validates with it before torch is imported.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

OBJECTIVES = ("ce", "kd", "ce+kd")
POSITION_WEIGHTS = ("exp", "dpace")


@dataclass(frozen=True)
class Objective:
    name: str = "ce"              # one of OBJECTIVES
    kd_temperature: float = 1.0   # T of kd and ce+kd
    kd_mix: float = 0.5           # KD's share of ce+kd (the other objectives ignore it)
    position_weights: str = "exp"  # one of POSITION_WEIGHTS
    dpace_alpha: float = 0.5      # dpace's confidence smoothing: (1 - alpha) q + alpha, in (0, 1]

    def __post_init__(self):
        if self.name not in OBJECTIVES:
            raise ValueError(f"--objective {self.name!r}: expected one of {', '.join(OBJECTIVES)}")
        if not (math.isfinite(self.kd_temperature) and self.kd_temperature > 0):
            raise ValueError(f"--kd-temperature must be a positive number, got {self.kd_temperature}")
        if not 0.0 <= self.kd_mix <= 1.0:
            raise ValueError(f"--kd-mix is KD's share of --objective ce+kd, in [0, 1]; got {self.kd_mix}")
        if self.position_weights not in POSITION_WEIGHTS:
            raise ValueError(f"--position-weights {self.position_weights!r}: expected one of "
                             f"{', '.join(POSITION_WEIGHTS)}")
        if not 0.0 < self.dpace_alpha <= 1.0:  # also refuses nan
            raise ValueError(f"--dpace-alpha is D-PACE's confidence smoothing, in (0, 1]; got {self.dpace_alpha}")
        if self.dpace and self.name != "ce":
            raise ValueError(f"--position-weights dpace weighs each position by the drafter's confidence in the "
                             f"data's token (exp(-CE)): it needs --objective ce, not {self.name}")

    @property
    def weights(self) -> tuple[float, float]:
        """(CE's weight, KD's weight) in the loss."""
        if self.name == "ce":
            return 1.0, 0.0
        if self.name == "kd":
            return 0.0, 1.0
        return 1.0 - self.kd_mix, self.kd_mix

    @property
    def distills(self) -> bool:
        """The loss reads the target's logits at the predicted positions (kd, ce+kd)."""
        return self.name != "ce"

    @property
    def dpace(self) -> bool:
        """The rows are weighted by D-PACE (masks.dpace_weights) instead of the fixed decay."""
        return self.position_weights == "dpace"

    def described(self) -> str:
        """For the run's log: 'kd (T 2)', 'ce+kd (T 1, KD's share 0.3)', 'ce', 'ce, D-PACE position
        weights (alpha 0.5)'."""
        if self.dpace:
            return f"{self.name}, D-PACE position weights (alpha {self.dpace_alpha:g})"
        if not self.distills:
            return self.name
        share = f", KD's share {self.kd_mix:g}" if self.name == "ce+kd" else ""
        return f"{self.name} (T {self.kd_temperature:g}{share})"
