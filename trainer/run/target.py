"""The frozen target: a Hugging Face causal LM from a local folder, or `tiny` built here.

The drafter is conditioned on the target's hidden states at a few layers, borrows its embedding
and lm_head, and starts its own final norm from the target's (docs/export.md). Nothing here ever
reaches the network: `HF_HUB_OFFLINE` is set before transformers is imported and every load is
`local_files_only`.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import logging
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Progress bars go to stderr: they would bury the one-line errors users and `logs` rely on.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

from trainer.run.config import SMALL_TARGETS, check_target_spec  # noqa: E402
from trainer.errors import UsageError  # noqa: E402
from trainer.model.drafter import DrafterConfig  # noqa: E402
from trainer.run.tiny import TINY, TINY_LM_HEAD_STD, build_tiny  # noqa: E402,F401 (target's names)
from trainer.run.tokenizer import ByteTokenizer  # noqa: E402

def default_layer_ids(num_layers: int, n: int = 5) -> tuple[int, ...]:
    """n layers evenly spaced from 1 to L-3 (Qwen3-8B, L=36: 1, 9, 17, 25, 33), fewer if L is small."""
    lo, hi = (1, num_layers - 3) if num_layers >= 4 else (0, num_layers - 1)
    n = max(1, min(n, hi - lo + 1))
    if n == 1:
        return (hi,)
    return tuple(round(lo + i * (hi - lo) / (n - 1)) for i in range(n))


@dataclass
class Target:
    # Any: both duck-typed (model.base_model.layers, model.config..., tok.pad_token_id...), and an
    # nn.Module's submodules and attributes type as Tensor | Module
    model: Any                    # the HF CausalLM (an nn.Module), eval mode, requires_grad False everywhere
    tokenizer: Any                # HF tokenizer, ByteTokenizer for tiny, None if the folder has none
    layer_ids: tuple[int, ...]    # decoder layers whose outputs feed the drafter
    name: str                     # "tiny", "tiny:7" or the folder path
    fingerprint: str              # changes when the model would produce different data
    # features() stops after the last tapped layer; False runs the whole base model as it used to
    # (the same tensor, more work: kept for benchmarks/train_step_bench.py --target-mode full).
    truncate: bool = True
    # features() runs each decoder layer's forward compiled (compile_layers); False: eager.
    compiled: bool = False
    # features() replays a CUDA graph of its whole forward (graph_features); False: launched from Python.
    graphed: bool = False
    # features() also runs the layers above the last tapped one and appends the final norm's output,
    # (B, S, n*H + H): the input of the target's own logits, which a distilling objective reads
    # (trainer/model/objective.py). False: the n layers' features alone.
    final_hidden: bool = False
    _graphs: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)  # per copy

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def to(self, device: torch.device) -> "Target":
        """A replica on another device (the original stays where it is).

        The copy is made where the original lives, then moved (for a large target on several GPUs,
        loading each replica from disk or from a CPU copy would spare the first device's memory).
        """
        if torch.device(device) == self.device:
            return self
        model = copy.deepcopy(self.model).to(device)
        for layer in getattr(model.base_model, "layers", ()):
            # A compiled forward is bound to the ORIGINAL layer (deepcopy keeps functions as they
            # are): drop it, so the copy runs its own weights; compile_layers() compiles the copy.
            layer.__dict__.pop("forward", None)
        return dataclasses.replace(self, model=model, compiled=False, graphed=False)

    def compile_layers(self) -> None:
        """From now on features() runs each decoder layer's forward compiled by inductor (no CUDA
        graphs): RMSNorm, RoPE, SiLU and the residual adds fuse into a few kernels around the
        matmuls, and each layer launches far fewer kernels from Python. Regional compilation: the
        layers share one class, so they share one compiled graph (parameters are graph inputs).

        Compiled only inside features(), in the calling thread: decode() (the eval's cached
        generation, whose shapes change every call) and every other caller run eager, and the tap
        hooks stay eager around the compiled forward. Compilation happens at the first
        features() call, in the thread that makes it (dynamo config is per thread from torch 2.12).
        Idempotent; safe when several workers share this Target.
        """
        layers = _tap_layers(self.model.base_model)
        with _HOOK_LOCK:
            for layer in layers:
                if "forward" not in layer.__dict__:
                    layer.forward = _dispatching_forward(layer.forward, torch.compile(layer.forward, dynamic=False))
        self.compiled = True

    def graph_features(self) -> None:
        """From now on features() on a CUDA device replays a CUDA graph of its forward (one graph per
        input shape, captured at the shape's first call after two warm-up runs), so the host
        launches nothing per layer: the frozen target is static, no-grad and called with one
        shape per run. The graph is plain CUDA (torch.cuda.CUDAGraph, thread-local capture), not
        inductor's cudagraph trees, whose per-thread state breaks in worker threads.

        Only for a Target that ONE thread calls (one worker per GPU): the graph's input and output
        buffers are this object's. features() returns a copy of the output buffer. If a capture
        fails (a model whose forward synchronises the host, say), features() warns once and runs
        uncaptured from then on: the same kernels, the same result."""
        self.graphed = True

    # no_grad, not inference_mode: the drafter's first matmul saves these features for its
    # backward, and autograd refuses to save inference tensors.
    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, *, eager: bool = False) -> torch.Tensor:
        if self.graphed and not eager and input_ids.is_cuda:
            return self._replay(input_ids)
        return self._features(input_ids, eager=eager)

    def _replay(self, input_ids: torch.Tensor) -> torch.Tensor:
        key = (tuple(input_ids.shape), input_ids.dtype, input_ids.device)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(input_ids)
        if entry is False:  # the capture failed: uncaptured, as before graph_features()
            return self._features(input_ids)
        graph, static_in, static_out = entry
        static_in.copy_(input_ids)
        graph.replay()
        return static_out.clone()

    def _capture(self, input_ids: torch.Tensor):
        import warnings

        device = input_ids.device
        static_in = input_ids.clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: compiles, autotunes, fills the allocator's caches
            for _ in range(2):
                self._features(static_in)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # The capture stream is named: torch.cuda.graph's default is ONE stream per process,
            # made on whichever device was current at the first capture, so a second GPU's capture
            # would launch its kernels on the first GPU's stream and fail. One capture at a time.
            with _CAPTURE_LOCK, torch.cuda.graph(graph, stream=torch.cuda.Stream(device),
                                                 capture_error_mode="thread_local"):
                static_out = self._features(static_in)
        except Exception as e:  # noqa: BLE001 - the same forward uncaptured is always right
            first = (str(e).strip().splitlines() or [""])[0][:200]
            warnings.warn(f"CUDA graph capture of the target's forward failed ({type(e).__name__}: {first}); "
                          "running it uncaptured", RuntimeWarning, stacklevel=3)
            return False
        return graph, static_in, static_out

    def _features(self, input_ids: torch.Tensor, *, eager: bool = False) -> torch.Tensor:
        """input_ids (B, S) -> concatenated hidden states (B, S, n*H) at `layer_ids`, and with
        `final_hidden` the model's last hidden state after them (B, S, n*H + H).

        Right padding needs no attention mask: with causal attention, real tokens never see pads.
        HF `hidden_states[i + 1]` is the output of layer i (index 0 is the embedding), except that
        the last layer's entry is after the final norm (`last_hidden_state`).
        With `truncate`, the layers above the last tapped one never run (Qwen3-8B with layers
        1..33: 34 of 36 layers); the result is the same tensor. After compile_layers() the layers
        run compiled unless `eager` (the compile guard's reference).
        """
        if not self.truncate:
            out = self.model.base_model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
            final = [out.last_hidden_state] if self.final_hidden else []
            return torch.cat([out.hidden_states[i + 1] for i in self.layer_ids] + final, dim=-1)
        base = self.model.base_model
        layers = _tap_layers(base)
        last = max(self.layer_ids)
        # the whole model when the last layer is tapped (its entry is the normed output) or the output is wanted
        through = last == len(layers) - 1 or self.final_hidden
        # each tapped layer's output, which _tap_hook writes in place of the None
        taps: dict[torch.nn.Module, Any] = {layers[i]: None for i in self.layer_ids if i != len(layers) - 1}
        _TAP.taps, _TAP.stop_at, _TAP.compiled = (taps, None if through else layers[last],
                                                self.compiled and not eager)
        try:
            out = base(input_ids=input_ids, use_cache=False, **_no_mask(base))
        except _StopForward:
            out = None
        finally:
            _TAP.taps = _TAP.stop_at = None
            _TAP.compiled = False
        final = [out.last_hidden_state] if self.final_hidden else []
        return torch.cat([out.last_hidden_state if i == len(layers) - 1 else taps[layers[i]]
                          for i in self.layer_ids] + final, dim=-1)

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, cache=None, *, hidden: bool = False):
        """One cached forward: input_ids (B, T) -> (logits (B, T, V), hidden_states or None, cache).

        Pass cache=None to start (prefill). transformers 5 renamed `past_key_values` to `cache`;
        both spellings are handled here so callers and logs see no deprecation noise.
        """
        kw = _cache_kwarg(self.model)
        args = {"input_ids": input_ids, "use_cache": True, "output_hidden_states": hidden}
        if cache is not None:
            args[kw] = cache
        out = self.model(**args)
        new_cache = out["cache"] if kw == "cache" else out["past_key_values"]
        return out.logits, (out.hidden_states if hidden else None), new_cache

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The frozen parts the drafter borrows: embedding (V, H), final norm (H,), lm_head (V, H).

        The drafter's own final norm starts as a copy of this norm (Drafter.init_norm)."""
        norm = getattr(self.model.base_model, "norm", None)
        if norm is None or not hasattr(norm, "weight"):
            raise UsageError(f"--target {self.name}: {type(self.model).__name__} has no final RMSNorm "
                             "(base_model.norm); supported: Llama/Qwen2/Qwen3/Mistral-style models")
        return (self.model.get_input_embeddings().weight, norm.weight, self.model.get_output_embeddings().weight)

    def mask_token_id(self) -> int:
        """The id whose (frozen) embedding marks a position to predict.

        The tokenizer's mask token if it has one; else the first embedding row past the tokenizer's
        vocabulary (Qwen3 pads its 151669 tokens to 151936 rows, so such rows exist); else pad/eos.
        """
        tok = self.tokenizer
        if tok is not None and getattr(tok, "mask_token_id", None) is not None:
            return int(tok.mask_token_id)
        rows = self.model.get_input_embeddings().weight.shape[0]
        if tok is not None and len(tok) < rows:
            return len(tok)
        for attr in ("pad_token_id", "eos_token_id"):
            v = getattr(tok, attr, None) if tok is not None else getattr(self.config, attr, None)
            if isinstance(v, list):
                v = v[0] if v else None
            if v is not None:
                return int(v)
        return rows - 1

    def eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.tokenizer, getattr(self.model, "generation_config", None), self.config):
            v = getattr(src, "eos_token_id", None) if src is not None else None
            ids.update(v if isinstance(v, (list, tuple)) else [] if v is None else [v])
        return {int(i) for i in ids}

    def drafter_config(self, *, num_layers: int, block_size: int, mask_token_id: int | None,
                       own_norm: bool = True) -> DrafterConfig:
        """A drafter shaped like one target layer (the DFlash releases do this), n = len(layer_ids)."""
        c = self.config
        heads = c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        return DrafterConfig(
            hidden_size=c.hidden_size,
            vocab_size=self.model.get_input_embeddings().weight.shape[0],
            mask_token_id=self.mask_token_id() if mask_token_id is None else mask_token_id,
            num_target_layers=len(self.layer_ids),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            intermediate_size=c.intermediate_size,
            rms_eps=getattr(c, "rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            block_size=block_size,
            own_norm=own_norm,
        )


# ---- features(): record the tapped layers' outputs and stop after the last one ----------------------
# The hooks stay on the layers for good and act only while THIS thread is inside features():
# replicas on one device share one Target, so per-call hooks or a sliced layer list would change
# what another worker's forward (or an eval's decode) runs. Calling the layers directly instead
# would copy the model's mask and rotary set-up, which changes between transformers versions.

class _StopForward(BaseException):
    """Raised by the hook of the last tapped layer: nothing above it is needed. A BaseException, so
    that no `except Exception` inside a model's forward can swallow it and run on."""


_TAP = threading.local()
_HOOK_LOCK = threading.Lock()
_CAPTURE_LOCK = threading.Lock()


def _tap_hook(module, args, output):
    taps = getattr(_TAP, "taps", None)
    if taps is None or module not in taps:
        return
    taps[module] = output[0] if isinstance(output, tuple) else output  # transformers 4 returns a tuple
    if module is _TAP.stop_at:
        raise _StopForward


def _dispatching_forward(eager, compiled):
    """A layer's forward: the compiled one inside this thread's features() of a compiled Target,
    the layer's own otherwise."""
    def forward(*args, **kwargs):
        return (compiled if getattr(_TAP, "compiled", False) else eager)(*args, **kwargs)
    return forward


def _no_mask(base: torch.nn.Module) -> dict:
    """The base model's forward kwargs that say "no attention mask" outright, where it takes them.

    Without an attention mask, transformers (4.53+) builds one per call from the position ids: it
    checks them for packed sequences, which reads a device value on the host (a synchronisation
    and Python on every call, and no CUDA graph can be captured across it; under capture it even builds a
    dense mask). With every layer full-attention, the mask it arrives at is None (SDPA's causal
    path); handing it the prepared mapping {"full_attention": None} skips the work and gives the
    same tensor (tests/test_trainer_target.py). Models with other layer types build their masks."""
    types = getattr(base.config, "layer_types", None)
    # the ignore: mypy takes type[Module] for unhashable (its Hashable check reads __hash__ off the class)
    if (not types or any(t != "full_attention" for t in types)
            or not _takes_mask_mapping(type(base))):  # type: ignore[arg-type]
        return {}
    return {"attention_mask": {"full_attention": None}}


@functools.lru_cache(maxsize=None)
def _takes_mask_mapping(cls: type[torch.nn.Module]) -> bool:
    """Whether this base model's forward accepts a prepared {layer type: mask} mapping as its
    attention_mask (transformers' "It may already have been prepared by e.g. `generate`" branch)."""
    import inspect

    try:
        return "attention_mask, dict)" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _tap_layers(base: torch.nn.Module) -> torch.nn.ModuleList:
    """base.layers with the tap hook on every layer (installed once per model, copied by deepcopy)."""
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UsageError(f"{type(base).__name__} has no decoder layer list (base_model.layers); "
                         "supported: Llama/Qwen2/Qwen3/Mistral-style models")
    with _HOOK_LOCK:
        for layer in layers:
            if not getattr(layer, "_dflash_tap", False):
                layer.register_forward_hook(_tap_hook)
                # nn.Module.__setattr__ is annotated Tensor | Module, yet keeps any other value as a plain attribute
                layer._dflash_tap = True  # type: ignore[assignment]
    return layers


def _cache_kwarg(model) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # transformers imports torchao where it is installed (--precision fp8); torchao's compiled
    # extensions, which the trainer never uses, then warn that they do not load on this torch build
    logging.getLogger("torchao").setLevel(logging.ERROR)


def _freeze(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_target(spec: str, *, device: torch.device, dtype: torch.dtype,
                layers: tuple[int, ...] | None = None, final_hidden: bool = False) -> Target:
    """Load and freeze the target on `device`; `layers` overrides the default layer choice;
    `final_hidden`: features() appends the model's last hidden state (Target.final_hidden)."""
    check_target_spec(spec)
    _quiet_transformers()
    model: Any          # the HF CausalLM (Target.model); _freeze gives it back as an nn.Module
    if spec.startswith("tiny"):
        seed = int(spec[5:]) if ":" in spec else 0
        model, tokenizer = build_tiny(seed), ByteTokenizer()
        fingerprint = hashlib.sha256(json.dumps([TINY, TINY_LM_HEAD_STD, seed]).encode()).hexdigest()[:16]
    else:
        folder = target_folder(spec)
        model, tokenizer = _load_folder(folder, dtype)
        cfg_text = (Path(folder) / "config.json").read_bytes()
        fingerprint = hashlib.sha256(cfg_text + str(Path(folder).resolve()).encode()).hexdigest()[:16]
    model = _freeze(model.to(device=device, dtype=dtype))
    L = model.config.num_hidden_layers
    layer_ids = tuple(layers) if layers else default_layer_ids(L)
    bad = [i for i in layer_ids if not 0 <= i < L]
    if bad:
        raise UsageError(f"--target-layers {','.join(map(str, layer_ids))}: the target has layers 0..{L - 1}")
    return Target(model, tokenizer, layer_ids, spec, fingerprint, final_hidden=final_hidden)


def target_folder(spec: str) -> str:
    """The folder a target spec names: itself, or a built-in small target's cached folder (built
    on first use)."""
    if spec not in SMALL_TARGETS:
        return spec
    from trainer.run import small_target

    return str(small_target.ensure(SMALL_TARGETS[spec]))


def _load_folder(path: str, dtype: torch.dtype):
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--target {path}: not a model: {_first_line(e)}") from None
    # transformers < 4.56 spells `dtype` torch_dtype
    dtype_kw = "dtype" if _version(transformers.__version__) >= (4, 56) else "torch_dtype"
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **{dtype_kw: dtype})
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"--target {path}: cannot load the model: {_first_line(e)}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        tokenizer = None  # JSONL with input_ids still works; chat data and eval text do not need it
    return model, tokenizer


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)
