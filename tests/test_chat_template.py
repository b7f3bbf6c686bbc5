"""Chat rows as DFlash drafters are trained: template options from the config (enable_thinking false
by default), no loss on the think block the template injects unless asked, eval prompts rendered
the same way."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

import hf_target  # noqa: E402
from trainer.run import config, flags  # noqa: E402
from trainer.run.data import encode_chat, think_ids  # noqa: E402
from trainer.errors import UsageError  # noqa: E402

MSGS = [{"role": "user", "content": hf_target.words(1, 2)},
        {"role": "assistant", "content": hf_target.words(10, 11, 12)}]


@pytest.fixture(scope="module")
def tok():
    return hf_target.tokenizer()


def trained_text(tok, ids, mask):
    return "".join(tok.convert_ids_to_tokens([t for t, m in zip(ids, mask) if m]))


def test_default_options_disable_thinking_and_skip_the_injected_block(tok):
    opts = config.chat_template_options(config.TrainConfig())
    assert opts == {"enable_thinking": False}
    ids, mask = encode_chat(tok, MSGS, template_kwargs=opts)
    assert trained_text(tok, ids, mask) == "w10 w11 w12<|im_end|>\n"
    # the prompt (tokens before the first loss token) is exactly the generation prompt that serving
    # renders with the same options: it ends in the empty think block
    prompt = ids[: mask.index(1)]
    gen = tok.apply_chat_template(MSGS[:1], tokenize=True, add_generation_prompt=True, **opts)["input_ids"]
    assert prompt == gen and "".join(tok.convert_ids_to_tokens(prompt)).endswith("<think>\n\n</think>\n\n")


def test_think_block_is_not_trained_unless_asked(tok):
    on = {"enable_thinking": True}
    ids, mask = encode_chat(tok, MSGS, template_kwargs=on)
    assert trained_text(tok, ids, mask) == "w10 w11 w12<|im_end|>\n"
    ids, mask = encode_chat(tok, MSGS, template_kwargs=on, train_thinking=True)
    assert trained_text(tok, ids, mask) == "<think>\n\n</think>\n\nw10 w11 w12<|im_end|>\n"
    assert think_ids(tok) == tuple(tok.convert_tokens_to_ids(["<think>", "</think>"]))


def test_template_options_come_from_flags_or_yaml(tmp_path):
    cfg = flags.parse(["--chat-template-kwargs", '{"enable_thinking": true}', "--train-thinking"])
    assert config.chat_template_options(cfg) == {"enable_thinking": True} and cfg.train_thinking
    y = tmp_path / "c.yaml"
    y.write_text("chat_template_kwargs: {enable_thinking: true, foo: 1}\n")
    cfg = flags.parse(["--config", str(y)])
    assert config.chat_template_options(cfg) == {"enable_thinking": True, "foo": 1}
    for bad in ("[1]", "{nope"):
        with pytest.raises(UsageError, match="chat-template-kwargs"):
            flags.parse(["--chat-template-kwargs", bad])


def test_eval_prompts_of_chat_data_use_the_same_template(tmp_path):
    from trainer_quick import train

    model = hf_target.build(tmp_path / "model")
    rows = [{"messages": [{"role": "user", "content": hf_target.words(i, i + 1)},
                          {"role": "assistant", "content": hf_target.words(*range(20, 40))}]} for i in range(4)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    assert train(out, "--target", str(model), "--data", str(data), "--steps", "1", "--eval-prompts", "2") == 0
    tok = hf_target.tokenizer()
    prompts = json.loads((out / "eval_prompts.json").read_text())
    want = [tok.apply_chat_template(r["messages"][:1], tokenize=True, add_generation_prompt=True,
                                    enable_thinking=False)["input_ids"] for r in rows[2:]]
    assert prompts == want


def test_specdec_renders_its_prompts_with_the_runs_template_options(tok, tmp_path):
    """bench-decode passes a run's --chat-template-kwargs to specdec: its prompts' generation prompt is
    then rendered with the run's options (thinking on here: no empty think block); without them, regen's way."""
    from trainer.specdec import read_prompt_ids

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": MSGS[:1]}) + "\n")

    def gen(**opts):
        return [tok.apply_chat_template(MSGS[:1], tokenize=True, add_generation_prompt=True, **opts)["input_ids"]]

    assert read_prompt_ids(str(path), tok, template_kwargs={"enable_thinking": True}) == gen(enable_thinking=True)
    assert read_prompt_ids(str(path), tok) == gen(enable_thinking=False) != gen(enable_thinking=True)
