"""Turning a dataset prompt (chat messages or a plain string) into prompt token ids.

The tokenizer's own chat template renders the messages with the generation prompt appended
(``data.chat_template`` replaces it when set). We render to text and then tokenize without
adding special tokens, which is what transformers does inside ``apply_chat_template`` and
keeps the result a plain ``list[int]`` across transformers versions.
"""

from __future__ import annotations

from typing import Any

Messages = list[dict[str, Any]]


def render_prompt(tokenizer: Any, prompt: Messages | str, chat_template: str | None = None,
                  tools: list[dict[str, Any]] | None = None) -> str:
    """The text the model sees for ``prompt``, with the assistant turn opened.

    A string prompt counts as one user message. ``tools`` (OpenAI function schemas) go to the
    template, which shows them to the model as it was trained to see them.
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"tokenizer {name!r} has no chat template; set data.chat_template to a Jinja template, "
                         "or data.apply_chat_template=false to feed string prompts as they are")
    return tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                         tokenize=False, tools=tools or None)


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
