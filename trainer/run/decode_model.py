"""What a decode costs, predicted from step costs measured on their own.

A greedy decode of N new tokens at batch 1:
- the target alone: its prompt's forward (which gives the first new token), then N - 1 one-token steps;
- with the drafter: its prompt's forward (features into the drafter too), then one round per
  tau tokens after the first: draft a block, verify it, extend the drafter's context, and one host
  synchronisation to read the accept decision.

So for one prompt, with `rounds = (N - 1) / tau`:

    alone = prefill_alone + (N - 1) * step
    spec  = prefill_spec  + rounds * round
    speedup = alone / spec          -> tau * step / round for long outputs

The costs come from replaying each captured step alone (trainer/run/decode_graphs.py, step_costs;
benchmarks/decode_shapes.py at a model's shape), not from the decode's own totals, so the prediction
can disagree with the measurement and is worth printing beside it. Pure arithmetic: no torch.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class RoundCosts:
    """Seconds, each measured alone. `round`: draft + verify + extend replayed back to back with the
    round's one host synchronisation (so round - draft - verify - extend is the host's share);
    `step`: the target's one-token step with its synchronisation. The prefills: the prompt's forward
    at the length the prediction is for (0 leaves it out)."""
    step: float
    draft: float
    verify: float
    extend: float
    round: float
    prefill_alone: float = 0.0
    prefill_spec: float = 0.0

    @property
    def host(self) -> float:
        return max(0.0, self.round - self.draft - self.verify - self.extend)

    def as_ms(self) -> dict:
        return {k: 1e3 * v for k, v in {**asdict(self), "host": self.host}.items()}

    @classmethod
    def from_ms(cls, ms: Mapping) -> RoundCosts:
        """The inverse of as_ms(): a document's milliseconds back to seconds. Every part must be there
        (KeyError names a missing one); "host" is derived, so it is not read."""
        return cls(**{f.name: float(ms[f.name]) / 1e3 for f in fields(cls)})


def predict_prompt(c: RoundCosts, new_tokens: int, rounds: float) -> tuple[float, float]:
    """(seconds alone, seconds with the drafter) of one prompt of `new_tokens` that took `rounds`."""
    return c.prefill_alone + max(0, new_tokens - 1) * c.step, c.prefill_spec + rounds * c.round


def speedup_at(c: RoundCosts, tau: float, new_tokens: int | None = None) -> float:
    """The predicted speedup at acceptance length tau for outputs of `new_tokens` (None: long outputs,
    where the prompt's forward no longer counts)."""
    if new_tokens is None:
        return tau * c.step / c.round
    alone, spec = predict_prompt(c, new_tokens, max(0, new_tokens - 1) / tau)
    return alone / spec


def tau_for(c: RoundCosts, speedup: float, new_tokens: int | None = None) -> float | None:
    """The acceptance length at which the predicted speedup is `speedup`; None where no tau reaches it
    (the prompt's forward with the drafter alone costs more than 1/speedup of the decode alone)."""
    if new_tokens is None:
        return speedup * c.round / c.step
    n = max(0, new_tokens - 1)
    room = c.prefill_alone + n * c.step - speedup * c.prefill_spec
    if n == 0 or room <= 0:
        return None
    return speedup * n * c.round / room


__all__ = ["RoundCosts", "predict_prompt", "speedup_at", "tau_for"]
