"""A Hugging Face target folder built offline: the `tiny` Qwen3 model saved with save_pretrained, and a
word-level fast tokenizer with a Qwen3-style chat template (an empty think block when
`enable_thinking` is false) and a mask token. No Hub access anywhere."""
from __future__ import annotations

from pathlib import Path

WORDS = 100
# Qwen3's template in miniature: assistant turns open with a think block, and the generation prompt
# ends in an empty one when enable_thinking is false.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}<think>\n\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]


def tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + ["user", "assistant", "system", "\n", " "] + [f"w{i}" for i in range(WORDS)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    specials = "|".join(s.replace("|", r"\|") for s in SPECIALS[1:])
    core.pre_tokenizer = pre_tokenizers.Split(Regex(specials + r"|\n| "), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>",
                                   mask_token="<|mask|>", additional_special_tokens=SPECIALS[1:5],
                                   chat_template=CHAT_TEMPLATE)


def build(path: Path, seed: int = 3) -> Path:
    """Write the target folder (model + tokenizer) to path; returns path."""
    from trainer.run.target import build_tiny

    path = Path(path)
    build_tiny(seed).save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


def words(*ns: int) -> str:
    return " ".join(f"w{i}" for i in ns)


def trained(root: Path, *train_args: str) -> tuple[Path, Path]:
    """The target folder root/target and a run against it in root/run (`python -m trainer TRAIN_ARGS`
    in this process, one CPU thread, its stdout dropped); returns (target, run)."""
    import contextlib
    import io

    import torch

    from trainer.exits import run
    from trainer.train import train_entry

    torch.set_num_threads(1)
    model, out = build(root / "target"), root / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        assert run(train_entry, ["--target", str(model), *train_args, "--out", str(out)]) == 0
    return model, out
