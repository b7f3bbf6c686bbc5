"""Attention backends for the drafter's training pass: dense-mask SDPA, or block-sparse FlexAttention.

The training mask (masks.attention_mask) lets each 16-token block see its context prefix
(kv < anchor) and itself: with 256 anchors over 768 context tokens a query needs ~390 of the
4864 keys, so a dense mask wastes ~90% of the attention work. FlexAttention skips whole
128 x 128 tiles that the mask rules out; the rule itself is evaluated only in tiles that are
partly visible.

    mask = sparse_mask(anchors, S, block_size)   # or masks.attention_mask(...) for dense SDPA
    o = attend(q, k, v, mask)                    # what Attention.forward calls

`attend` takes either a bool tensor (the dense path, unchanged: what eval and decoding pass) or a
`SparseMask` (the flex path). Both compute the same function; tests/test_trainer_kernels.py checks it.
FlexAttention is only fast when torch.compile'd: inside a compiled DraftLoss dynamo traces it; in
an uncompiled (eager-policy) forward on CUDA the flex call alone is compiled here, and if that
compile fails the call falls back to dense SDPA (same function) for the rest of the process.
On a GPU the flex path is several times faster than dense attention (docs/decisions.md has the figures).
"""
from __future__ import annotations

import inspect
import math
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from trainer.model import masks

# Tile size of the block-sparse mask; FlexAttention's kernels tile by divisors of it.
TILE = 128


def flex_available() -> bool:
    """True when this torch has FlexAttention with BlockMask.from_kv_blocks(seq_lengths=...) (2.6+)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return "seq_lengths" in inspect.signature(BlockMask.from_kv_blocks).parameters


# Read once at import: forward() consults it under dynamo, which should see a constant.
FLEX = flex_available()


@dataclass
class SparseMask:
    """The training mask in block-sparse form, built once per forward and shared by every layer.

    anchors (B, N) long: the anchor of each block (block n holds queries n*Bs .. n*Bs+Bs-1).
    The tile lists are FlexAttention's (kv_num (B, 1, nq) int32, kv_idx (B, 1, nq, nk) int32) for
    partly visible tiles, and the same for fully visible ones. ctx_len S: keys 0..S-1 are context,
    S.. are block tokens.
    """
    anchors: torch.Tensor
    kv_num: torch.Tensor
    kv_idx: torch.Tensor
    full_num: torch.Tensor
    full_idx: torch.Tensor
    ctx_len: int
    block_size: int

    def density(self) -> float:
        """Fraction of the (nq x nk) tiles that are computed at all (partial + full)."""
        return float(self.kv_num.sum() + self.full_num.sum()) / self.kv_idx.numel()


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tiles (B, 1, nq, nk) bool -> (count (B, 1, nq) int32, indices (B, 1, nq, nk) int32, hits first)."""
    t = tiles.to(torch.int32)
    return t.sum(-1).to(torch.int32), torch.argsort(t, dim=-1, descending=True, stable=True).to(torch.int32)


def sparse_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> SparseMask:
    """anchors (B, N) -> the training mask of masks.attention_mask as FlexAttention tiles.

    Which tiles are visible is read off the dense mask itself (40 MB of bools at the 8B shape, a
    negligible pass), so the block structure cannot drift from the rule the dense path uses.
    """
    dense = masks.attention_mask(anchors, ctx_len, block_size)  # (B, Tq, Tk)
    B, Tq, Tk = dense.shape
    nq, nk = math.ceil(Tq / TILE), math.ceil(Tk / TILE)
    padded = dense.new_zeros(B, nq * TILE, nk * TILE)
    padded[:, :Tq, :Tk] = dense
    seen = padded.view(B, nq, TILE, nk, TILE).sum(dim=(2, 4))  # (B, nq, nk) visible pairs per tile
    full = seen == TILE * TILE
    partial = (seen > 0) & ~full
    kv_num, kv_idx = _ordered(partial[:, None])
    full_num, full_idx = _ordered(full[:, None])
    return SparseMask(anchors, kv_num, kv_idx, full_num, full_idx, ctx_len, block_size)


def mask_mod(anchors: torch.Tensor, n_queries: int, ctx_len: int, block_size: int):
    """FlexAttention's mask_mod for the rule of masks.attention_mask (what partial tiles evaluate).

    Query qi sees context kv < its block's anchor, and the keys of its own block.
    `anchors` is captured as given (a graph input when DraftLoss is compiled): inductor's CPU flex
    template rejects buffers computed inside the graph.
    """
    def rule(b, h, qi, kv):
        # qi is clamped: the kernel may evaluate padded rows of the last tile (it discards them).
        anchor = anchors[b, torch.clamp(qi, max=n_queries - 1) // block_size]
        start = ctx_len + qi - qi % block_size
        return (kv < anchor) | ((kv >= start) & (kv < start + block_size))

    return rule


# How the flex call runs: FlexAttention's backward tiles (its `kernel_options`), optionally its
# forward's, and whether K/V are expanded to one head per query head first. On Hopper (sm90,
# benchmarks/flex_bench.py, docs/decisions.md) 128-row KV tiles turn the few context tiles that
# every block attends to into a few long-running programs; 32 x 64 tiles spread them over the SMs.
# Elsewhere torch's own choice stands.
# configure(BWD[/FWD][+kv]) (TrainConfig.flex_tiles) overrides both (read when a call is traced): BWD is
# `default` or M1-N1-M2-N2-STAGES-WARPS, FWD is M-N-STAGES-WARPS (the forward keeps torch's without it).
TUNED_BWD_TILES = {(9, 0): "32-64-64-32-3-4"}
TILES: str | None = None  # configure()'s choice for this process; None: the tuned one
_TILE_KEYS = ("bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_stages", "bwd_num_warps")
_FWD_KEYS = ("fwd_BLOCK_M", "fwd_BLOCK_N", "fwd_num_stages", "fwd_num_warps")


@dataclass(frozen=True)
class FlexChoice:
    options: dict | None = None   # FlexAttention kernel_options (the tiles); None = torch's
    expand_kv: bool = False       # repeat K/V to the query heads: GQA's sum leaves the kernel's dK/dV loop


def _numbers(text: str, keys: tuple[str, ...], what: str, example: str) -> dict:
    parts = text.split("-")
    if len(parts) != len(keys) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"FlexAttention tiles {text!r}: give {what}, e.g. {example}")
    return dict(zip(keys, map(int, parts)))


def parse_tiles(text: str) -> FlexChoice:
    """'BWD[/FWD][+kv]' -> a FlexChoice. BWD: 'default' or 'M1-N1-M2-N2-STAGES-WARPS' (the
    backward's tiles); FWD: 'M-N-STAGES-WARPS' (the forward's); +kv: K/V expanded to the query heads."""
    tiles, plus, mode = text.partition("+")
    if plus and mode != "kv":
        raise ValueError(f"FlexAttention choice {text!r}: the only suffix is +kv (K/V expanded to the query heads)")
    bwd, slash, fwd = tiles.partition("/")
    options = {} if bwd == "default" else _numbers(bwd, _TILE_KEYS, "'default' or M1-N1-M2-N2-STAGES-WARPS",
                                                   "32-64-64-32-3-4")
    if slash:
        options.update(_numbers(fwd, _FWD_KEYS, "the forward's as M-N-STAGES-WARPS after '/'",
                                "32-64-64-32-3-4/64-64-3-4"))
    return FlexChoice(options or None, bool(plus))


def configure(tiles: str | None) -> None:
    """Fix the flex call's tiles for this process ('BWD[/FWD][+kv]', see parse_tiles; ValueError when
    bad), or None for the tuned choice."""
    global TILES
    if tiles is not None:
        parse_tiles(tiles)
    TILES = tiles


def flex_choice(device: torch.device) -> FlexChoice:
    """How the flex call on `device` runs: configure()'s choice, else the tuned one, else torch's."""
    text = TILES
    if text is None:
        if device.type != "cuda":
            return FlexChoice()
        text = TUNED_BWD_TILES.get(torch.cuda.get_device_capability(device), "default")
    return parse_tiles(text)


def _flex_sparse(q, k, v, anchors, kv_num, kv_idx, full_num, full_idx, ctx_len: int, block_size: int,
                 choice: FlexChoice | None = None):
    """FlexAttention over the DFlash mask. Plain tensors and ints in, so that it compiles on its own."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    choice = flex_choice(q.device) if choice is None else choice
    if choice.expand_kv and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    Tq, Tk = q.shape[-2], k.shape[-2]
    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=TILE,
                                  mask_mod=mask_mod(anchors, Tq, ctx_len, block_size), seq_lengths=(Tq, Tk))
    # Any: torch's kernel_options is a TypedDict (FlexKernelOptions) of keys this dict has from _numbers
    options: Any = dict(choice.options) if choice.options and q.is_cuda else None
    return flex_attention(q, k, v, block_mask=bm, enable_gqa=q.shape[1] != k.shape[1], kernel_options=options)


_compiled = None
_compiled_lock = threading.Lock()
# Why the standalone compiled flex call is not used, once it failed (process-wide): the eager
# policy is the fallback that must keep working where torch.compile does not.
fallback_reason: str | None = None


def _compiled_flex():
    """One torch.compile'd flex call per process (dynamo caches per code object anyway)."""
    global _compiled
    with _compiled_lock:
        if _compiled is None:
            _compiled = torch.compile(_flex_sparse, dynamic=False)
        return _compiled


def _compile_here(q: torch.Tensor) -> bool:
    """Compile the flex call on its own: on CUDA, where no policy compiles the forward around it."""
    return q.device.type == "cuda" and not torch.compiler.is_compiling()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """q (B, nh, Tq, hd); k, v (B, nkv, Tk, hd); mask: bool (B, Tq, Tk) or SparseMask -> (B, nh, Tq, hd)."""
    if isinstance(mask, SparseMask):
        # flex takes one dtype: q and k leave the fp32 norm/RoPE, v comes straight from its Linear
        # (bf16 under autocast). Casting to v's dtype is what SDPA's autocast rule does too.
        q, k = q.to(v.dtype), k.to(v.dtype)
        args = (q, k, v, mask.anchors, mask.kv_num, mask.kv_idx, mask.full_num, mask.full_idx,
                mask.ctx_len, mask.block_size)
        if _compile_here(q):
            if fallback_reason is None:  # uncompiled flex materializes every score: never fast
                try:
                    return _compiled_flex()(*args)
                except torch.cuda.OutOfMemoryError:
                    raise
                except Exception as e:  # noqa: BLE001 - a compile failure: same function, dense
                    _give_up_flex(e)
            return attend(q, k, v, masks.attention_mask(mask.anchors, mask.ctx_len, mask.block_size))
        return _flex_sparse(*args)
    nh, nkv = q.shape[1], k.shape[1]
    if nh != nkv:  # GQA: explicit repeat (SDPA's enable_gqa is not in every torch we run on)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


def _give_up_flex(e: Exception) -> None:
    global fallback_reason
    fallback_reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    warnings.warn(f"compiled FlexAttention failed ({fallback_reason}); using dense SDPA from now on",
                  RuntimeWarning, stacklevel=3)


def attended_pairs(anchors: torch.Tensor, ctx_len: int, block_size: int) -> int:
    """(query, key) pairs the mask allows, per batch: what attention must compute at the least."""
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # (B, Tq)
    return int(q_anchor.sum()) + q_anchor.numel() * block_size
