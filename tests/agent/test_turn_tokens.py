"""Token in, token out: a scripted multi-turn trajectory equals the chat template of the whole conversation.

For a ChatML template in Qwen2.5's shape and a Llama-3 template, the loop's prompt plus response
tokens must be ``apply_chat_template`` of the conversation, token for token, up to the model's
last end-of-turn token (the template's separator after it, ``\\n`` for ChatML, is written only
when another turn follows). Each turn's prompt must be exactly the tokens before it.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from reinforge.agent import AgentContext, FunctionTool, ToolTurnRenderer, get_agent_loop
from reinforge.config.schema import MultiTurnConfig
from reinforge.models.tiny import build_char_tokenizer
from reinforge.rollout.base import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from family_templates import family_tokenizer  # noqa: E402

LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message.role == 'tool' else message.role %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{%- for call in message.tool_calls %}"
    "{{ '<tool_call>{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{ call.function.arguments | tojson }}{{ '}</tool_call>' }}"
    "{%- endfor %}"
    "{%- else %}{{ message.content }}{% endif %}"
    "{{ '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Digits and + - * / ( ).
    """
    if set(expression) - set("0123456789+-*/() "):
        raise ValueError("only digits and + - * / ( ) are allowed")
    return str(eval(expression))  # the characters are checked above


def llama3_tokenizer():
    tokenizer = build_char_tokenizer(
        extra_tokens=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        chat_template=LLAMA3_TEMPLATE)
    tokenizer.eos_token = "<|eot_id|>"
    return tokenizer


def _call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _conversation_and_script(call_text, thoughts=("", "", "")):
    """The whole conversation (with tool results) and the assistant texts the 'model' samples, each turn's after
    its thought (Qwen3's ``<think>`` block)."""
    first = [_call("calculator", {"expression": "12*34"})]
    second = [_call("calculator", {"expression": "408+1"}), _call("calculator", {"expression": "2*(3+4)"})]
    final = "12*34 = 408, so the answers are 409 and 14."
    conversation = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "What is 12*34+1, and 2*(3+4)?"},
        {"role": "assistant", "content": thoughts[0], "tool_calls": first},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": thoughts[1], "tool_calls": second},
        {"role": "tool", "content": "409"},
        {"role": "tool", "content": "14"},
        {"role": "assistant", "content": thoughts[2] + final},
    ]
    script = [thoughts[0] + call_text(first), thoughts[1] + call_text(second), thoughts[2] + final]
    return conversation, script


def _hermes_chatml(calls):
    return "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                     + "\n</tool_call>" for c in calls)


def _hermes_llama(calls):
    return "".join("<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                   + "</tool_call>" for c in calls)


QWEN3_THOUGHTS = ("<think>\nMultiply first.\n</think>\n\n", "<think>\nNow both.\n</think>\n\n",
                  "<think>\nDone.\n</think>\n\n")


@pytest.mark.parametrize("template", ["chatml", "llama3", "qwen3"])
def test_scripted_trajectory_equals_the_template_of_the_whole_conversation(template, chatml_tokenizer,
                                                                          scripted_client):
    """Qwen3's template renders an earlier turn's header differently once more turns follow (it leaves out an empty
    <think></think>): the increments are what it writes after each turn's end, so a turn that thought renders as
    sampled."""
    tokenizer = {"chatml": chatml_tokenizer, "llama3": llama3_tokenizer()}.get(template) or family_tokenizer("qwen3")
    conversation, script = _conversation_and_script(_hermes_llama if template == "llama3" else _hermes_chatml,
                                                    QWEN3_THOUGHTS if template == "qwen3" else ("", "", ""))
    tool = FunctionTool(calculator)
    prompt_ids = tokenizer.apply_chat_template(conversation[:2], tools=[tool.schema], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    client = scripted_client(tokenizer, script)
    context = AgentContext(tokenizer, client, MultiTurnConfig(max_parallel_calls=2), {"calculator": tool})
    output = asyncio.run(get_agent_loop("tool_agent")(context).run(SamplingParams(max_tokens=1000),
                                                                  prompt_ids=list(prompt_ids)))

    expected = tokenizer.apply_chat_template(conversation, tools=[tool.schema], tokenize=True, return_dict=False)
    stream = output.prompt_ids + output.response_ids
    separator = ToolTurnRenderer(tokenizer).separator
    assert separator == ("" if template == "llama3" else "\n")
    assert stream == expected[:len(stream)]
    assert tokenizer.decode(expected[len(stream):]) == separator
    assert output.num_turns == 6 and output.finish_reason == "stop"
    # every turn continued the tokens before it, as they were
    for prompt in client.prompts:
        assert prompt == stream[:len(prompt)]
    # mask 1 exactly on what the model sampled, with its log-probs; 0 and log-prob 0 elsewhere
    sampled = [token for index, token in enumerate(output.response_ids) if output.response_mask[index]]
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    assert sampled == [token for text in script for token in tokenizer(text, add_special_tokens=False)["input_ids"]
                       + [eos]]
    assert all(lp == (-0.5 if mask else 0.0) for lp, mask in zip(output.response_log_probs, output.response_mask,
                                                                  strict=True))


def test_a_later_tool_turn_is_what_the_whole_conversations_template_writes_there(scripted_client):
    """DeepSeek-V3's template opens only a conversation's first tool outputs with <｜tool▁outputs▁begin｜>; a later
    tool turn starts with a newline there, and so must its increment."""
    tokenizer = family_tokenizer("deepseek-v3")
    tool = FunctionTool(calculator)
    calls = [_hermes_chatml([_call("calculator", {"expression": "12*34"})]),
             _hermes_chatml([_call("calculator", {"expression": "408+1"}), _call("calculator", {"expression": "7*2"})])]
    conversation = [{"role": "user", "content": "What is 12*34+1, and 7*2?"},
                    {"role": "assistant", "content": calls[0]}, {"role": "tool", "content": "408"},
                    {"role": "assistant", "content": calls[1]}, {"role": "tool", "content": "409"},
                    {"role": "tool", "content": "14"}, {"role": "assistant", "content": "409 and 14."}]
    prompt_ids = tokenizer.apply_chat_template(conversation[:1], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    client = scripted_client(tokenizer, [*calls, "409 and 14."])
    context = AgentContext(tokenizer, client, MultiTurnConfig(max_parallel_calls=2), {"calculator": tool})
    output = asyncio.run(get_agent_loop("tool_agent")(context).run(SamplingParams(max_tokens=1000),
                                                                  prompt_ids=list(prompt_ids)))
    expected = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
    assert output.prompt_ids + output.response_ids == expected
    assert output.metrics["num_tool_calls"] == 3 and output.metrics["tool_errors"] == 0


def test_a_long_trajectorys_tool_turns_render_only_the_history_their_template_depends_on():
    import time

    for family, history in (("qwen3", 0), ("deepseek-v3", 1)):
        renderer = ToolTurnRenderer(family_tokenizer(family))
        assert renderer.history_turns == history
        earlier, start = [], time.perf_counter()
        for turn in range(300):  # rendering every earlier turn each time took 3 s here, the event loop waiting
            messages = [{"role": "tool", "content": f"ok {turn}", "tool_call_id": "c00000000"}]
            renderer.increment_text(messages, earlier)
            earlier.append(messages)
        assert time.perf_counter() - start < 1, family


def test_separator_is_the_text_after_the_end_of_turn_token(chatml_tokenizer):
    renderer = ToolTurnRenderer(chatml_tokenizer)
    assert renderer.increment_text([{"role": "tool", "content": "7"}]) == (
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_template_that_rewrites_earlier_turns_is_refused(chatml_tokenizer):
    template = ("{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}<|im_start|>assistant\n"
                "(hidden)<|im_end|>\n{% else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match="renders an assistant turn differently once tool messages follow"):
        ToolTurnRenderer(chatml_tokenizer, chat_template=template)  # when it is made, not at the first tool turn


def test_a_base_models_tokenizer_under_chatml_ends_turns_with_the_templates_token(scripted_client):
    """Qwen2.5 base's tokenizer ends text with <|endoftext|>, its ChatML template closes turns with <|im_end|>: the
    renderer takes the template's token as the end of a turn, every turn stops at it, and the stream stays the
    template's (it was refused: the template did not close a turn with the tokenizer's EOS)."""
    from reinforge.models.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer

    tokenizer = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    tokenizer.eos_token = "<|endoftext|>"
    renderer = ToolTurnRenderer(tokenizer)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert renderer.eos_text == "<|im_end|>" and renderer.stop_ids == (end_of_turn,) and renderer.separator == "\n"

    conversation, script = _conversation_and_script(_hermes_chatml)
    tool = FunctionTool(calculator)
    prompt_ids = tokenizer.apply_chat_template(conversation[:2], tools=[tool.schema], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    client = scripted_client(tokenizer, script, eos_text="<|im_end|>")
    context = AgentContext(tokenizer, client, MultiTurnConfig(max_parallel_calls=2), {"calculator": tool})
    output = asyncio.run(get_agent_loop("tool_agent")(context).run(
        SamplingParams(max_tokens=1000, stop_token_ids=(5,)), prompt_ids=list(prompt_ids)))
    expected = tokenizer.apply_chat_template(conversation, tools=[tool.schema], tokenize=True, return_dict=False)
    stream = output.prompt_ids + output.response_ids
    assert stream == expected[:len(stream)] and output.num_turns == 6
    assert all(sampling.stop_token_ids == (5, end_of_turn) for sampling in client.samplings)


def test_a_template_closing_turns_with_plain_text_is_refused_naming_it(chatml_tokenizer):
    template = ("{% for m in messages %}{{ m.role + ': ' + m.content + '\\n\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ValueError, match=r"closes an assistant turn with '\\n\\n', which starts with neither the "
                                         r"tokenizer's EOS '<\|im_end\|>' nor another special token"):
        ToolTurnRenderer(chatml_tokenizer, chat_template=template)


@pytest.mark.parametrize("family, increment", [
    ("qwen3", "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    ("llama3.1", '<|start_header_id|>ipython<|end_header_id|>\n\n"7"<|eot_id|><|start_header_id|>assistant'
                 '<|end_header_id|>\n\n'),
    ("phi4-mini", "<|tool|>7<|end|><|assistant|>"),  # not the EOS its template closes a conversation with
    ("smollm3", "\n<|im_start|>user\n7<|im_end|>\n<|im_start|>assistant\n"),
    ("deepseek-v3", "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>7<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"),
    ("mistral-v0.3", '[TOOL_RESULTS] {"content": 7, "call_id": "c00000000"}[/TOOL_RESULTS]'),  # needs the call's id
])
def test_each_familys_tool_turn_is_what_its_template_writes_after_the_end_of_turn(family, increment):
    tokenizer = family_tokenizer(family)
    renderer = ToolTurnRenderer(tokenizer)
    assert renderer.increment_text([{"role": "tool", "content": "7", "tool_call_id": "c00000000"}]) == increment
    assert renderer.stop_ids == (tokenizer.convert_tokens_to_ids(renderer.eos_text),)


@pytest.mark.parametrize("family, refusal", [
    ("olmo2", "drops tool messages"), ("phi3", "drops tool messages"),  # no tool role: the output would be lost
])
def test_a_template_that_cannot_show_a_tool_output_is_refused_in_one_line(family, refusal):
    with pytest.raises(ValueError, match=r"the chat template " + refusal.replace("(", r"\(")) as refused:
        ToolTurnRenderer(family_tokenizer(family))
    assert "data.chat_template" in str(refused.value) and "\n" not in str(refused.value)


def _llama_json_run(tokenizer, client, tool, conversation):
    """``tool_agent`` with Llama 3's JSON calls from the conversation's first message; its stream must be the
    template's rendering of the whole conversation."""
    prompt_ids = tokenizer.apply_chat_template(conversation[:1], tools=[tool.schema], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    context = AgentContext(tokenizer, client, MultiTurnConfig(format="llama3_json"), {tool.name: tool})
    output = asyncio.run(get_agent_loop("tool_agent")(context).run(SamplingParams(max_tokens=1000),
                                                                  prompt_ids=list(prompt_ids)))
    expected = tokenizer.apply_chat_template(conversation, tools=[tool.schema], tokenize=True, return_dict=False)
    assert output.prompt_ids + output.response_ids == expected
    return output


def test_a_llama31_trajectory_of_json_calls_equals_its_template_of_the_whole_conversation(scripted_client):
    """Llama 3.1's own template and call format (``llama3_json``): one JSON call a turn, tool output as an ipython turn."""
    tokenizer = family_tokenizer("llama3.1")
    tool = FunctionTool(calculator)
    calls = [_call("calculator", {"expression": "12*34"}), _call("calculator", {"expression": "408+1"})]
    conversation = [{"role": "user", "content": "What is 12*34+1?"},
                    {"role": "assistant", "tool_calls": [calls[0]]}, {"role": "tool", "content": "408"},
                    {"role": "assistant", "tool_calls": [calls[1]]}, {"role": "tool", "content": "409"},
                    {"role": "assistant", "content": "It is 409."}]
    script = [json.dumps({"name": "calculator", "parameters": call["function"]["arguments"]}) for call in calls]
    output = _llama_json_run(tokenizer, scripted_client(tokenizer, [*script, "It is 409."]), tool, conversation)
    assert output.metrics["num_tool_calls"] == 2 and output.metrics["tool_errors"] == 0 and output.num_turns == 6


def test_a_mistral_trajectory_answers_each_call_by_its_id_as_its_template_writes_the_conversation(scripted_client):
    """Mistral's template takes a tool result only with the 9-character id of its call: the id the model wrote,
    or (a call without one) an id of the tool turn and the call's place in it."""
    tokenizer = family_tokenizer("mistral-v0.3")
    tool = FunctionTool(calculator)
    turns = ['[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "12*34"}, "id": "a1B2c3D4e"}]',
             '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "408+1"}}]', "It is 409."]
    conversation = [{"role": "user", "content": "What is 12*34+1?"},
                    {"role": "assistant", "content": turns[0]}, {"role": "tool", "content": "408",
                                                                 "tool_call_id": "a1B2c3D4e"},
                    {"role": "assistant", "content": turns[1]}, {"role": "tool", "content": "409",
                                                                 "tool_call_id": "c00010000"},
                    {"role": "assistant", "content": turns[2]}]
    client = scripted_client(tokenizer, [" " + turn for turn in turns], eos_text="</s>")
    prompt_ids = tokenizer.apply_chat_template(conversation[:1], tokenize=True, return_dict=False)
    context = AgentContext(tokenizer, client, MultiTurnConfig(format="mistral"), {"calculator": tool})
    output = asyncio.run(get_agent_loop("tool_agent")(context).run(SamplingParams(max_tokens=1000),
                                                                  prompt_ids=list(prompt_ids)))
    expected = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
    assert output.prompt_ids + output.response_ids == expected
    assert output.metrics["num_tool_calls"] == 2 and output.metrics["tool_errors"] == 0 and output.num_turns == 6


def test_a_call_turn_the_model_ends_with_eom_gets_no_second_end_of_turn(scripted_client):
    """Llama 3.1 ends a built-in tool's call turn with ``<|eom_id|>`` where its template writes that token itself:
    the tool turn follows it directly, with no ``<|eot_id|>`` the template does not write."""
    from family_templates import LLAMA31

    template = LLAMA31.replace('{{- "}" }}{{- "<|eot_id|>" }}', '{{- "}" }}{{- "<|eom_id|>" }}')
    assert template != LLAMA31
    tokenizer = family_tokenizer("llama3.1")
    tokenizer.chat_template = template
    tool = FunctionTool(calculator)
    call = _call("calculator", {"expression": "12*34"})
    conversation = [{"role": "user", "content": "What is 12*34?"}, {"role": "assistant", "tool_calls": [call]},
                    {"role": "tool", "content": "408"}, {"role": "assistant", "content": "It is 408."}]

    class EndsCallsWithEom(scripted_client):
        async def generate(self, prompt_ids, sampling, request_id):
            completion = await super().generate(prompt_ids, sampling, request_id)
            if len(self.turns) == 1:  # the call turn
                completion.token_ids[-1] = tokenizer.convert_tokens_to_ids("<|eom_id|>")
            return completion

    client = EndsCallsWithEom(tokenizer, [json.dumps({"name": "calculator", "parameters": {"expression": "12*34"}}),
                                          "It is 408."], eos_text="<|eot_id|>")
    output = _llama_json_run(tokenizer, client, tool, conversation)
    assert output.metrics["num_tool_calls"] == 1 and output.metrics["tool_errors"] == 0
