"""A run's evals: acceptance length on the eval prompts and the training loss on the held-out rows they
come from, measured by the primary replica (worker 0's thread, or rank 0), logged as an eval line and
metric record; tau_metrics is what the metric records carry of one (what `dflash-ops report`, `status`
and the trackers read).
"""
from __future__ import annotations

import math
import threading
import time

import torch

from trainer.engine.protocol import Engine
from trainer.run.config import TrainConfig
from trainer.run.data import make_batch
from trainer.run.acceptance import acceptance_length
from trainer.run.log import eval_line
from trainer.train.setup import Prepared


def evaluate(cfg: TrainConfig, log, engine: Engine, prep: Prepared, step: int, final: bool = False,
             stop: threading.Event | None = None) -> dict | None:
    """Acceptance length on the eval prompts, measured by the primary replica (worker 0's thread, or
    rank 0); its result (None on other ranks)."""
    if not final:
        engine.excuse_until_boundary()   # on every rank: the writer works alone, the others wait for it
    if not engine.writer:
        return None
    t = time.time()
    r0 = engine.primary
    res = engine.on_primary(acceptance_length, r0.target, r0.drafter, prep.eval_prompts,
                            max_new_tokens=cfg.eval_new_tokens, should_stop=stop.is_set if stop else (lambda: False))
    loss = engine.on_primary(heldout_loss, r0, cfg, prep) if res is not None else None
    if res is not None and loss is not None:
        res = {**res, "heldout_loss": loss}
    log.info(f"eval at step {step}: {eval_line(res, prep.eval_overlap)}"
             + (f"; held-out loss {loss:.4f}" if loss is not None else "") + f" ({time.time() - t:.1f}s)")
    if not final:
        log.metrics({"event": "eval", "step": step, **tau_metrics(res)})
    return res


@torch.no_grad()
def heldout_loss(r, cfg: TrainConfig, prep: Prepared) -> float | None:
    """The training loss on the held-out rows (those the eval prompts come from), no gradient: the same
    DraftLoss, uncompiled, on them a training batch's rows at a time, with the anchors of a fixed draw
    so evals compare; None without held-out rows."""
    total = weight = 0.0
    for i in range(0, len(prep.held_out), max(1, cfg.batch_size)):     # a training batch's rows at a time
        b = make_batch(prep.held_out[i:i + cfg.batch_size], pad_len=prep.pad_len, pad_id=0, step=i, seed=cfg.seed,
                       block_size=cfg.block_size, anchors=prep.anchors, pos_weights=prep.pos_weights)
        d = b.to(r.device)
        feats = r.target.features(d.input_ids, eager=True)
        with r.autocast:
            loss_sum, _, _ = r.loss_module(feats, d.input_ids, d.loss_mask, d.anchors, d.valid)
        total, weight = total + float(loss_sum), weight + b.weight_total
    loss = total / weight if weight > 0 else math.nan
    return round(loss, 6) if math.isfinite(loss) else None


def tau_metrics(res: dict | None) -> dict:
    """An eval's numbers in the metric records (what `dflash-ops report` and `status` read)."""
    keys = ("acceptance_length", "rounds", "tau_ci95", "accept_rate_by_position", "heldout_loss")
    return {k: res[k] for k in keys if k in res} if res else {"acceptance_length": None}
