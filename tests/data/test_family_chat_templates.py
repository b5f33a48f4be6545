"""Chat templates of families other than ChatML: Gemma's (no system role, strict alternation, <end_of_turn>) and
Phi-3's (<|end|>, a conversation closed with EOS). Each is refused in one line naming the template's own complaint
and its fix, or works: the rollout stops at the template's end of turn, SFT trains a reply through it, serve chats."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from reinforge.config.schema import Config, DataConfig
from reinforge.data.chat_template import template_end_of_turn_ids
from reinforge.data.rl_dataset import RLDataset
from reinforge.data.sft_dataset import tokenize_conversation
from reinforge.models.tiny import build_char_tokenizer
from reinforge.serve.chat import RequestError

GEMMA = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
         "{% for message in messages %}"
         "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
         "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
         "{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
OLMO2 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\n' + "
         "message['content'] + '\n' }}{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '\n' }}"
         "{% elif message['role'] == 'assistant' %}{% if not loop.last %}{{ '<|assistant|>\n'  + message['content'] + "
         "eos_token + '\n' }}{% else %}{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
         "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}")
"""OLMo 2 Instruct's: no tool role, so a tool message is dropped."""
PHI3 = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")


def family_tokenizer(tokens: list[str], template: str):
    """The character tokenizer with the family's turn tokens as special tokens, as its own tokenizer marks them."""
    tokenizer = build_char_tokenizer(tokens, chat_template=template)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    return tokenizer


@pytest.fixture(scope="module")
def gemma():
    return family_tokenizer(["<start_of_turn>", "<end_of_turn>"], GEMMA)


@pytest.fixture(scope="module")
def phi3():
    return family_tokenizer(["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"], PHI3)


@pytest.mark.parametrize("prompt, complaint, fix", [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], "System role not supported",
     "merge the system message into the first user message"),
    ([{"role": "user", "content": "2+2?"}, {"role": "user", "content": "And 3+3?"}], "Conversation roles must alternate",
     "make the roles alternate user/assistant"),
])
def test_a_row_the_template_refuses_is_named_with_the_templates_complaint_and_its_fix(tmp_path, gemma, prompt,
                                                                                      complaint, fix):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "data_source": "arithmetic", "ground_truth": "4"}) + "\n")
    with pytest.raises(ValueError) as refused:
        RLDataset(str(path), gemma, DataConfig(max_prompt_length=64))
    message = str(refused.value)
    assert message.startswith(f"row 0 of {path}: the model's chat template refuses this prompt ({complaint}")
    assert fix in message and "\n" not in message


def test_the_rollout_stops_at_the_templates_end_of_turn_and_sft_trains_a_reply_through_it(gemma, phi3):
    from reinforge.workers.rollout_side import stop_token_ids

    for tokenizer, end in ((gemma, "<end_of_turn>"), (phi3, "<|end|>")):
        end_id = tokenizer.convert_tokens_to_ids(end)
        assert template_end_of_turn_ids(tokenizer) == (end_id,)
        model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=tokenizer.eos_token_id))
        assert end_id in stop_token_ids(Config(), tokenizer, model)  # a generation config naming only the EOS
        example = tokenize_conversation(tokenizer, [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "Yo"}])
        trained = [token for token, kept in zip(example.input_ids, example.loss_mask, strict=True) if kept]
        assert tokenizer.decode(trained) == f"Yo{end}"  # not the newline, nor Phi-3's closing EOS, after it


def test_serve_chats_with_a_template_that_has_no_tool_role(gemma):
    from reinforge.serve.chat import ChatCodec

    codec = ChatCodec(gemma)
    assert not codec.increments  # conversations are rendered whole each call
    ids = codec.render([{"role": "user", "content": "hi"}], None)
    assert gemma.decode(ids) == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(RequestError, match=r"^the model's chat template refuses these messages \(System role not "
                                           r"supported\); merge the system message into the first user message"):
        codec.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], None)


def test_serve_refuses_tool_messages_a_template_without_a_tool_role_would_drop():
    from reinforge.serve.chat import ChatCodec

    olmo2 = family_tokenizer([], OLMO2)
    olmo2.eos_token = olmo2.bos_token = "<|endoftext|>"
    codec = ChatCodec(olmo2)
    chat = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "Let me look."}]
    assert olmo2.decode(codec.render(chat, None)).endswith("<|assistant|>\nLet me look.<|endoftext|><|assistant|>\n")
    with pytest.raises(RequestError, match="the served model's chat template has no tool role: it would drop the "
                                           "tool messages"):
        codec.render([*chat, {"role": "tool", "content": "5"}], None)
