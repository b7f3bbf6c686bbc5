"""`tiny`: the built-in random target, small enough to train a drafter on 2 CPU cores in seconds.

No download and no folder: the same seed gives the same weights on every machine. It says nothing
about a real model (the small real target, small_target.py, does); it is for tests and quick checks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer.run.tokenizer import VOCAB_SIZE, ByteTokenizer

if TYPE_CHECKING:       # imported where used: transformers is slow to import
    from transformers import Qwen3ForCausalLM

# `tiny`: small enough to train a drafter on 2 CPU cores in seconds, deep enough (8 layers) for
# the default layer choice to pick 5 distinct layers (1..L-3).
TINY = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
            rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.02)
# A random model with HF's init (std 0.02) has near-uniform next-token distributions: its greedy choices
# hang on tiny logit gaps, unlike a trained LM's. A wider lm_head makes `tiny` confident like a real
# target, and gives the drafter (which borrows this lm_head) a usable logit range, so a short CPU run
# learns something measurable.
TINY_LM_HEAD_STD = 0.5


def build_tiny(seed: int = 0) -> Qwen3ForCausalLM:
    """A small random Qwen3 model; the same seed gives the same weights on every machine."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = ByteTokenizer()
    cfg = Qwen3Config(**TINY, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen3ForCausalLM(cfg)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, TINY_LM_HEAD_STD)
        return model
    finally:
        torch.random.set_rng_state(state)
