"""Chat templates of the model families reinforge runs, written from their published formats (no hub here)."""

from __future__ import annotations

from reinforge.models.tiny import SPECIAL_TOKENS, build_char_tokenizer

QWEN3 = r"""{%- if tools %}{{- '<|im_start|>system\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}{{- "# Tools\n\n<tools>" }}{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}{{- "\n</tools><|im_end|>\n" }}{%- else %}{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}{%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) %}{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
{%- elif message.role == "assistant" %}{%- set reasoning_content = '' %}
{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}{%- else %}{%- if '</think>' in content %}{%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}{%- endif %}
{%- if loop.index0 > ns.last_query_index %}{%- if loop.last or (not loop.last and reasoning_content) %}{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}
{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}{%- if (loop.first and content) or (not loop.first) %}{{- '\n' }}{%- endif %}{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}{{- '<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}{{- '}\n</tool_call>' }}{%- endfor %}{%- endif %}{{- '<|im_end|>\n' }}
{%- elif message.role == "tool" %}{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}{{- '\n<tool_response>\n' }}{{- content }}{{- '\n</tool_response>' }}{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"""
"""Qwen3's: ChatML, Hermes <tool_call>s, tool messages as <tool_response> user turns, and an earlier turn's empty
<think></think> left out once more turns follow."""

LLAMA31 = r"""{{- bos_token }}{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}{{- "Cutting Knowledge Date: December 2023\n" }}{{- "Today Date: " + date_string + "\n\n" }}{{- system_message }}{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}{%- if messages | length != 0 %}{%- set first_user_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}{%- else %}{{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}{%- endif %}{{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}{{- "Do not use variables.\n\n" }}{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}{{- first_user_message + "<|eot_id|>"}}{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}{%- if not message.tool_calls|length == 1 %}{{- raise_exception("This model only supports single tool-calls at once!") }}{%- endif %}{%- set tool_call = message.tool_calls[0].function %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}" }}{{- "<|eot_id|>" }}
{%- elif message.role == "tool" or message.role == "ipython" %}{{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}{%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}{{- "<|eot_id|>" }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"""
"""Llama 3.1's: header tokens, <|eot_id|>, tools in the first user message, tool output as an ipython turn (tojson'd)."""

OLMO2 = "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'assistant' %}{% if not loop.last %}{{ '<|assistant|>\n'  + message['content'] + eos_token + '\n' }}{% else %}{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}{% endif %}{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}"
"""OLMo 2 Instruct's: <|user|> / <|assistant|> text headers, EOS closing assistant turns; no tool role (tool
messages are dropped)."""

PHI3 = "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
"""Phi-3-mini's: <|end|> closing each turn, EOS after the last when no generation prompt; no tool role."""

PHI4_MINI = "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
"""Phi-4-mini's: any role as <|role|>content<|end|>, EOS after the last turn when no generation prompt."""

SMOLLM3 = r"""{%- set reasoning_mode = "/think" -%}{%- set custom_instructions = messages[0].content if messages[0].role == "system" else "" -%}{{- "<|im_start|>system\n" + "## Metadata\n\nKnowledge Cutoff Date: June 2025\nReasoning Mode: " + reasoning_mode + "\n\n" -}}{%- if custom_instructions -%}{{- "## Custom Instructions\n\n" + custom_instructions + "\n\n" -}}{%- endif -%}{{- "<|im_end|>\n" -}}
{%- for message in messages -%}{%- set content = message.content if message.content is string else "" -%}
{%- if message.role == "user" -%}{{ "<|im_start|>" + message.role + "\n"  + content + "<|im_end|>\n" }}
{%- elif message.role == "assistant" -%}{%- if reasoning_mode == "/think" -%}{{ "<|im_start|>assistant\n" + content.lstrip("\n") + "<|im_end|>\n" }}{%- else -%}{{ "<|im_start|>assistant\n" + "<think>\n\n</think>\n" + content.lstrip("\n") + "<|im_end|>\n" }}{%- endif -%}
{%- elif message.role == "tool" -%}{{ "<|im_start|>" + "user\n"  + content + "<|im_end|>\n" }}{%- endif -%}{%- endfor -%}
{%- if add_generation_prompt -%}{{ "<|im_start|>assistant\n" }}{%- endif -%}"""
"""SmolLM3's (reasoning mode /think): a metadata system turn holding the system message as custom instructions,
ChatML, tool output as a user turn."""

DEEPSEEK_V3 = "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if message['content'] is none %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments']|tojson + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments']|tojson + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- set ns.is_first = true -%}{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments']|tojson + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- if message['role'] == 'assistant' and 'tool_calls' not in message %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'\\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
"""DeepSeek-V3's: <｜User｜> / <｜Assistant｜>, <｜end▁of▁sentence｜>, tool outputs between
<｜tool▁outputs▁begin｜> and <｜tool▁outputs▁end｜>, which is also the next turn's header."""

DEEPSEEK_R1 = DEEPSEEK_V3.replace(
    "{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}",
    "{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}"
    "{% endif %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}").replace(
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}",
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")
"""DeepSeek-R1's: DeepSeek-V3's, with every reply written without its reasoning (up to its last </think>) and a
generation prompt that opens the reasoning."""

MISTRAL_V3 = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] | trim + eos_token }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if not message.tool_call_id is defined or message.tool_call_id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + message['content'] | string + ', \"call_id\": \"' + message.tool_call_id"
    " + '\"}[/TOOL_RESULTS]' }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported, with the exception of an initial "
    "optional system message!') }}{%- endif %}{%- endfor %}")
"""Mistral-7B-Instruct-v0.3's: [INST] turns, EOS closing a reply, tool results that need the 9-character call id, and
the system message written into the conversation's last user turn only when that turn ends it."""

GEMMA3 = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + "
    "'\\n\\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}"
    "{%- endif -%}{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")
"""Gemma 3's (text): BOS, no system role (the system message opens the first user turn), strict alternation,
<end_of_turn>."""

FAMILY_DEEPSEEK_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                          "<｜tool▁outputs▁begin｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
                          "<｜tool▁outputs▁end｜>")

FAMILIES = {
    "qwen3": (QWEN3, (), "<|im_end|>"),
    "llama3.1": (LLAMA31, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                           "<|eom_id|>", "<|python_tag|>"), "<|eot_id|>"),
    "olmo2": (OLMO2, (), "<|endoftext|>"),
    "phi3": (PHI3, ("<|user|>", "<|assistant|>", "<|system|>", "<|end|>"), "<|endoftext|>"),
    "phi4-mini": (PHI4_MINI, ("<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|tool|>", "<|/tool|>"),
                  "<|endoftext|>"),
    "smollm3": (SMOLLM3, (), "<|im_end|>"),
    "deepseek-v3": (DEEPSEEK_V3, FAMILY_DEEPSEEK_TOKENS, "<｜end▁of▁sentence｜>"),
    "deepseek-r1": (DEEPSEEK_R1, FAMILY_DEEPSEEK_TOKENS, "<｜end▁of▁sentence｜>"),
    "mistral-v0.3": (MISTRAL_V3, ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), "</s>"),
    "gemma3": (GEMMA3, ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<eos>"),
}
"""family -> (chat template, its special tokens beyond the character tokenizer's ChatML ones, its EOS)."""


def family_tokenizer(family: str):
    """The character tokenizer with the family's template, special tokens (marked special, as the family's own
    tokenizer marks them), EOS and BOS (the first of its special tokens that starts a text)."""
    template, tokens, eos = FAMILIES[family]
    tokenizer = build_char_tokenizer(tokens, chat_template=template)
    if tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    tokenizer.eos_token = eos
    starts = [token for token in tokens if token in ("<|begin_of_text|>", "<｜begin▁of▁sentence｜>", "<s>", "<bos>")]
    tokenizer.bos_token = starts[0] if starts else (eos if family == "olmo2" else None)
    assert eos in SPECIAL_TOKENS or eos in tokens
    return tokenizer
