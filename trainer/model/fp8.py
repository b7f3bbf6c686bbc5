"""FP8 matmuls for the drafter's Linear layers while they train (`--precision fp8 | fp8-rowwise`),
with torchao's float8 training (docs/precision.md); with `--precision fp8-lmhead`, also the frozen
lm_head's two matmuls in the chunked loss (`Fp8Head`).

`use(drafter, precision, emulate)` gives every Linear of the drafter (fc, q/k/v/o, the MLP) an
Fp8Matmul: while gradients are computed, the layer's matmul, its input gradient and its weight
gradient run as torchao's Float8Linear runs them. Each operand gets a dynamic scale from its amax
(tensorwise: one per tensor; rowwise: one per row, rounded down to a power of two) and is cast to
e4m3 (tensorwise casts the output gradient to e5m2), then torch._scaled_mm multiplies on the GPU;
`emulate` does the same casts and an fp32 matmul, which runs anywhere (the tests, on the CPU).

What does not change: the fp32 master weights (quantized from fp32 at every matmul; the weight's
gradient leaves the matmul in bf16 and lands in its fp32 .grad), the fp32 AdamW moments, the target
(bf16), the lm_head and the cross-entropy (fused_ce.py; but for fp8-lmhead's lm_head matmuls), and
everything under no_grad: eval and export run the bf16 path on the same weights, as a deployed
drafter does.

The numerics (`matmul_error`): rounding to a format with p mantissa bits is off by at most 2^-(p+1)
relative (e4m3, p = 3: 1/16; e5m2, p = 2: 1/8), uniformly, so with an rms of that / sqrt(3). A
product of two rounded operands carries both errors, independent; a matmul's output sums K such
products of random sign, so its error relative to the output, in L2 over all outputs, is the
product's rms error: sqrt(ua^2 + ub^2) / sqrt(3). tests/test_fp8.py holds a whole step to that.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer.model.linear import Linear

TORCHAO = "0.18.0"  # the version tested: float8 training on torch 2.11 (the GPU machine) and 2.13 (CPU)
# --precision value -> torchao's recipe; "bf16" (the default) is the path without fp8.
RECIPES = {"fp8": "tensorwise", "fp8-rowwise": "rowwise", "fp8-lmhead": "tensorwise"}
# the precisions whose lm_head matmuls (logits, and the hidden state's gradient) run in fp8 too: Fp8Head
HEAD = ("fp8-lmhead",)
MULTIPLE = 16  # torch._scaled_mm takes sizes in multiples of 16 (the weight gradient's inner size: the rows)
# (mantissa bits of the forward's operands, of the backward's output gradient) per recipe
_MANTISSA = {"tensorwise": (3, 2), "rowwise": (3, 3)}


def torchao_version() -> str | None:
    """torchao's version where it is installed (not imported: that takes seconds), else None."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return None
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on the path
        return "unknown"


def refusal(device: torch.device, emulate: bool) -> str | None:
    """Why this process cannot train with fp8 matmuls on `device` (None: it can): no torchao, or no
    FP8 tensor cores (torch._scaled_mm needs sm89 or newer) unless `emulate`."""
    if torchao_version() is None:
        return (f"needs torchao (pip install torchao=={TORCHAO}; where no package registry is reached, "
                "carry the wheel: make fp8-wheel, docs/precision.md)")
    if emulate:
        return None
    why = None
    if device.type != "cuda":
        why = f"the {device.type} has no FP8 matmul"
    elif torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        why = f"{torch.cuda.get_device_name(device)} (sm{major}{minor}) has no FP8 tensor cores (sm89 or newer)"
    return why and f"{why}; --fp8-emulate runs fp8's arithmetic without them (slowly, for tests)"


def matmul_error(precision: str, backward: bool = True) -> float:
    """The relative L2 error of one fp8 matmul's output under `precision`: sqrt(ua^2 + ub^2) / sqrt(3)
    with u = 2^-(p+1) per operand (module docstring); the backward's (the larger) or the forward's."""
    fwd, bwd = _MANTISSA[RECIPES[precision]]
    return math.sqrt(2.0 ** (-2 * (fwd + 1)) + 2.0 ** (-2 * ((bwd if backward else fwd) + 1))) / math.sqrt(3.0)


def step_error(precision: str, layers: int, backward: bool = True) -> float:
    """How far an fp8 step of a drafter of `layers` layers may lie from the same step without fp8,
    relative (L2): its gradients (backward) or its loss. A value passes through at most M fp8 matmuls,
    whose independent errors add in quadrature (to first order): the forward chain is the fc, then per
    layer q/k/v, o_proj, gate/up and down_proj (1 + 4L); a gradient goes back along as long a chain,
    M = 2 (1 + 4L). So within sqrt(M) x matmul_error (L = 2: 0.34 tensorwise, 0.22 rowwise). The
    lm_head in fp8 (HEAD) adds one matmul to each chain (L = 2: 0.36)."""
    chain = 1 + 4 * layers + (precision in HEAD)
    return math.sqrt(2 * chain if backward else chain) * matmul_error(precision, backward)


@dataclass(frozen=True)
class Fp8Matmul:
    """x @ w.T as torchao's Float8Linear computes it, for one recipe. Frozen data (torch.compile treats
    it as a constant); the same one serves every layer."""
    precision: str
    emulate: bool
    config: object = None          # torchao's Float8LinearConfig
    mm_config: object = None       # and the LinearMMConfig its Float8Linear derives from it
    matmul: Any = None             # the autograd function Float8Linear.forward applies (torchao: untyped)

    @staticmethod
    def build(precision: str, emulate: bool) -> "Fp8Matmul":
        """ImportError without torchao; ValueError for an unknown precision."""
        if precision not in RECIPES:
            raise ValueError(f"precision {precision!r}: expected one of {', '.join(RECIPES)}")
        log = logging.getLogger("torchao")  # its compiled extensions are not needed here: no warning about them
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        finally:
            log.setLevel(level)
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(RECIPES[precision]), emulate=emulate)
        # torchao's own conversion, of a stand-in layer: its checks, its LinearMMConfig, and its patch
        # of inductor's fp8 codegen (triton-lang/triton#11111), which it applies before any fp8 compile.
        with torch.device("meta"):
            template = convert_to_float8_training(nn.Linear(16, 16, bias=False), config=config)
        return Fp8Matmul(precision, emulate, template.config, template.linear_mm_config, matmul_with_hp_or_float8_args)

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):  # as Float8Linear: the output in autocast's dtype
            x = x.to(torch.get_autocast_dtype(x.device.type))
        lead = x.shape[:-1]
        # The weight's gradient is out x rows @ rows x in: torch._scaled_mm wants its inner size, the
        # number of rows, a multiple of 16, and refuses the step otherwise (the 276 rows of a small
        # batch did, on an H200).
        x, pad = _pad_rows(x.reshape(-1, x.shape[-1]))
        y = self.matmul.apply(x, w.t(), self.mm_config, self.config)
        return y[: y.shape[0] - pad].reshape(*lead, y.shape[-1])


def _pad_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x (N, K) with zero rows to a multiple of MULTIPLE, and how many were added (cut them off the
    result again). Zero rows change no amax, no other output row and no gradient."""
    pad = -x.shape[0] % MULTIPLE
    return (nn.functional.pad(x, (0, 0, 0, pad)) if pad else x), pad


def _to_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (x scaled into fp8 `dtype`, saturated; the inverse scale): one scale from x's amax, as
    torchao's tensorwise recipe computes it."""
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(x, dtype)
    return to_fp8_saturated(x.float() * scale, dtype), scale.reciprocal()


@dataclass(frozen=True)
class Fp8Head:
    """The frozen lm_head's two matmuls in the chunked loss (fused_ce.py) in fp8, scaled per tensor
    as `fp8` scales the Linear layers: logits = y @ W.T with y and W in e4m3, and the hidden state's
    gradient d y = d logits @ W with d logits in e5m2 (the lm_head has no weight gradient: frozen).
    W is cast once per loss call (`weight`), in the two layouts torch._scaled_mm takes. Sizes go to
    multiples of 16 with zeros, which change no amax and no result: the rows as Fp8Matmul pads them,
    and the vocabulary (W's rows, d logits' columns; the padded logits are cut off again).
    `emulate`: the same casts, an fp32 matmul."""
    emulate: bool

    def weight(self, w: torch.Tensor) -> tuple:
        """(W (V', H) in e4m3, the same transposed and contiguous (H, V'), W's inverse scale, V)."""
        w8, inv = _to_fp8(_pad_rows(w)[0], torch.float8_e4m3fn)
        return w8, w8.t().contiguous(), inv, w.shape[0]

    def logits(self, y: torch.Tensor, w: tuple, out_dtype: torch.dtype) -> torch.Tensor:
        # as torchao's forward GEMM: fast accumulation (Float8LinearConfig.gemm_config_output)
        out = self._mm(y, torch.float8_e4m3fn, w[0].t(), w[2], out_dtype, fast=True)
        return out if out.shape[1] == w[3] else out[:, : w[3]].contiguous()

    def grad_input(self, g: torch.Tensor, w: tuple, out_dtype: torch.dtype) -> torch.Tensor:
        pad = w[1].shape[1] - g.shape[1]
        g = nn.functional.pad(g, (0, pad)) if pad else g
        return self._mm(g, torch.float8_e5m2, w[1].t(), w[2], out_dtype, fast=False)

    def _mm(self, a, dtype, b8, inv_b, out_dtype, fast: bool) -> torch.Tensor:
        a, pad = _pad_rows(a)
        a8, inv_a = _to_fp8(a, dtype)
        if self.emulate:
            out = ((a8.float() * inv_a) @ (b8.float() * inv_b)).to(out_dtype)
        else:
            out = torch._scaled_mm(a8, b8, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype, use_fast_accum=fast)
        return out[: out.shape[0] - pad]


def use(module: nn.Module, precision: str, emulate: bool = False) -> list[str]:
    """Give every Linear in `module` whose sizes torch._scaled_mm takes (multiples of 16; the rows
    are padded to one) the fp8 matmul of `precision` ("bf16": take it away), and, for HEAD, its
    `lm_head` an Fp8Head where its hidden size is a multiple of 16. Returns the names of the layers
    left in bf16."""
    mm = None if precision == "bf16" else Fp8Matmul.build(precision, emulate)
    left = []
    head = getattr(module, "lm_head", None)
    if isinstance(head, nn.Linear):
        head_fits = head.in_features % MULTIPLE == 0     # the vocabulary is padded to a multiple
        # nn.Module.__setattr__ is annotated Tensor | Module, yet keeps any other value as a plain attribute
        head.fp8 = Fp8Head(emulate) if precision in HEAD and head_fits else None  # type: ignore[assignment]
        if precision in HEAD and not head_fits:
            left.append("lm_head")
    for name, m in module.named_modules():
        if isinstance(m, Linear):
            fits = m.in_features % MULTIPLE == 0 and m.out_features % MULTIPLE == 0
            m.fp8 = mm if fits else None
            if mm is not None and not fits:
                left.append(name)
    return left


def described(precision: str, emulate: bool, left: list[str]) -> str:
    """The trainer's line saying what `use` did."""
    return (f"precision {precision}: the drafter's Linear layers train with torchao {torchao_version()}'s "
            f"float8 matmuls ({RECIPES[precision]} scales{', emulated' if emulate else ''})"
            + (f", but for {', '.join(left)} (sizes not multiples of 16)" if left else "")
            + ("; lm_head's matmuls in fp8 too; loss and eval as without" if precision in HEAD and "lm_head" not in left
               else "; lm_head, loss and eval as without"))
