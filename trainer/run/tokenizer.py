"""A byte-level tokenizer for the `tiny` target: deterministic, no files, no download.

ids 0..255 are bytes; a few specials follow. Its chat template has the ChatML shape Qwen uses
(`<|im_start|>role\\ncontent<|im_end|>\\n`), and `apply_chat_template` answers like a Hugging Face
tokenizer's, so the data code treats both the same way.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

SPECIALS = ("<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
VOCAB_SIZE = 264  # 256 bytes + 5 specials, rounded up to a multiple of 8


class ByteTokenizer:
    pad_token_id = 256
    eos_token_id = 257
    im_start_id = 258
    im_end_id = 259
    mask_token_id = 260
    mask_token = "<|mask|>"
    vocab_size = VOCAB_SIZE

    def __len__(self) -> int:
        return 256 + len(SPECIALS)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping], tokenize: bool = True,
                            add_generation_prompt: bool = False, **_ignored) -> list[int]:
        if not tokenize:
            raise ValueError("ByteTokenizer renders chats to ids only")
        ids: list[int] = []
        for m in messages:
            ids += [self.im_start_id, *self.encode(f"{m['role']}\n{m['content']}"), self.im_end_id, *self.encode("\n")]
        if add_generation_prompt:
            ids += [self.im_start_id, *self.encode("assistant\n")]
        return ids
