"""Shared by the engine-level tests: the `tiny` target, a 2-layer drafter and N CPU worker threads
(ThreadEngine), built as trainer/train/main.py builds them, and batches of random tokens for it."""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.model import masks
from trainer.run.data import Sample, make_batch
from trainer.run.log import RunLog
from trainer.model.drafter import Drafter
from trainer.engine.step import Replica, build_replica
from trainer.run.target import Target, load_target
from trainer.engine.workers import ThreadEngine


@dataclass
class Tiny:
    engine: ThreadEngine
    target: Target
    vocab: int
    pos_weights: torch.Tensor
    start: list[torch.Tensor]   # the trainable weights before any step (for "something trained")

    def batches(self, n: int, seed: int = 1, rows: int | None = None) -> list:
        """n batches of `rows` (default 2 per worker) random rows of 64 tokens, 4 anchors of block 16."""
        g = torch.Generator().manual_seed(seed)
        rows = rows or 2 * self.engine.size
        out = []
        for step in range(n):
            ids = torch.randint(0, self.vocab - 1, (rows, 64), generator=g).tolist()
            out.append(make_batch([Sample(tuple(r), (1,) * 64) for r in ids], pad_len=64, pad_id=0, step=step,
                                  seed=0, block_size=16, anchors=4, pos_weights=self.pos_weights))
        return out

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.engine.primary.params]


def tiny_engine(workers: int = 1, configure: Callable[[Replica], None] | None = None,
                target_hook: Callable[[Target], None] | None = None) -> Tiny:
    """Seeded: every call builds the same weights. configure(replica) runs in each worker after
    build_replica; target_hook(target) before the engine starts (e.g. to count its forwards)."""
    torch.manual_seed(0)
    target = load_target("tiny", device=torch.device("cpu"), dtype=torch.float32)
    dcfg = target.drafter_config(num_layers=2, block_size=16, mask_token_id=None)
    drafter = Drafter(dcfg)
    start = [p.detach().clone() for _, p in drafter.trainable_parameters()]
    copies = [drafter] + [copy.deepcopy(drafter) for _ in range(workers - 1)]
    pw = masks.position_weights(16, masks.default_gamma(16))
    if target_hook is not None:
        target_hook(target)

    def build(i, device):
        r = build_replica(i, device, copies[i], target, policy="eager", n_devices=workers, lr=1e-3,
                          betas=(0.9, 0.95), weight_decay=0.1, pos_weights=pw)
        if configure is not None:
            configure(r)
        return r

    engine = ThreadEngine.start([torch.device("cpu")] * workers, build, RunLog(None), 60.0, guard=False)
    return Tiny(engine, target, dcfg.vocab_size, pw, start)
