"""Turning a dataset prompt (chat messages or a plain string) into prompt token ids.

The tokenizer's own chat template renders the messages with the generation prompt appended
(``data.chat_template`` replaces it when set). We render to text and then tokenize without
adding special tokens, which is what transformers does inside ``apply_chat_template`` and
keeps the result a plain ``list[int]`` across transformers versions.
"""

from __future__ import annotations

import json
from typing import Any

Messages = list[dict[str, Any]]


def apply_chat_template(tokenizer: Any, messages: Messages, **kwargs: Any) -> Any:
    """``tokenizer.apply_chat_template``, for a tool-call turn with ``content: null`` too.

    transformers drops a message's None-valued keys before rendering, and a template that reads a tool-call turn's
    content unconditionally (DeepSeek-V3's tests ``content is none``, which then never holds) fails on it. Where the
    messages as given fail and hold such a turn, they are rendered with its content as '' (what OpenAI's null means:
    no text beside the calls); a template that renders them as given is left alone.
    """
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as error:
        if not any(isinstance(message, dict) and message.get("content", "") is None for message in messages):
            raise
        filled = [message | {"content": ""} if isinstance(message, dict) and message.get("content", "") is None
                  else message for message in messages]
        try:
            return tokenizer.apply_chat_template(filled, **kwargs)
        except Exception:
            raise error from None


def chat_template_text(tokenizer: Any, chat_template: str | None = None, tools: bool = False) -> str | None:
    """The template to render with: ``chat_template`` when given, else the tokenizer's. A tokenizer that ships named
    templates (a dict, as Hermes-2-Pro's and Command-R's) gives its ``tool_use`` one where tools are rendered and
    it has one, else its ``default``, as transformers picks them; None where it has no template."""
    if chat_template:
        return chat_template
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, dict):
        return template
    name = "tool_use" if tools and "tool_use" in template else "default"
    if name not in template:
        raise ValueError(f"the tokenizer's chat templates are named {', '.join(map(repr, template))}, none of them "
                         "'default'; set data.chat_template to the one to use")
    return template[name]


def render_prompt(tokenizer: Any, prompt: Messages | str, chat_template: str | None = None,
                  tools: list[dict[str, Any]] | None = None) -> str:
    """The text the model sees for ``prompt``, with the assistant turn opened; a prompt that ends with an assistant
    message leaves that message open, to be continued (TRL's prefill: ``continue_final_message``).

    A string prompt counts as one user message. ``tools`` (OpenAI function schemas) go to the
    template, which shows them to the model as it was trained to see them.
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    template = chat_template_text(tokenizer, chat_template, bool(tools))
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"tokenizer {name!r} has no chat template; set data.chat_template to a Jinja template, "
                         "or data.apply_chat_template=false to feed string prompts as they are")
    prefilled = bool(messages) and messages[-1].get("role") == "assistant"
    return apply_chat_template(tokenizer, messages, chat_template=template, add_generation_prompt=not prefilled,
                               continue_final_message=prefilled, tokenize=False, tools=tools or None)


def encode_prompt(tokenizer: Any, prompt: Messages | str, apply_chat_template: bool = True,
                  chat_template: str | None = None, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Prompt token ids: the chat template applied (with ``tools``), or a string prompt tokenized as it is."""
    if apply_chat_template:
        text = render_prompt(tokenizer, prompt, chat_template, tools)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not isinstance(prompt, str):
        raise ValueError("a chat-message prompt needs a chat template, but data.apply_chat_template is false; "
                         "set it to true or store prompts as strings")
    return list(tokenizer(prompt)["input_ids"])


def get_pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, or its EOS id when it has no pad token."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    raise ValueError("the tokenizer has neither a pad token nor an EOS token to pad prompts with; "
                     "set tokenizer.pad_token before building the data loader")


ASSISTANT_MARKER = "\u2063reinforge-assistant-marker\u2063"
"""Text no real reply holds: where the template puts an assistant's content, to read what it writes around it."""


def end_of_turn_token(tokenizer: Any, after: str) -> str:
    """The token that closes an assistant turn, given the template's text right after one: the tokenizer's EOS if
    the text starts with it, else the longest special token it starts with."""
    eos = tokenizer.eos_token
    if eos and after.startswith(eos):
        return eos
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = {*getattr(tokenizer, "all_special_tokens", ()), *(token.content for token in decoder.values()
                                                                 if getattr(token, "special", False))}
    starting = [token for token in specials if token and after.startswith(token)]
    if not starting:
        raise ValueError(f"the chat template closes an assistant turn with {after[:40]!r}, which starts with neither the "
                         f"tokenizer's EOS {eos!r} nor another special token, so a turn has no token to stop at; "
                         "use a template whose assistant turns end with a special token")
    return max(starting, key=len)


ASSISTANT_TURN = [{"role": "user", "content": "?"}, {"role": "assistant", "content": ASSISTANT_MARKER}]
"""A user turn and an assistant turn holding the marker: what the template writes around a reply."""


def assistant_turn_text(tokenizer: Any, chat_template: str) -> tuple[str, str]:
    """(``ASSISTANT_TURN`` rendered by ``chat_template``, the text after the assistant's content: its end of turn and
    whatever the template writes after it)."""
    text = tokenizer.apply_chat_template(ASSISTANT_TURN, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=False)
    return text, text[text.index(ASSISTANT_MARKER) + len(ASSISTANT_MARKER):]


def template_end_of_turn_ids(tokenizer: Any, chat_template: str | None = None) -> tuple[int, ...]:
    """The id of the token the chat template closes an assistant turn with (Gemma's <end_of_turn>, Llama 3's
    <|eot_id|>, Phi-3's <|end|>, ChatML's <|im_end|>), or () where there is no template, it cannot render a turn, or
    it closes one with plain text."""
    template = chat_template_text(tokenizer, chat_template)
    if not template:
        return ()
    try:
        ids = tokenizer(end_of_turn_token(tokenizer, assistant_turn_text(tokenizer, template)[1]),
                        add_special_tokens=False)["input_ids"]
    except Exception:  # a template that refuses this shape, or no special token closes the turn
        return ()
    return tuple(ids) if len(ids) == 1 else ()


def after_end_of_turn_ids(tokenizer: Any, chat_template: str | None = None) -> tuple[int, tuple[int, ...]] | None:
    """(the id of the token the chat template closes an assistant turn with, the ids of the text it writes after that
    token: ChatML's and Gemma's newline), or None where there is no such token or nothing follows it (Llama 3)."""
    template = chat_template_text(tokenizer, chat_template)
    end_ids = template_end_of_turn_ids(tokenizer, template)
    if not end_ids:
        return None
    after = assistant_turn_text(tokenizer, template)[1]
    rest = after[len(end_of_turn_token(tokenizer, after)):]
    return (end_ids[0], tuple(tokenizer(rest, add_special_tokens=False)["input_ids"])) if rest else None


def row_tools(row: dict[str, Any], where: str) -> list[dict[str, Any]] | None:
    """The row's ``tools`` column, the function schemas the template shows beside its conversation (as TRL's SFT and
    preference rows carry them): a list of OpenAI function schemas, or that list as JSON text (parquet often stores
    it so); None when the row has none. ``where`` names the row in an error."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} has a 'tools' column that is not valid JSON ({error.msg}); give a list of "
                             "function schemas") from None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools)):
        shown = type(tools).__name__ if not isinstance(tools, list) else \
            f"list holding a {next(type(tool).__name__ for tool in tools if not isinstance(tool, dict))}"
        raise ValueError(f"{where} has a 'tools' column of type {shown}; give a list of function schemas "
                         "({'type': 'function', 'function': {'name': ..., 'parameters': ...}})")
    return tools or None


def template_error_message(error: Exception, what: str, setting: str = "data.chat_template") -> str:
    """One line for an exception the chat template raised while rendering ``what`` ('this prompt'): the template's
    own refusal (raise_exception: Gemma's 'System role not supported', Mistral's alternation rule) with its fix, or a
    jinja2 error on odd message content. ``setting``: where another template is set (serve's --chat-template FILE)."""
    from jinja2.exceptions import TemplateError, UndefinedError

    if isinstance(error, TemplateError) and not isinstance(error, UndefinedError):
        hint = ("make the roles alternate user/assistant after an optional first system message (merge consecutive "
                "user turns)") if "alternate" in str(error).lower() else \
            ("merge the system message into the first user message (this model has no system role), or set "
             f"{setting} to a template that accepts one") if "system" in str(error).lower() else \
            f"change the messages to the shape the template accepts, or set {setting}"
        return f"the model's chat template refuses {what} ({error}); {hint}"
    return (f"the chat template cannot render {what} ({type(error).__name__}: {error}); give each message's "
            "'content' as a string")
