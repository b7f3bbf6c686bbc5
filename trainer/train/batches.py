"""The training loop's batches, drawn one step ahead of the step that trains them (run_loop in
loop.py), with the loader position a checkpoint records."""
from __future__ import annotations

from trainer.run.config import TrainConfig
from trainer.run.data import Loader, make_batch


class Batches:
    """The loop's batches, one step ahead: take(step) is the batch to train now, peek(step + 1) the
    next one (the engine makes its target features during this step's gradient sum). Drawing the
    next batch moves the loader, so state() is the loader's position right after the last TAKEN
    batch: a checkpoint at a step boundary resumes exactly where the run left off, look-ahead or not.
    `prep`: the run's setup.Prepared (its samples, pad_len, anchors and pos_weights)."""

    def __init__(self, cfg: TrainConfig, prep, loader: Loader):
        self.cfg, self.prep, self.loader = cfg, prep, loader
        self._state = loader.state()
        self._next: tuple[int, object, dict] | None = None  # (step, batch, loader state after it)

    def take(self, step: int):
        _, batch, self._state = self._drawn(step)
        self._next = None
        return batch

    def peek(self, step: int):
        """The batch of `step`, drawn now and kept for take(step); None past the last step."""
        return self._drawn(step)[1] if step < self.cfg.steps else None

    def _drawn(self, step: int):
        if self._next is None or self._next[0] != step:
            self._next = self._draw(step)
        return self._next

    def state(self) -> dict:
        return self._state

    def _draw(self, step: int):
        cfg, prep = self.cfg, self.prep
        batch = make_batch([prep.samples[i] for i in self.loader.next(cfg.batch_size)], pad_len=prep.pad_len,
                           pad_id=0, step=step, seed=cfg.seed, block_size=cfg.block_size,
                           anchors=prep.anchors, pos_weights=prep.pos_weights)
        return step, batch, self.loader.state()
