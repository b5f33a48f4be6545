"""Chat templates of families other than ChatML: Gemma's (no system role, strict alternation, <end_of_turn>) and
Phi-3's (<|end|>, a conversation closed with EOS). Each is refused in one line naming the template's own complaint
and its fix, or works: the rollout stops at the template's end of turn, SFT trains a reply through it, serve chats."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from reinforge.config.schema import Config, DataConfig
from reinforge.data.chat_template import template_end_of_turn_ids
from reinforge.data.rl_dataset import RLDataset
from reinforge.data.sft_dataset import tokenize_conversation
from reinforge.models.tiny import build_char_tokenizer
from reinforge.serve.chat import RequestError

sys.path.insert(0, str(Path(__file__).parents[1] / "agent"))
from family_templates import FAMILIES  # noqa: E402
from family_templates import family_tokenizer as family_template_tokenizer  # noqa: E402

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


def trained_runs(tokenizer, example) -> list[str]:
    """Decoded runs of consecutive trained tokens."""
    text = "".join(tokenizer.decode([token]) if kept else "\0" for token, kept in
                   zip(example.input_ids, example.loss_mask, strict=True))
    return [run for run in text.split("\0") if run]


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "3"}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


@pytest.mark.parametrize("family", [*FAMILIES])
@pytest.mark.parametrize("ends_with_user", [False, True])
def test_each_familys_sft_trains_exactly_the_replies_and_their_end_of_turn(family, ends_with_user):
    """The whole conversation as the template writes it, without a generation prompt, BOS once where the template
    writes one, the system message (Gemma 3 opens the first user turn with it) and user turns untrained, and each
    reply trained with its end-of-turn token: not the header, nor what the template writes after that token."""
    tokenizer = family_template_tokenizer(family)
    _, _, eos = FAMILIES[family]
    end = {"llama3.1": "<|eot_id|>", "phi3": "<|end|>", "phi4-mini": "<|end|>", "gemma3": "<end_of_turn>"}.get(family, eos)
    chat = CHAT[1:] if family == "mistral-v0.3" else CHAT  # its system message goes into a last user turn only
    chat = [*chat, {"role": "user", "content": "bye"}] if ends_with_user else chat
    example = tokenize_conversation(tokenizer, chat)
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    assert tokenizer.decode(example.input_ids) == text
    last = "<think>\n\n</think>\n\n4" if family == "qwen3" and not ends_with_user else "4"  # Qwen3's last turn thinks
    lead = " " if family == "mistral-v0.3" else ""  # [/INST] 3</s>: the model writes the space
    assert trained_runs(tokenizer, example) == [f"{lead}3{end}", f"{lead}{last}{end}"]
    if tokenizer.bos_token and tokenizer.bos_token != tokenizer.eos_token:  # OLMo 2's BOS is its EOS
        assert example.input_ids.count(tokenizer.bos_token_id) == 1 and example.input_ids[0] == tokenizer.bos_token_id
    assert "Be brief." in text or family == "mistral-v0.3"


def test_mistrals_system_message_that_the_template_would_drop_is_refused():
    with pytest.raises(ValueError, match=r"^the chat template drops message 0 \(system\): it writes none of its "
                                         r"content.*; merge the system message into the first user message"):
        tokenize_conversation(family_template_tokenizer("mistral-v0.3"), CHAT)


def test_qwen3_multi_turn_trains_each_reply_as_the_whole_conversation_writes_it():
    """Qwen3's template leaves an earlier turn's reasoning out once another user turn follows (so a conversation's
    first turns do not render as a prefix of it): the sequence is the conversation as written, each turn trains
    what is written of it, the last one with its <think> block."""
    tokenizer = family_template_tokenizer("qwen3")
    chat = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n3"},
            {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd again\n</think>\n\n4"}]
    example = tokenize_conversation(tokenizer, chat)
    assert tokenizer.decode(example.input_ids) == tokenizer.apply_chat_template(chat, tokenize=False)
    assert trained_runs(tokenizer, example) == ["3<|im_end|>", "<think>\nadd again\n</think>\n\n4<|im_end|>"]


def test_a_template_that_drops_the_last_replys_reasoning_is_refused():
    """DeepSeek-R1's template writes no reply's reasoning: trained on it, the model would answer without thinking."""
    chat = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n3"}]
    with pytest.raises(ValueError, match=r"^the chat template drops the reasoning \(<think>...</think>\) of message 1 "
                                         r"\(assistant\), the reply the conversation ends with.*; set "
                                         r"data.chat_template to a template that writes a last reply's reasoning"):
        tokenize_conversation(family_template_tokenizer("deepseek-r1"), chat)


MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<start_of_turn>model\\n' }}"
          "{% generation %}{{ m['content'] + '<end_of_turn>\\n' }}{% endgeneration %}"
          "{% else %}{{ '<start_of_turn>' + m['role'] + '\\n' + m['content'] + '<end_of_turn>\\n' }}{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
"""Gemma's with TRL's {% generation %} markers: the assistant's content, its <end_of_turn> and the newline after."""


def test_a_template_with_generation_markers_trains_what_they_mark_as_trl_does(gemma):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "?"},
            {"role": "assistant", "content": "Ok"}]
    example = tokenize_conversation(gemma, chat, MARKED)
    marked = gemma.apply_chat_template(chat, chat_template=MARKED, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
    assert example.input_ids == list(marked["input_ids"])
    assert example.loss_mask == list(marked["assistant_masks"])  # TRL's assistant_only_loss
    assert trained_runs(gemma, example) == ["Yo<end_of_turn>\n", "Ok<end_of_turn>\n"]


def test_a_tool_call_turn_with_null_content_renders_as_with_empty_content():
    """OpenAI's ``content: null`` beside ``tool_calls``: transformers drops the key, and DeepSeek-V3's template then
    fails on it; reinforge renders it as '' (the template's own output for a call without text), in SFT and in RL
    prompts alike."""
    from reinforge.data.chat_template import render_prompt

    tokenizer = family_template_tokenizer("deepseek-v3")
    call = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]

    def chat(content):
        return [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": content, "tool_calls": call},
                {"role": "tool", "content": "3"}, {"role": "assistant", "content": "It is 3."}]

    with pytest.raises(Exception, match="content"):  # the template as transformers renders it
        tokenizer.apply_chat_template(chat(None), tokenize=False)
    expected = tokenizer.apply_chat_template(chat(""), tokenize=False)
    assert "<｜Assistant｜><｜tool▁calls▁begin｜>" in expected
    example = tokenize_conversation(tokenizer, chat(None))
    assert tokenizer.decode(example.input_ids) == expected
    assert tokenize_conversation(tokenizer, chat("")).loss_mask == example.loss_mask
    assert render_prompt(tokenizer, chat(None)[:3]) == render_prompt(tokenizer, chat("")[:3])


def test_a_tokenizer_with_named_templates_renders_with_its_default_or_with_its_tool_use_one_for_tools():
    """Hermes-2-Pro and Command-R ship a dict of templates; rendering passed the dict on and failed with
    'unhashable type: dict'."""
    from reinforge.agent.turn_tokens import ToolTurnRenderer
    from reinforge.data.chat_template import render_prompt

    tokenizer = family_template_tokenizer("qwen3")
    tool_use = tokenizer.chat_template
    default = "[default]" + tool_use
    tokenizer.chat_template = {"default": default, "tool_use": tool_use}
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]
    assert render_prompt(tokenizer, messages).startswith("[default]<|im_start|>user")
    assert render_prompt(tokenizer, messages, tools=tools).startswith("<|im_start|>system")
    assert ToolTurnRenderer(tokenizer).chat_template == tool_use
    example = tokenize_conversation(tokenizer, [*messages, {"role": "assistant", "content": "ok"}])
    assert "[default]" in tokenizer.decode(example.input_ids)
    tokenizer.chat_template = {"chatml": tool_use}
    with pytest.raises(ValueError, match=r"^the tokenizer's chat templates are named 'chatml', none of them "
                                         r"'default'; set data.chat_template"):
        render_prompt(tokenizer, messages)
