"""The SFT dataset: chat conversations tokenized with a loss mask on the assistant's tokens.

A row holds ``messages``: any number of turns with roles system, user, assistant and tool.
The sequence trained is the whole conversation as the chat template renders it once, without a
generation prompt: a template that writes an earlier turn differently once later turns follow
(Qwen3's leaves an earlier reply's ``<think>...</think>`` out) is trained on
that text, as TRL's ``assistant_only_loss`` and verl's multi-turn SFT dataset train it. The loss
covers what the template writes of each assistant message and its end-of-turn token:

- a template with ``{% generation %}`` blocks marks those tokens itself, and they are exactly the
  ones transformers' ``return_assistant_tokens_mask`` (so TRL) trains, with the end-of-turn token the
  template writes right after a block that leaves it out (TRL only warns that such a model may not
  learn to stop), an empty reply's too (its block marks no token);
- otherwise a message's part of the text is what changes when its content is replaced by a
  probe string (its tool calls and reasoning included). It starts where the conversation before
  it, rendered with the generation prompt, ends, when the text starts with that rendering (so
  ChatML's ``<|im_start|>assistant\n`` header is not trained, Qwen3's ``<think>`` block is), and it
  ends at the end-of-turn token (EOS or the template's own, Gemma's ``<end_of_turn>``), trained,
  so the newline ChatML writes after ``<|im_end|>`` is not. For a template that renders a
  conversation's first messages as a prefix of the whole, this is exactly the text between the
  two renderings.

Tokens are assigned to spans by their character offsets in the one tokenization of the whole
text (a token holding any of a reply's text is trained, as transformers counts them), which keeps
the tokens exactly those the model sees at inference, merges at turn boundaries included.
A row whose template would lose part of it is refused, naming the message: a system, user or
tool message it does not write (OLMo 2's and Phi-3's have no tool role; Mistral's writes the
system message only into a last user turn), an assistant's ``tool_calls`` it ignores (the turn
would train nothing but its end of turn), or the reasoning of the reply a conversation ends with
(DeepSeek-R1's drops every reply's).

Rows then become ``[prompt | response]`` batches, the layout the engine's
micro-batching uses for RL: the "prompt" is everything before the first trained token and the
loss mask covers the rest. With packing, several conversations share a row and the position
ids restart at each one, which keeps attention within each conversation.

With ``data.loss_on=all`` every token of a row is trained (but the first, which nothing predicts, and a
conversation's image tokens), as TRL's SFT trains a conversation without ``assistant_only_loss`` and a
prompt/completion row with ``completion_only_loss=False``.

Plain text rows, TRL's standard format (a ``prompt`` and ``completion`` string, or a ``text`` string), take no chat
template: ``prompt + completion`` and the EOS token are tokenized as any text is (a BOS where the tokenizer adds one),
and the completion and the EOS are trained (all of a ``text``).

TRL's conversational prompt/completion rows (a ``prompt`` and a ``completion`` list of chat messages) are one
conversation, rendered whole, whose loss covers only the completion: what follows the prompt rendered with its
generation prompt, so an assistant turn of the prompt is context, as in TRL's ``completion_only_loss``. Within the
completion, each assistant message is trained as above (a tool message of the completion is not, where TRL's
completion mask covers it).

Conversations with images (an ``images`` column with ``<image>`` placeholders, or image content parts; see
``multimodal.py``) need the model's processor: each image's one pad token of the rendering becomes the image's
merged patches, as the processor expands it, never trained; their pixels are made when a batch first holds the
row, and the loader keeps them (within a byte budget) for the later epochs.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from reinforge.data.chat_template import (
    apply_chat_template,
    chat_template_text,
    row_tools,
    template_end_of_turn_ids,
    template_error_message,
)
from reinforge.data.files import as_list, expand_data_files, read_rows
from reinforge.data.loader_state import check_resumed_counts, data_digest, warn_if_contents_changed
from reinforge.data.multimodal import (
    check_image_count,
    check_image_places,
    image_inputs,
    images_refused,
    images_tokens,
    load_image,
    load_images,
    row_images,
    with_image_parts,
)
from reinforge.data.prompt_loader import epoch_order
from reinforge.data.rl_dataset import check_chat_messages
from reinforge.protocol import MULTI_MODAL_KEY, Batch

logger = logging.getLogger(__name__)

TRAINED_ROLES = ("assistant",)


@dataclass(frozen=True)
class SFTExample:
    input_ids: list[int]
    loss_mask: list[int]
    """1 where the token is a target of the loss (assistant content and its end-of-turn token)."""
    position_ids: list[int]
    """0.. per conversation; a packed row restarts them at each conversation."""
    images: tuple = ()
    """The conversation's images as the file gives them (opened and processed when a batch first holds the row;
    ``SFTLoader`` keeps the result, ``ImageInputsCache``)."""


def _render(tokenizer: Any, messages: list[dict[str, Any]], template: str, add_generation_prompt: bool,
            tools: list[dict[str, Any]] | None = None) -> str:
    return apply_chat_template(tokenizer, messages, chat_template=template, tokenize=False,
                               add_generation_prompt=add_generation_prompt, tools=tools)


GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""A ``{% generation %}`` block: the template marks what an assistant writes itself."""

REPLY_PROBE = "\u2063reinforge-reply-probe\u2063"
"""An assistant message's content no real reply holds: where the template writes a reply is what it changes."""

MESSAGE_PROBE = "reinforge-message-probe-{}"
"""A system, user or tool message's content, plain ASCII so that ``tojson`` keeps it: whether the template writes it."""

DROPPED_MESSAGE_FIX = {
    "tool": "set data.chat_template to a template with a tool role, or keep rows without tool turns",
    "system": "merge the system message into the first user message, or set data.chat_template to a template that "
              "writes it",
    "user": "set data.chat_template to a template that writes every user message",
}


def check_messages_rendered(tokenizer: Any, messages: list[dict[str, Any]], template: str,
                            tools: list[dict[str, Any]] | None = None) -> None:
    """Raise one line unless the template writes the content of each system, user and tool message and the
    ``tool_calls`` of each assistant message. A template without a tool role (OLMo 2's, Phi-3's) drops a tool's
    output, one that ignores ``tool_calls`` leaves a call turn nothing to train but its end of turn, and Mistral's
    writes the system message only into a conversation's last user turn (none, when an assistant turn ends it)."""
    probed = [dict(message, content=MESSAGE_PROBE.format(number)) if message["role"] != "assistant"
              and isinstance(message.get("content"), str) else dict(message, content=message.get("content") or "")
              for number, message in enumerate(messages)]
    try:
        text = _render(tokenizer, probed, template, False, tools)
    except Exception:  # the template's own refusal, reported when the conversation is rendered
        return
    for number, message in enumerate(messages):
        if probed[number]["content"] == MESSAGE_PROBE.format(number) and MESSAGE_PROBE.format(number) not in text:
            raise ValueError(f"the chat template drops message {number} ({message['role']}): it writes none of its "
                             f"content, so the model would be trained without it; {DROPPED_MESSAGE_FIX[message['role']]}")
    for number, message in enumerate(messages):
        if message["role"] != "assistant" or not message.get("tool_calls"):
            continue
        without_calls = {key: value for key, value in message.items() if key != "tool_calls"}
        for content in dict.fromkeys((message["content"], "")):  # a template may not print a null content
            chats = [[*messages[:number], dict(turn, content=content), *messages[number + 1:]]
                     for turn in (message, without_calls)]
            try:
                with_calls, without = (_render(tokenizer, chat, template, False, tools) for chat in chats)
            except Exception:
                continue
            if with_calls == without:
                raise ValueError(f"the chat template drops the tool_calls of message {number} (assistant): it writes "
                                 "the turn without them, so the model would learn to end it instead of calling; set "
                                 "data.chat_template to a template that writes tool calls, or keep rows without tool "
                                 "turns")
            break
    check_last_reasoning_rendered(tokenizer, messages, template, tools)


def check_last_reasoning_rendered(tokenizer: Any, messages: list[dict[str, Any]], template: str,
                                  tools: list[dict[str, Any]] | None = None) -> None:
    """Raise one line when the conversation ends with a reply that reasons (``</think>`` in its content, or a
    ``reasoning_content``) and the template writes no more ``</think>`` with it than without it: DeepSeek-R1's
    drops every reply's reasoning, so the model would learn to answer without thinking. (An earlier reply's
    reasoning left out, as Qwen3's template leaves it, is what the model sees of it later: not refused.)"""
    last = messages[-1]
    reasoning = last.get("reasoning_content")
    if last["role"] != "assistant" or not ("</think>" in (last.get("content") or "")
                                           or (isinstance(reasoning, str) and reasoning.strip())):
        return
    try:
        with_reply, without = (_render(tokenizer, chat, template, False, tools) for chat in (messages, messages[:-1]))
    except Exception:  # the template's own refusal, reported when the conversation is rendered
        return
    if with_reply.count("</think>") <= without.count("</think>"):
        raise ValueError(f"the chat template drops the reasoning (<think>...</think>) of message {len(messages) - 1} "
                         "(assistant), the reply the conversation ends with, so the model would learn to answer "
                         "without it; set data.chat_template to a template that writes a last reply's reasoning "
                         "(TRL's training templates do), or drop the reasoning from the rows")


def _common_prefix_length(first: str, second: str, limit: int) -> int:
    length = 0
    while length < limit and first[length] == second[length]:
        length += 1
    return length


def assistant_char_spans(tokenizer: Any, messages: list[dict[str, Any]], template: str, text: str,
                         tools: list[dict[str, Any]] | None = None) -> list[tuple[int, int]]:
    """The [start, end) character span in ``text`` (the whole conversation rendered) of each assistant message: what
    the template writes for it, from the end of the header the generation prompt writes to its end of turn (not
    included). The message's content replaced by ``REPLY_PROBE`` (its tool calls and reasoning left out) changes
    exactly that part of the text; the rendering before it with the generation prompt, when the text starts with
    it, says where the header ends (so a reasoning block's ``<think>`` the template writes is trained)."""
    spans = []
    for index, message in enumerate(messages):
        if message["role"] not in TRAINED_ROLES:
            continue
        probe = _render(tokenizer, [*messages[:index], {"role": "assistant", "content": REPLY_PROBE},
                                    *messages[index + 1:]], template, False, tools)
        at = probe.find(REPLY_PROBE)
        if at < 0:
            raise ValueError(f"the chat template does not write the content of message {index} (assistant), so "
                             "there is no reply to train; set data.chat_template to a template that writes it")
        start = _common_prefix_length(text, probe, min(at, len(text)))
        after = len(probe) - at - len(REPLY_PROBE)
        end = len(text) - _common_prefix_length(text[::-1], probe[::-1], min(after, len(text) - start))
        try:
            before = _render(tokenizer, messages[:index], template, True, tools)
        except Exception:  # a template that refuses the shorter conversation: the reply starts where it differs
            before = None
        if before is not None and text.startswith(before) and len(before) <= end:
            start = len(before)
        spans.append((start, end))
    return spans


def _reply_mask(tokenizer: Any, messages: list[dict[str, Any]], template: str, tools: list[dict[str, Any]] | None,
                text: str, offsets: list[tuple[int, int]], input_ids: list[int]) -> list[int]:
    """1 on the tokens of each assistant message's span (``assistant_char_spans``) and on its end-of-turn token."""
    loss_mask = [0] * len(input_ids)
    # the template's end-of-turn (Gemma's <end_of_turn>, Phi-3's <|end|>), not only the tokenizer's EOS
    turn_end_ids = set(template_end_of_turn_ids(tokenizer, template)) or {tokenizer.eos_token_id}
    for start, end in assistant_char_spans(tokenizer, messages, template, text, tools):
        # a token holding text of the reply, as transformers' assistant mask counts it (a merge across the header's
        # end included)
        inside = [position for position, (first, last) in enumerate(offsets) if first < end and last > start]
        # then the end-of-turn token the reply stops at (not what the template writes after it: ChatML's newline)
        following = [position for position, (first, _) in enumerate(offsets) if first >= end]
        for position in following:
            if input_ids[position] in turn_end_ids:
                if not text[end:offsets[position][0]].strip():
                    inside += range(following[0], position + 1)
                break
        for position in inside:
            loss_mask[position] = 1
    return loss_mask


def _marked_assistant_mask(tokenizer: Any, messages: list[dict[str, Any]], template: str,
                           tools: list[dict[str, Any]] | None, input_ids: list[int]) -> list[int]:
    """The tokens inside the template's ``{% generation %}`` blocks, as transformers' ``return_assistant_tokens_mask``
    (TRL's ``assistant_only_loss``) gives them."""
    encoded = apply_chat_template(tokenizer, messages, chat_template=template, tools=tools, tokenize=True,
                                  return_dict=True, return_assistant_tokens_mask=True, add_generation_prompt=False)
    if list(encoded["input_ids"]) != input_ids:
        raise ValueError("the chat template's {% generation %} rendering tokenizes differently from its text, so its "
                         "marked tokens cannot be located; set data.chat_template to a template without them")
    return list(encoded["assistant_masks"])


def _with_end_of_turn(loss_mask: list[int], input_ids: list[int], text: str, offsets: list[tuple[int, int]],
                      turn_end_ids: set[int]) -> list[int]:
    """``loss_mask`` with each run of trained tokens extended to the end-of-turn token that follows it with only
    whitespace between: a ``{% generation %}`` block that leaves it out would never teach the model to stop."""
    loss_mask = list(loss_mask)
    for position in range(len(loss_mask) - 1):
        if not loss_mask[position] or loss_mask[position + 1]:
            continue
        following = position + 1
        while following < len(input_ids) and input_ids[following] not in turn_end_ids \
                and not text[offsets[following][0]:offsets[following][1]].strip():
            following += 1
        if following < len(input_ids) and input_ids[following] in turn_end_ids:
            loss_mask[position + 1:following + 1] = [1] * (following - position)
    return loss_mask


def _with_empty_replies_ended(loss_mask: list[int], tokenizer: Any, messages: list[dict[str, Any]], template: str,
                              tools: list[dict[str, Any]] | None, text: str, offsets: list[tuple[int, int]],
                              input_ids: list[int], turn_end_ids: set[int]) -> list[int]:
    """``loss_mask`` with the end-of-turn token of each empty assistant message of which no token is trained (its
    ``{% generation %}`` block marks nothing) trained, where only whitespace lies between the message's span
    (``assistant_char_spans``) and it: an empty reply is the model stopping at once. A reply with content that the
    template leaves unmarked stays untrained, as the template says."""
    replies = [message for message in messages if message["role"] in TRAINED_ROLES]
    empty = [not str(message.get("content") or "").strip() for message in replies]
    if not any(empty):
        return loss_mask
    loss_mask = list(loss_mask)
    spans = assistant_char_spans(tokenizer, messages, template, text, tools)
    for is_empty, (start, end) in zip(empty, spans, strict=True):
        if not is_empty or any(loss_mask[position] for position, (first, last) in enumerate(offsets)
                               if first < end and last > start):
            continue
        following = [position for position, (first, _) in enumerate(offsets) if first >= end]
        for position in following:
            if input_ids[position] in turn_end_ids:
                if not text[end:offsets[position][0]].strip():
                    loss_mask[following[0]:position + 1] = [1] * (position + 1 - following[0])
                break
    return loss_mask


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, Any]], template: str | None = None,
                          tools: list[dict[str, Any]] | None = None, num_prompt_messages: int = 0) -> SFTExample:
    """Token ids of the rendered conversation and the mask of its trained (assistant) tokens; ``tools`` (OpenAI
    function schemas) are rendered by the template as the model will see them when it calls tools. The first
    ``num_prompt_messages`` messages are a prompt/completion row's prompt: their assistant turns are not trained."""
    template = chat_template_text(tokenizer, template, bool(tools))
    if not template:
        raise ValueError("the tokenizer has no chat template; set data.chat_template to a Jinja template")
    if messages[0]["role"] in TRAINED_ROLES:  # nothing renders before it, and it would be trained on no prompt
        raise ValueError("the conversation starts with an assistant message, which has no prompt to be trained "
                         "on; start it with a system or user message (or drop that message)")
    check_messages_rendered(tokenizer, messages, template, tools)
    text = _render(tokenizer, messages, template, add_generation_prompt=False, tools=tools)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{type(tokenizer).__name__} is a slow tokenizer without character offsets; SFT needs a fast "
                         "tokenizer (tokenizer.json)")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoded["input_ids"])
    if GENERATION_BLOCK.search(template):
        turn_end_ids = set(template_end_of_turn_ids(tokenizer, template)) or {tokenizer.eos_token_id}
        loss_mask = _with_end_of_turn(_marked_assistant_mask(tokenizer, messages, template, tools, input_ids),
                                      input_ids, text, encoded["offset_mapping"], turn_end_ids)
        loss_mask = _with_empty_replies_ended(loss_mask, tokenizer, messages, template, tools, text,
                                              encoded["offset_mapping"], input_ids, turn_end_ids)
    else:
        loss_mask = _reply_mask(tokenizer, messages, template, tools, text, encoded["offset_mapping"], input_ids)
    if num_prompt_messages:  # TRL's completion mask: what follows the prompt rendered with its generation prompt
        prompt = _render(tokenizer, messages[:num_prompt_messages], template, True, tools)
        boundary = _common_prefix_length(text, prompt, min(len(text), len(prompt)))
        loss_mask = [trained if end > boundary else 0
                     for trained, (_, end) in zip(loss_mask, encoded["offset_mapping"], strict=True)]
    loss_mask[0] = 0  # the first token has nothing before it to predict it from
    return SFTExample(input_ids, loss_mask, list(range(len(input_ids))))


def trained_whole(example: SFTExample, image_token_id: int | None = None) -> SFTExample:
    """``example`` with every token trained (data.loss_on=all) but the first, which nothing predicts, and image
    tokens."""
    loss_mask = [int(position > 0 and token != image_token_id) for position, token in enumerate(example.input_ids)]
    return SFTExample(example.input_ids, loss_mask, example.position_ids, example.images)


class SFTDataset:
    """Tokenized conversations of one split, in file order; overlong ones dropped, cut or refused."""

    def __init__(self, files: Sequence[str | Path], tokenizer: Any, *, max_length: int, truncation: str = "drop",
                 messages_key: str = "messages", chat_template: str | None = None, max_samples: int | None = None,
                 name: str = "train", processor: Any = None, image_key: str | None = None,
                 why_no_images: str | None = None, loss_on: str = "assistant", text_key: str = "text"):
        """``loss_on``: data.loss_on, the tokens trained (assistant or all); ``text_key``: the column of a plain text
        row (data.text_key)."""
        if not files:
            raise ValueError(f"no {name} files given; set data.{name}_files to parquet or JSONL files of chat rows")
        files = expand_data_files(files, f"data.{name}_files")
        self.name = name
        self.examples: list[SFTExample] = []
        self.num_dropped = 0
        self.num_without_assistant = 0
        self.num_truncated = 0
        num_rows = 0
        if processor is not None:  # a VLM's processor may keep the template that renders image parts
            chat_template = chat_template or getattr(processor, "chat_template", None)
        for path in files:
            if max_samples is not None and len(self.examples) == max_samples:
                break  # the later files are not read, as the RL prompts' are not
            for row_number, row in enumerate(read_rows(path)):
                if max_samples is not None and len(self.examples) == max_samples:
                    break
                num_rows += 1
                where = f"row {row_number} of {path}"
                row = sharegpt_as_messages(row, messages_key)
                row, sources, column = row_images(row, (messages_key, "prompt", "completion"), image_key, where)
                images = load_images(sources, f"{where}, column {column!r}")
                if images and processor is None:  # why_no_images: models.vision.why_no_images's words
                    raise images_refused(where, len(images), column, why_no_images)
                plain = plain_text_pair(row, messages_key, text_key)
                if plain is not None:
                    if images:
                        raise ValueError(f"{where} has images beside plain text; a row with images holds chat "
                                         f"messages in {messages_key!r}")
                    example = tokenize_text(tokenizer, *plain)
                else:
                    example = _tokenized_conversation(row, where, tokenizer, chat_template, messages_key, processor,
                                                      images, tuple(sources))
                if loss_on == "all":
                    example = trained_whole(example, getattr(processor, "image_token_id", None))
                if not any(example.loss_mask):
                    self.num_without_assistant += 1
                    continue
                if len(example.input_ids) > max_length:
                    if truncation == "drop":
                        self.num_dropped += 1
                        continue
                    if example.images:
                        raise ValueError(f"{where} has {len(example.input_ids)} tokens with its images, more than "
                                         f"data.max_length={max_length}, and a conversation with images cannot be "
                                         "cut; raise max_length or set data.truncation=drop")
                    if truncation == "error":
                        raise ValueError(f"{where} has {len(example.input_ids)} tokens, more than data.max_length="
                                         f"{max_length}; raise max_length or set data.truncation=drop|right")
                    example = SFTExample(example.input_ids[:max_length], example.loss_mask[:max_length],
                                         example.position_ids[:max_length])
                    if not any(example.loss_mask):
                        self.num_dropped += 1
                        continue
                    self.num_truncated += 1
                self.examples.append(example)
        if not self.examples:
            raise ValueError(f"no {name} conversation is left of {num_rows} rows ({self.num_dropped} longer than "
                             f"data.max_length={max_length}, {self.num_without_assistant} without an assistant "
                             "message); check the files and data.max_length")
        logger.info("%s data: %d conversations from %d rows; %d dropped for being longer than %d tokens, %d cut to "
                    "that length (data.truncation=right), %d without an assistant message", name, len(self.examples),
                    num_rows, self.num_dropped, max_length, self.num_truncated, self.num_without_assistant)

    def __len__(self) -> int:
        return len(self.examples)


def expand_image_tokens(example: SFTExample, processor: Any, images: Sequence[Any], sources: tuple) -> SFTExample:
    """The conversation with each image's pad token repeated once per merged patch of the image, as the processor
    expands it (those tokens are not trained)."""
    pad_id = processor.image_token_id
    check_image_places(example.input_ids.count(pad_id), len(images),
                       getattr(processor, "image_token", None) or "<|image_pad|>")
    counts = iter(images_tokens(processor, images))
    input_ids, loss_mask = [], []
    for token, trained in zip(example.input_ids, example.loss_mask, strict=True):
        repeat = next(counts) if token == pad_id else 1
        input_ids += [token] * repeat
        loss_mask += [0 if token == pad_id else trained] * repeat
    return SFTExample(input_ids, loss_mask, list(range(len(input_ids))), sources)


def _tokenized_conversation(row: dict[str, Any], where: str, tokenizer: Any, chat_template: str | None,
                            messages_key: str, processor: Any, images: list, sources: tuple) -> SFTExample:
    messages, num_prompt_messages = _conversation_of(row, messages_key, where, content_parts=processor is not None)
    tools = row_tools(row, where)
    if processor is not None:
        check_image_count(messages, len(images), where)
        messages = with_image_parts(messages, len(images))
    try:
        example = tokenize_conversation(tokenizer, messages, chat_template, tools, num_prompt_messages)
        if images:
            example = expand_image_tokens(example, processor, images, sources)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    except Exception as error:  # jinja2 TypeError/UndefinedError on odd message content
        raise ValueError(f"{where}: {template_error_message(error, 'this conversation')}") from None
    return example


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "tool": "tool"}
"""ShareGPT's speaker names (``from``) as chat roles; any other name is left as it is, for the message check to name."""


def sharegpt_as_messages(row: dict[str, Any], messages_key: str = "messages") -> dict[str, Any]:
    """A ShareGPT row (``conversations``: a list of ``{"from": "human"|"gpt"|"system", "value": text}``) as a chat row
    (``messages_key``: ``{"role": "user"|"assistant"|"system", "content": text}``), as TRL renames its keys and as
    the tools that train on ShareGPT data name its speakers; any other row as it is."""
    turns = row.get("conversations")
    if row.get(messages_key) is not None or not isinstance(turns, list):
        return row
    if not all(isinstance(turn, dict) and ("from" in turn or "value" in turn) for turn in turns):
        return row
    messages = []
    for turn in turns:
        message = {key: value for key, value in turn.items() if key not in ("from", "value")}
        if "from" in turn:
            message["role"] = SHAREGPT_ROLES.get(turn["from"], turn["from"])
        if "value" in turn:
            message["content"] = turn["value"]
        messages.append(message)
    return {**{key: value for key, value in row.items() if key != "conversations"}, messages_key: messages}


def plain_text_pair(row: dict[str, Any], messages_key: str = "messages",
                    text_key: str = "text") -> tuple[str, str] | None:
    """(prompt, completion) of TRL's standard rows, plain text with no chat messages: a string ``prompt`` and
    ``completion``, or a string ``text_key`` column (language modeling: all of it is the completion); None for other
    rows."""
    if row.get(messages_key) is not None:
        return None
    prompt, completion, text = row.get("prompt"), row.get("completion"), row.get(text_key)
    if isinstance(prompt, str) and isinstance(completion, str):
        return prompt, completion
    if isinstance(text, str) and prompt is None and completion is None:
        return "", text
    return None


def tokenize_text(tokenizer: Any, prompt: str, completion: str) -> SFTExample:
    """Plain text as TRL's SFT tokenizes it, with no chat template: ``prompt + completion`` and the EOS token, with
    the special tokens the tokenizer adds to any text (a BOS); the completion's tokens and the EOS are trained."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{type(tokenizer).__name__} is a slow tokenizer without character offsets; SFT needs a fast "
                         "tokenizer (tokenizer.json)")
    eos = tokenizer.eos_token or ""
    text = prompt + completion + ("" if completion.endswith(eos) else eos)
    encoded = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    input_ids = list(encoded["input_ids"])
    # a token holding any of the completion (one merged across the boundary too: TRL's completion starts where the
    # prompt's own tokens and these part); an added special token (BOS) spans no characters
    loss_mask = [int(end > len(prompt) and end > first) for first, end in encoded["offset_mapping"]]
    loss_mask[0] = 0  # the first token has nothing before it to predict it from
    return SFTExample(input_ids, loss_mask, list(range(len(input_ids))))


def _conversation_of(row: dict[str, Any], key: str, where: str,
                     content_parts: bool = False) -> tuple[list[dict[str, Any]], int]:
    """The row's chat messages and how many of them are its prompt: 0 for a ``key`` (messages) row; TRL's
    conversational prompt/completion row is its prompt's messages, then its completion's (a string completion is one
    assistant message), and only the completion is trained, as TRL's ``completion_only_loss`` trains it."""
    prompt, completion = as_list(row.get("prompt")), as_list(row.get("completion"))
    if row.get(key) is not None or not (isinstance(prompt, list) or isinstance(completion, list)):
        return _checked_messages(row, key, where, content_parts), 0
    if isinstance(completion, str):
        completion = [{"role": "assistant", "content": completion}]
    if not isinstance(prompt, list) or not isinstance(completion, list) or not completion:
        raise ValueError(f"{where} has a 'prompt' of type {type(prompt).__name__} and a 'completion' of type "
                         f"{type(completion).__name__}; a conversational prompt/completion row holds two lists of chat "
                         "messages ([{'role': 'user', 'content': ...}] and [{'role': 'assistant', 'content': ...}])")
    messages = [*prompt, *completion]
    check_chat_messages(messages, where, content_parts)  # roles, content as text (null only beside tool_calls)
    return messages, len(prompt)


def _checked_messages(row: dict[str, Any], key: str, where: str, content_parts: bool = False) -> list[dict[str, Any]]:
    messages = as_list(row.get(key))
    if isinstance(messages, str):  # a CSV or to_json round trip stores the list as its JSON text
        raise ValueError(f"{where} has {key!r} as a string ({messages[:40]!r}), not a list of chat messages; store "
                         "the list itself (json.loads each row's messages before writing the file)")
    if not isinstance(messages, list) or not messages:
        columns = ", ".join(sorted(row)) or "none"
        if row.get("prompt") is not None or row.get("completion") is not None:
            raise ValueError(f"{where} has a 'prompt' of type {type(row.get('prompt')).__name__} and a 'completion' "
                             f"of type {type(row.get('completion')).__name__}; a prompt/completion row holds two "
                             "strings, or two lists of chat messages")
        raise ValueError(f"{where} has no list of chat messages in {key!r} (its columns: {columns}); SFT rows hold "
                         "[{'role': ..., 'content': ...}, ...] (data.messages_key names the column), or plain text "
                         "as a 'prompt' and 'completion' string or a 'text' string (data.text_key names its column)")
    check_chat_messages(messages, where, content_parts)  # roles, content as text (null only beside tool_calls)
    return messages


def pack_examples(examples: Sequence[SFTExample], max_length: int) -> list[SFTExample]:
    """Consecutive conversations concatenated, greedily, into rows of at most ``max_length`` tokens."""
    rows: list[SFTExample] = []
    ids: list[int] = []
    mask: list[int] = []
    positions: list[int] = []
    for example in examples:
        if example.images:
            raise ValueError("data.packing=true cannot pack conversations with images (their multimodal positions "
                             "restart per conversation only unpacked); set data.packing=false")
        if ids and len(ids) + len(example.input_ids) > max_length:
            rows.append(SFTExample(ids, mask, positions))
            ids, mask, positions = [], [], []
        ids, mask, positions = ids + example.input_ids, mask + example.loss_mask, positions + example.position_ids
    if ids:
        rows.append(SFTExample(ids, mask, positions))
    return rows


def example_image_inputs(example: SFTExample, processor: Any) -> dict[str, Tensor]:
    """The pixel values and grids of the example's images, as ``processor`` makes them ({} without images)."""
    return image_inputs(processor, [load_image(source, "an SFT row", number)
                                    for number, source in enumerate(example.images)])


class ImageInputsCache:
    """Each row's processed images (``example_image_inputs``), kept by row index once made while their bytes fit in
    ``max_bytes``; rows past that are processed at every use. The rows and the processor are fixed: a kept entry is
    what processing the row again would give."""

    def __init__(self, processor: Any, max_bytes: int = 1 << 30):
        self.processor = processor
        self.max_bytes = max_bytes
        self.bytes = 0
        self.entries: dict[int, dict[str, Tensor]] = {}

    def get(self, index: int, example: SFTExample) -> dict[str, Tensor]:
        inputs = self.entries.get(index)
        if inputs is None:
            inputs = example_image_inputs(example, self.processor)
            size = sum(value.numel() * value.element_size() for value in inputs.values())
            if self.bytes + size <= self.max_bytes:
                self.entries[index] = inputs
                self.bytes += size
        return inputs


def collate_sft(rows: Sequence[SFTExample], pad_token_id: int, packed: bool = False,
                processor: Any = None, images: Sequence[dict[str, Tensor]] | None = None) -> Batch:
    """Rows as ``[left-padded prompt | right-padded response]``; the prompt ends before the first trained token.

    tensors: prompts (B, P), responses (B, R), input_ids / attention_mask / position_ids (B, P + R),
    loss_mask (B, R) float. non_tensors: ``multi_modal_inputs`` when a row has images (``processor`` makes
    their pixels, or ``images`` gives each row's already made). meta: ``packed``.
    """
    splits = [example.loss_mask.index(1) for example in rows]
    prompt_width = max(splits)
    response_width = max(len(example.input_ids) - split for example, split in zip(rows, splits, strict=True))
    width = prompt_width + response_width
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for row, (example, split) in enumerate(zip(rows, splits, strict=True)):
        start = prompt_width - split
        stop = start + len(example.input_ids)
        input_ids[row, start:stop] = torch.tensor(example.input_ids)
        attention_mask[row, start:stop] = 1
        position_ids[row, start:stop] = torch.tensor(example.position_ids)
        loss_mask[row, start:stop] = torch.tensor(example.loss_mask, dtype=torch.float32)
    non_tensors = {}
    if any(example.images for example in rows):
        non_tensors[MULTI_MODAL_KEY] = list(images) if images is not None else [
            example_image_inputs(example, processor) for example in rows]
    return Batch.from_dict(
        tensors={"prompts": input_ids[:, :prompt_width], "responses": input_ids[:, prompt_width:],
                 "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                 "loss_mask": loss_mask[:, prompt_width:]},
        non_tensors=non_tensors, meta={"packed": packed})


class SFTLoader:
    """Batches of ``batch_size`` rows; a seeded permutation per epoch, resumable from ``state_dict()``.

    Training iterates forever (epoch after epoch, the last batch of an epoch may be smaller);
    ``len()`` is the number of batches per epoch.
    """

    def __init__(self, rows: Sequence[SFTExample], batch_size: int, pad_token_id: int, *, packed: bool = False,
                 shuffle: bool = True, seed: int = 1, processor: Any = None):
        self.rows = list(rows)
        self.processor = processor
        self.images = ImageInputsCache(processor) if processor is not None else None
        """Each row's pixels, made once (the vision SFT would run the image processor at every step)."""
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.packed = packed
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._data_digest: str | None = None
        self._warned_of_changes = False

    def __len__(self) -> int:
        return -(-len(self.rows) // self.batch_size)

    def _digest(self) -> str:
        """A hash of the rows' tokens and loss masks (``data_digest``), made once."""
        if self._data_digest is None:
            self._data_digest = data_digest(ids for row in self.rows for ids in (row.input_ids, row.loss_mask))
        return self._data_digest

    def _order(self, epoch: int) -> np.ndarray:
        return epoch_order(len(self.rows), self.seed, epoch, self.shuffle)

    def next_batch(self) -> Batch:
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order(self.epoch)[self.position * self.batch_size:(self.position + 1) * self.batch_size]
        self.position += 1
        return self._collate([int(index) for index in order])

    def batches_of_one_pass(self) -> list[Batch]:
        """Every row once, in order (for validation)."""
        return [self._collate(list(range(start, min(start + self.batch_size, len(self.rows)))))
                for start in range(0, len(self.rows), self.batch_size)]

    def _collate(self, indices: list[int]) -> Batch:
        rows = [self.rows[index] for index in indices]
        images = None
        if self.images is not None and any(example.images for example in rows):
            images = [self.images.get(index, self.rows[index]) for index in indices]
        return collate_sft(rows, self.pad_token_id, self.packed, self.processor, images)

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch comes from, and the row and batch counts a resume must find again."""
        return {"epoch": self.epoch, "position": self.position, "num_rows": len(self.rows),
                "batch_size": self.batch_size, "data_digest": self._digest()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_resumed_counts(state, "num_rows", len(self.rows),
                             "SFT data had {} rows (conversations, or packed rows)", self.batch_size)
        if not self._warned_of_changes:
            self._warned_of_changes = warn_if_contents_changed(state, self._digest(), f"{len(self.rows)} rows")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
