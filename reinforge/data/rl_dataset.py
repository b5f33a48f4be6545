"""The RL prompt dataset: rows in verl's schema, tokenized once, overlong prompts filtered.

A row holds ``data_source`` (which picks the reward scorer), ``prompt`` (chat messages or a
string; ``data.prompt_key`` names the column), ``ability``, ``reward_model`` (a dict with
``ground_truth`` and maybe ``style``), ``extra_info`` (a dict; ``extra_info.tools_kwargs`` gives
per-row tool arguments) and, optionally, ``agent_name`` (the agent loop that answers the row,
``single_turn`` when absent; see ``reinforge.agent``). Any other column is kept in ``columns``
and reaches the reward function by keyword (TRL's way of passing a dataset's answers). Rows
come from parquet, JSONL or ``datasets`` folders (see ``files.py``).

Rows may carry images (an ``images`` column and ``<image>`` placeholders, or TRL's image content parts; see
``multimodal.py``) when the dataset is given the model's processor: their prompt ids then come from the
processor, with each image's vision tokens, and the images are opened and counted at load.

Every chat-message prompt is rendered with the chat template (with the tool schemas, for rows that
name an agent loop, when tools are given), a string prompt is tokenized as it is unless
``data.apply_chat_template`` is true (TRL's rule), when the dataset is built, so
that overlong prompts can be dropped (and counted) before training starts rather than
discovered in the middle of a step. A malformed row raises one line naming the file, the row
(0-based) and the fix.
"""

from __future__ import annotations

import bisect
import json
import logging
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reinforge.config.schema import DataConfig
from reinforge.data.chat_template import encode_prompt, template_error_message
from reinforge.data.files import Row, as_list, expand_data_files, read_rows
from reinforge.data.multimodal import (
    check_image_count,
    encode_multimodal_prompt,
    image_inputs,
    images_refused,
    load_image,
    load_images,
    row_images,
)

logger = logging.getLogger(__name__)

SCHEMA_COLUMNS = ("data_source", "ability", "reward_model", "extra_info", "agent_name")
"""verl's columns beside the prompt; any other column of a row is kept in ``PromptExample.columns``."""


@dataclass(frozen=True)
class PromptExample:
    index: int
    """Row number across the dataset's files in order, before filtering (stable across runs)."""
    prompt_ids: list[int]
    raw_prompt: list[dict[str, Any]] | str
    data_source: str | None
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)
    ability: str | None = None
    columns: dict[str, Any] = field(default_factory=dict)
    """The row's columns beside the verl schema's (prompt, data_source, ability, reward_model, extra_info)
    and agent_name."""
    agent_name: str | None = None
    """The agent loop of the row (None: single_turn)."""
    images: tuple[Any, ...] = ()
    """The row's images as the file gives them (bytes, paths, ...; opened again when a batch is collated)."""


class RLDataset:
    """Tokenized prompts of one split, in file order.

    ``num_filtered`` counts prompts dropped for being longer than ``max_prompt_length``;
    ``num_rows_read`` counts the rows looked at (all of them unless ``max_samples`` stopped early).
    """

    def __init__(self, files: Sequence[str | Path] | str | Path, tokenizer: Any, config: DataConfig,
                 max_samples: int | None = None, name: str = "train",
                 tool_schemas: list[dict[str, Any]] | None = None, processor: Any = None,
                 why_no_images: str | None = None) -> None:
        files = [files] if isinstance(files, str | Path) else list(files)
        if not files:
            raise ValueError(f"no {name} files given; set data.{name}_files to parquet, JSONL or datasets folders")
        files = expand_data_files(files, f"data.{name}_files")
        self.name = name
        self.examples: list[PromptExample] = []
        self.num_filtered = 0
        self.num_rows_read = 0
        self._file_starts: list[tuple[int, str]] = []
        """(index of the file's first row, file) for each file read, in order."""
        self.tool_schemas = tool_schemas
        self.processor = processor
        """A vision-language model's processor (None: no images; a row with images is refused)."""
        self.why_no_images = why_no_images
        """Without a processor, why the model takes no images and the fix (``models.vision.why_no_images``;
        None: a text-only model)."""
        self._build(files, tokenizer, config, max_samples)

    @classmethod
    def from_config(cls, config: DataConfig, tokenizer: Any, split: str = "train",
                    tool_schemas: list[dict[str, Any]] | None = None, processor: Any = None,
                    why_no_images: str | None = None) -> RLDataset:
        """The train split (``data.train_files``) or the validation split (``data.val_files``)."""
        if split == "train":
            return cls(config.train_files, tokenizer, config, config.max_train_samples, name="train",
                       tool_schemas=tool_schemas, processor=processor, why_no_images=why_no_images)
        if split == "val":
            return cls(config.val_files, tokenizer, config, config.max_val_samples, name="val",
                       tool_schemas=tool_schemas, processor=processor, why_no_images=why_no_images)
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'val'")

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, position: int) -> PromptExample:
        return self.examples[position]

    def image_inputs(self, example: PromptExample) -> dict[str, Any]:
        """The example's pixel values and image grids, from its images as the processor makes them ({} for none)."""
        if not example.images:
            return {}
        where = self.where(example)
        return image_inputs(self.processor, [load_image(source, where, number)
                                             for number, source in enumerate(example.images)])

    def _build(self, files: list[str | Path], tokenizer: Any, config: DataConfig, max_samples: int | None) -> None:
        first_index = 0
        for path in files:
            rows = read_rows(path)
            self._file_starts.append((first_index, str(path)))
            for row_number, row in enumerate(rows):
                self.num_rows_read += 1
                fields = _encode_row(row, f"row {row_number} of {path}", tokenizer, config, self.tool_schemas,
                                     self.processor, self.why_no_images)
                if fields is None:
                    self.num_filtered += 1
                    continue
                self.examples.append(PromptExample(index=first_index + row_number, **fields))
                if max_samples is not None and len(self.examples) == max_samples:
                    self.report(config)
                    return
            first_index += len(rows)
        self.report(config)

    def where(self, example: PromptExample) -> str:
        """Where ``example`` came from, for messages: 'row 3 of data/train.parquet'."""
        position = bisect.bisect_right([start for start, _ in self._file_starts], example.index) - 1
        first_index, path = self._file_starts[position]
        return f"row {example.index - first_index} of {path}"

    def report(self, config: DataConfig) -> None:
        """Log how many prompts were kept and filtered under ``config``'s limit; raise one line when none is left."""
        if self.num_rows_read == 0:
            listed = ", ".join(path for _, path in self._file_starts)
            raise ValueError(f"the {self.name} files ({listed}) hold no rows; check data.{self.name}_files")
        if not self.examples:
            raise ValueError(f"no {self.name} prompt is left: all {self.num_rows_read} are longer than "
                             f"data.max_prompt_length={config.max_prompt_length} tokens; raise max_prompt_length")
        logger.info("%s data: %d prompts from %d rows; %d filtered for being longer than "
                    "data.max_prompt_length=%d tokens", self.name, len(self.examples), self.num_rows_read,
                    self.num_filtered, config.max_prompt_length)


def _checked_prompt(row: Row, prompt_key: str, where: str, content_parts: bool = False) -> list[dict[str, Any]] | str:
    if prompt_key not in row or row[prompt_key] is None:
        columns = ", ".join(sorted(row)) or "none"
        raise ValueError(f"{where} has no {prompt_key!r}; each row needs its prompt as a list of chat messages or "
                         f"a string (data.prompt_key names the column; this row has: {columns})")
    prompt = as_list(row[prompt_key])
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where} has an empty {prompt_key!r} string; give the prompt's text (or chat messages)")
        if _is_messages_json(prompt):
            raise ValueError(f"{where} has a {prompt_key!r} that is chat messages written as JSON text, which the "
                             "model would read as it is; store the list itself (json.loads each prompt before "
                             "writing the file)")
        return prompt
    if isinstance(prompt, list) and not prompt:
        raise ValueError(f"{where} has an empty {prompt_key!r}; give at least one chat message or a string")
    if not isinstance(prompt, list):
        raise ValueError(f"{where} has a {prompt_key!r} of type {type(prompt).__name__}; expected a list of "
                         "{'role': ..., 'content': ...} messages or a string")
    check_chat_messages(prompt, f"the {prompt_key!r} in {where}", content_parts=content_parts)
    return prompt


def _is_messages_json(text: str) -> bool:
    """Whether ``text`` is a JSON list of chat messages (a CSV or a to_json round trip stores a prompt so)."""
    if not text.lstrip().startswith("[{"):
        return False
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, list) and bool(value) and all(
        isinstance(message, dict) and "role" in message and "content" in message for message in value)


KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
"""The roles a chat message may have. Any other (``usr``, ``Assistant``, ShareGPT's ``gpt``) is a typo or another
format's name, which a template renders as an odd header (or drops), and which SFT would leave untrained."""


def check_chat_messages(messages: list[Any], where: str, content_parts: bool = False) -> None:
    """Raise one line naming the message, ``where`` it is and the fix, unless every message can be rendered as text.

    RL prompts and SFT conversations share this check, so that both refuse what a chat template would render
    wrongly without an error: a role outside ``KNOWN_ROLES`` (an odd header), ``content`` that is not a string (a
    list of parts or a number is printed as its Python repr, which the model would read or learn to write; reinforge
    trains text-only models) and ``content: null`` (rendered as "None" or nothing), which only an assistant turn
    with ``tool_calls`` may have: its content is the calls. With ``content_parts`` (a vision-language model's
    data) a content may also be a list of ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` parts.
    """
    if len(messages) and all(isinstance(item, numbers.Integral) and not isinstance(item, bool) for item in messages):
        raise ValueError(f"{where} is a list of {len(messages)} token ids; reinforge reads text or chat messages and "
                         "tokenizes them with the model's tokenizer itself: give the text column instead of the ids")
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(f"message {number} of {where} is {message!r}; each message is a dict with a 'role' "
                             "string and a 'content'")
        role, content = message["role"], message["content"]
        if role not in KNOWN_ROLES:
            raise ValueError(f"message {number} of {where} has role {role!r}, which is not one of "
                             f"{', '.join(KNOWN_ROLES)}; rename it (a chat template renders another role as an odd "
                             "header, or not at all)")
        if content is None and not message.get("tool_calls"):
            raise ValueError(f"message {number} ({role}) of {where} has content null and no tool_calls; give it a "
                             "string ('' for an empty message) or drop the message")
        if content_parts and isinstance(content, list) and all(_known_part(part) for part in content):
            continue
        if content is not None and not isinstance(content, str):
            raise ValueError(f"message {number} ({role}) of {where} has a 'content' of type {type(content).__name__}; "
                             "reinforge trains text-only models: give it as a string (join the text of a list of "
                             "parts)")


def _known_part(part: Any) -> bool:
    """A text part with its text, or an image part (its image is the next of the row's images: see
    ``multimodal.row_images``)."""
    if not isinstance(part, dict):
        return False
    if part.get("type") == "text" or (part.get("type") is None and "text" in part):
        return isinstance(part.get("text"), str)
    return part.get("type") in ("image", "image_url") or (part.get("type") is None and "image" in part)


def _checked_dict(row: Row, key: str, where: str) -> dict[str, Any]:
    value = row.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where} has a {key!r} of type {type(value).__name__}; expected a dict (or no {key!r})")
    return value


def _checked_optional_str(row: Row, key: str, where: str) -> str | None:
    value = row.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where} has a {key!r} of type {type(value).__name__}; expected a string")
    return value


def _encode_row(row: Row, where: str, tokenizer: Any, config: DataConfig,
                tool_schemas: list[dict[str, Any]] | None = None, processor: Any = None,
                why_no_images: str | None = None) -> dict[str, Any] | None:
    """The PromptExample fields of one row (all but ``index``), or None when it is filtered as overlong."""
    row, sources, column = row_images(row, (config.prompt_key,), config.image_key, where)
    images = load_images(sources, f"{where}, column {column!r}")
    if images and processor is None:
        raise images_refused(where, len(images), column, why_no_images)
    prompt = _checked_prompt(row, config.prompt_key, where, content_parts=processor is not None)
    if processor is not None:
        check_image_count(prompt, len(images), where)
    agent_name = _checked_optional_str(row, "agent_name", where)
    tools = tool_schemas if agent_name not in (None, "", "single_turn") else None
    templated = config.apply_chat_template
    if templated is None:  # TRL's rule: messages get the template, a string is the model's input as it is
        templated = not isinstance(prompt, str) or tools is not None
    try:
        if processor is not None and (templated or images):  # the processor's ids, with each image's vision tokens
            prompt_ids = encode_multimodal_prompt(processor, prompt, images, config.chat_template, tools, templated)
        else:
            prompt_ids = encode_prompt(tokenizer, prompt, templated, config.chat_template, tools)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    except Exception as error:  # the template's own error (jinja2 TypeError/UndefinedError) on odd message content
        raise ValueError(f"{where}: {template_error_message(error, 'this prompt')}") from None
    if images and config.max_image_tokens is not None:
        image_tokens = prompt_ids.count(processor.image_token_id)
        if image_tokens > config.max_image_tokens:
            raise ValueError(f"{where} has {image_tokens} image tokens, more than data.max_image_tokens="
                             f"{config.max_image_tokens}, by which the memory plan counts the vision tower's patches; "
                             "raise max_image_tokens (or null: max_prompt_length) or give the row smaller images")
    limit = config.max_prompt_length
    if len(prompt_ids) > limit:
        if config.filter_overlong_prompts:
            return None
        if images:
            raise ValueError(f"{where} has a prompt of {len(prompt_ids)} tokens with its images, more than "
                             f"data.max_prompt_length={limit}, and a prompt with images cannot be cut (its image "
                             "tokens would not match its pixels); raise max_prompt_length or set "
                             "data.filter_overlong_prompts=true")
        if config.truncation == "left":
            prompt_ids = prompt_ids[-limit:]
        elif config.truncation == "right":
            prompt_ids = prompt_ids[:limit]
        else:
            raise ValueError(f"{where} has a prompt of {len(prompt_ids)} tokens, more than "
                             f"data.max_prompt_length={limit}; raise max_prompt_length, set "
                             "data.filter_overlong_prompts=true to drop such prompts, or data.truncation=left|right")
    reward_model = _checked_dict(row, "reward_model", where)
    return {
        "prompt_ids": prompt_ids,
        "raw_prompt": prompt,
        "data_source": _checked_optional_str(row, "data_source", where),
        "ground_truth": reward_model.get("ground_truth"),
        "extra_info": _checked_dict(row, "extra_info", where),
        "ability": _checked_optional_str(row, "ability", where),
        "columns": {key: value for key, value in row.items() if key not in (config.prompt_key, *SCHEMA_COLUMNS)},
        "agent_name": agent_name or None,
        "images": tuple(sources),
    }
