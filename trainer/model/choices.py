"""How the drafter's step runs on a GPU, for this process: the choices TrainConfig carries
(--fp32-wgrad, --flex-tiles, --ce-rows, --ce-kernel; docs/decisions.md), set on the modules that
read them. The defaults are the measured best; a benchmark's A/B sets one through the same call.
"""
from __future__ import annotations

from trainer.model import attention, ce_kernel, fused_ce, linear


def configure(*, fp32_wgrad: bool = True, flex_tiles: str = "", ce_rows: int = 0, ce_kernel_on: bool = True) -> None:
    """fp32_wgrad: Linear's weight gradient in fp32 from cuBLAS (else autocast's bf16). flex_tiles:
    FlexAttention's tiles, 'BWD[/FWD][+kv]' ("" = the tuned choice). ce_rows: rows per chunk of the
    fused cross-entropy (0 = the most whose fp32 logits fit in 1 GiB). ce_kernel_on: its core as one
    Triton kernel where it can run. ValueError for a bad flex_tiles or ce_rows."""
    attention.configure(flex_tiles or None)
    fused_ce.configure(ce_rows or None)
    linear.configure(fp32_wgrad)
    ce_kernel.configure(ce_kernel_on)
