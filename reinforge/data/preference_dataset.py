"""Preference pairs: a prompt with a chosen and a rejected completion, tokenized for ``reinforge rm`` and ``dpo``.

Rows come in TRL's four shapes:

- explicit prompt, plain text: ``{"prompt": str, "chosen": str, "rejected": str}``; the prompt is tokenized as
  the tokenizer encodes any text, with the special tokens it adds (a BOS: Llama's, Gemma's), as TRL, reinforge sft
  and the RL prompts tokenize plain text; each completion gets the tokenizer's EOS token appended (a plain
  completion has no end-of-turn token of its own);
- explicit prompt, conversational: ``prompt`` a list of messages, ``chosen``/``rejected`` the assistant turns
  that follow; the prompt is rendered with the generation prompt, each completion is the rest of the whole
  conversation's rendering; a ``tools`` column (function schemas, as TRL reads it) goes to the chat template;
- implicit prompt, conversational: ``chosen``/``rejected`` whole conversations; their common leading messages
  are the prompt (TRL's ``extract_prompt``). A ``prompt`` column of text beside them (HuggingFaceH4's
  UltraFeedback pairs repeat the user's question there) is left aside for those messages, as TRL's
  ``maybe_extract_prompt`` leaves it;
- implicit prompt, plain text: ``chosen``/``rejected`` whole texts (with the tokenizer's BOS, EOS appended);
  their common leading tokens are the prompt, which ``rm`` may leave empty (two unrelated texts, no BOS) and
  ``dpo`` may not.

The prompt and each completion are tokenized separately, as TRL does. An optional ``margin`` column (a number)
is the margin of the reward model's loss. A pair becomes two rows of the engine's ``[left-padded prompt |
right-padded response]`` layout, chosen then rejected, with the same prompt: the packed forward computes the
prompt once for both (``engine.packing``), so a pair costs its prompt and its two completions.

``check_preference_rows`` reads the files without a tokenizer, so a malformed row is refused in one line naming
the row and the column before any model loads.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reinforge.data.chat_template import apply_chat_template, chat_template_text, row_tools, template_error_message
from reinforge.data.files import expand_data_files, read_rows
from reinforge.data.loader_state import check_resumed_counts, data_digest, warn_if_contents_changed
from reinforge.data.multimodal import image_column, row_image_sources
from reinforge.data.prompt_loader import epoch_order
from reinforge.data.rl_dataset import check_chat_messages
from reinforge.protocol import Batch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreferenceKeys:
    """The columns of a preference row (``data.prompt_key`` ...)."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    margin: str = "margin"


@dataclass(frozen=True)
class PreferencePair:
    prompt_ids: list[int]
    """Shared by both completions; empty only for an implicit plain pair without a common beginning (rm)."""
    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float = 0.0

    @property
    def longest(self) -> int:
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))


def _is_messages(value: Any) -> bool:
    return isinstance(value, list)


def _prompt_of(row: dict[str, Any], keys: PreferenceKeys) -> Any:
    """The row's explicit prompt, or None where the prompt is implicit: no prompt column, or one of text beside
    conversational completions, whose own leading messages are then the prompt (TRL's ``maybe_extract_prompt``)."""
    prompt = row.get(keys.prompt)
    if isinstance(prompt, str) and _is_messages(row.get(keys.chosen)):
        return None
    return prompt


def check_preference_row(row: dict[str, Any], keys: PreferenceKeys, where: str) -> None:
    """One line naming ``where`` and the column, unless the row is one of the four shapes (module docstring)."""
    columns = ", ".join(sorted(row)) or "none"
    for key in (keys.chosen, keys.rejected):
        if key not in row:
            raise ValueError(f"{where} has no {key!r} column (its columns: {columns}); preference rows hold "
                             f"{keys.chosen!r} and {keys.rejected!r} (and optionally {keys.prompt!r}); "
                             "data.chosen_key / data.rejected_key name other columns")
        if not isinstance(row[key], str | list):
            shown = "empty (null)" if row[key] is None else f"{type(row[key]).__name__} {str(row[key])[:40]!r}"
            raise ValueError(f"{where}: {key!r} is {shown}; give the completion as text or as a list of chat "
                             "messages, or drop the row")
    chosen, rejected, prompt = row[keys.chosen], row[keys.rejected], _prompt_of(row, keys)
    conversational = _is_messages(chosen)
    for key, value in ((keys.chosen, chosen), (keys.rejected, rejected), (keys.prompt, prompt)):
        if value is None and key == keys.prompt:
            continue
        if _is_messages(value) != conversational or not isinstance(value, str | list):
            kind = "a list of messages" if conversational else "a string"
            raise ValueError(f"{where}: {key!r} is {type(value).__name__} while {keys.chosen!r} is {kind}; give "
                             "every column as text, or every column as chat messages")
        if _is_messages(value):
            if not value:  # no chat template renders an empty conversation
                raise ValueError(f"{where}: {key!r} is an empty list of messages; give the "
                                 f"{'prompt' if key == keys.prompt else 'completion'}'s turns")
            check_chat_messages(value, f"{key!r} of {where}")
        elif not value and key != keys.prompt:
            raise ValueError(f"{where}: {key!r} is an empty string; give the completion's text")
    if chosen == rejected:
        raise ValueError(f"{where}: {keys.chosen!r} and {keys.rejected!r} are the same, which teaches no "
                         "preference; drop the row")
    if conversational and prompt is None and not _common_length(chosen, rejected):  # implicit: no prompt to take
        if isinstance(row.get(keys.prompt), str):
            raise ValueError(f"{where}: {keys.prompt!r} is text while {keys.chosen!r} and {keys.rejected!r} are chat "
                             "messages that share no leading message; give the prompt as a list of messages "
                             "([{'role': 'user', 'content': ...}]), or start both completions with its turns")
        raise ValueError(f"{where}: {keys.chosen!r} and {keys.rejected!r} share no leading message, so there is no "
                         f"prompt; give a {keys.prompt!r} column of messages or start both with the same messages")
    if conversational:  # the template shows the schemas beside the conversation; text pairs leave them out
        row_tools(row, where)
    images = row_image_sources(row, None, where)
    if images:  # TRL's vision preference rows: text-only training would drop the pictures the pair is about
        raise ValueError(f"{where} has {len(images)} image(s) in its {image_column(row)!r} column; reinforge rm and "
                         "dpo train on text alone and would leave them out: drop that column, or the rows")
    margin = row.get(keys.margin)
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, int | float)
                               or not math.isfinite(margin)):
        raise ValueError(f"{where}: {keys.margin!r} is {margin!r}; give a finite number (or leave the column out)")


def check_preference_rows(files: Sequence[str | Path], keys: PreferenceKeys, split: str,
                          max_samples: int | None = None) -> int:
    """Check every row of ``files`` (no tokenizer needed); returns the number of rows."""
    if not files:
        raise ValueError(f"no {split} files given; set data.{split}_files to parquet or JSONL files of preference "
                         "pairs")
    num_rows = 0
    for path in expand_data_files(files, f"data.{split}_files"):
        if max_samples is not None and num_rows == max_samples:
            break  # the later files are not read
        for row_number, row in enumerate(read_rows(path)):
            if max_samples is not None and num_rows == max_samples:
                return num_rows
            check_preference_row(row, keys, f"row {row_number} of {path}")
            num_rows += 1
    return num_rows


def _render(tokenizer: Any, messages: list[dict[str, Any]], template: str, add_generation_prompt: bool,
            tools: list[dict[str, Any]] | None = None) -> str:
    return apply_chat_template(tokenizer, messages, chat_template=template, tokenize=False,
                               add_generation_prompt=add_generation_prompt, tools=tools or None)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _common_length(first: Sequence[Any], second: Sequence[Any]) -> int:
    length = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        length += 1
    return length


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    """Plain text as the tokenizer encodes any text: with the special tokens it adds (a BOS)."""
    return list(tokenizer(text)["input_ids"])


def _with_eos(tokenizer: Any, text: str) -> str:
    eos = tokenizer.eos_token
    return text + eos if eos and not text.endswith(eos) else text


def tokenize_pair(tokenizer: Any, row: dict[str, Any], keys: PreferenceKeys, template: str | None = None,
                  need_prompt: bool = False) -> PreferencePair:
    """The row's prompt and completions as token ids (the row already passed ``check_preference_row``).

    ``need_prompt`` (DPO): refuse a pair without a prompt (an empty one, or completions that share no beginning),
    whose loss would leave out the first token of each completion, which nothing predicts. A pair whose two
    completions are the same tokens ("x" and "x" with the EOS written out) is refused: it teaches no preference."""
    pair = _tokenized_pair(tokenizer, row, keys, template, need_prompt)
    if pair.chosen_ids == pair.rejected_ids:
        raise ValueError(f"{keys.chosen!r} and {keys.rejected!r} are the same {len(pair.chosen_ids)} token(s) once "
                         "tokenized, which teaches no preference; drop the row")
    return pair


def _tokenized_pair(tokenizer: Any, row: dict[str, Any], keys: PreferenceKeys, template: str | None,
                    need_prompt: bool) -> PreferencePair:
    chosen, rejected, prompt = row[keys.chosen], row[keys.rejected], _prompt_of(row, keys)
    margin = float(row.get(keys.margin) or 0.0)
    if _is_messages(chosen):
        template = chat_template_text(tokenizer, template)
        if not template:
            raise ValueError("the pairs are chat messages and the tokenizer has no chat template; set "
                             "data.chat_template to a Jinja template")
        if prompt is None:  # implicit: the common leading messages
            shared = _common_length(chosen, rejected)
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
            if not prompt:
                raise ValueError(f"{keys.chosen!r} and {keys.rejected!r} share no leading message, so there is no "
                                 f"prompt; give a {keys.prompt!r} column or start both with the same messages")
            if not chosen or not rejected:
                raise ValueError(f"one of {keys.chosen!r} and {keys.rejected!r} is the other's beginning, so it has "
                                 "no completion of its own; drop the row")
        tools = row_tools(row, "the row")  # the schemas the conversation was held with: the template shows them
        prompt_text = _render(tokenizer, prompt, template, add_generation_prompt=True, tools=tools)
        completions = []
        for key, turns in ((keys.chosen, chosen), (keys.rejected, rejected)):
            if turns[0].get("role") != "assistant":
                raise ValueError(f"{key!r} starts with a {turns[0].get('role')!r} message after the prompt; a "
                                 "completion is the assistant's reply: start it with an assistant message (or move "
                                 "the earlier turns into the prompt)")
            whole = _render(tokenizer, [*prompt, *turns], template, add_generation_prompt=False, tools=tools)
            if not whole.startswith(prompt_text):
                raise ValueError(f"the chat template does not render {key!r} as a continuation of the prompt (it "
                                 "rewrites earlier turns); set data.chat_template to a template that renders turns "
                                 "in order")
            completions.append(_ids(tokenizer, whole[len(prompt_text):]))
        return PreferencePair(_ids(tokenizer, prompt_text), completions[0], completions[1], margin)
    if prompt is not None:
        prompt_ids = _text_ids(tokenizer, prompt)
        if need_prompt and not prompt_ids:
            raise ValueError(f"{keys.prompt!r} is an empty string, so there is no prompt for the completions to "
                             "follow; give each row its prompt")
        return PreferencePair(prompt_ids, _ids(tokenizer, _with_eos(tokenizer, chosen)),
                              _ids(tokenizer, _with_eos(tokenizer, rejected)), margin)
    chosen_ids = _text_ids(tokenizer, _with_eos(tokenizer, chosen))
    rejected_ids = _text_ids(tokenizer, _with_eos(tokenizer, rejected))
    shared = min(_common_length(chosen_ids, rejected_ids), len(chosen_ids) - 1, len(rejected_ids) - 1)
    if need_prompt and shared < 1:
        raise ValueError(f"{keys.chosen!r} and {keys.rejected!r} share no beginning, so there is no prompt for "
                         f"the completions to follow; give a {keys.prompt!r} column")
    return PreferencePair(chosen_ids[:shared], chosen_ids[shared:], rejected_ids[shared:], margin)


class PreferenceDataset:
    """Tokenized pairs of one split, in file order; pairs longer than ``max_length`` dropped or refused."""

    def __init__(self, files: Sequence[str | Path], tokenizer: Any, *, max_length: int, truncation: str = "drop",
                 keys: PreferenceKeys = PreferenceKeys(), chat_template: str | None = None,
                 max_samples: int | None = None, need_prompt: bool = False, name: str = "train"):
        check_preference_rows(files, keys, name, max_samples)
        self.name = name
        self.pairs: list[PreferencePair] = []
        self.num_dropped = 0
        num_rows = 0
        for path in expand_data_files(files, f"data.{name}_files"):
            if max_samples is not None and num_rows == max_samples:
                break  # the later files are not read (nor checked)
            for row_number, row in enumerate(read_rows(path)):
                if max_samples is not None and num_rows == max_samples:
                    break
                num_rows += 1
                where = f"row {row_number} of {path}"
                try:
                    pair = tokenize_pair(tokenizer, row, keys, chat_template, need_prompt)
                except ValueError as error:
                    raise ValueError(f"{where}: {error}") from None
                except Exception as error:  # jinja2 errors on odd message content
                    raise ValueError(f"{where}: {template_error_message(error, 'this pair')}") from None
                if pair.longest > max_length:
                    if truncation == "error":
                        raise ValueError(f"{where} has {pair.longest} tokens (prompt and the longer completion), more "
                                         f"than data.max_length={max_length}; raise max_length or set "
                                         "data.truncation=drop")
                    self.num_dropped += 1
                    continue
                self.pairs.append(pair)
        if not self.pairs:
            raise ValueError(f"no {name} pair is left of {num_rows} rows ({self.num_dropped} longer than "
                             f"data.max_length={max_length}); check the files and data.max_length")
        if self.num_dropped:  # rows lost to training: said where it is seen (TRL truncates them instead)
            logger.warning("%s data: %d of %d pairs dropped for being longer than data.max_length=%d tokens (prompt "
                           "and the longer completion); raise data.max_length to keep them, or set "
                           "data.truncation=error to stop on the first", name, self.num_dropped, num_rows, max_length)
        logger.info("%s data: %d pairs from %d rows; %d dropped for being longer than %d tokens", name,
                    len(self.pairs), num_rows, self.num_dropped, max_length)

    def __len__(self) -> int:
        return len(self.pairs)

    def fingerprint(self) -> str:
        """A hash of every pair's token ids: the reference log-probs stored for a run belong to these pairs."""
        return pairs_digest(self.pairs)


def pairs_digest(pairs: Sequence[PreferencePair]) -> str:
    """``data_digest`` of the pairs' prompt, chosen and rejected token ids."""
    return data_digest(ids for pair in pairs for ids in (pair.prompt_ids, pair.chosen_ids, pair.rejected_ids))


def collate_pairs(pairs: Sequence[PreferencePair], pair_indices: Sequence[int], pad_token_id: int) -> Batch:
    """Two rows a pair (chosen at 2i, rejected at 2i + 1) in the ``[left-padded prompt | right-padded response]``
    layout. A pair without a prompt puts each completion's first token in the prompt (it cannot be predicted).

    tensors: prompts (2P, Lp), responses (2P, Lr), input_ids / attention_mask / position_ids (2P, Lp + Lr),
    response_mask (2P, Lr) float, margin (2P,) float, pair_index (2P,) long, pair_weight (2P,) float (1: a real
    pair; a micro-batch that pads the ranks to the same count has 0).
    """
    sequences = []
    for pair in pairs:
        for completion in (pair.chosen_ids, pair.rejected_ids):
            prompt, response = (pair.prompt_ids, completion) if pair.prompt_ids else (completion[:1], completion[1:])
            sequences.append((prompt, response))
    prompt_width = max(len(prompt) for prompt, _ in sequences)
    response_width = max(max(len(response) for _, response in sequences), 1)
    rows = len(sequences)
    # filled in numpy, which copies a list of ids into a row in one call (a step of 64 pairs in a few ms)
    prompt_ids = np.full((rows, prompt_width), pad_token_id, dtype=np.int64)
    response_ids = np.full((rows, response_width), pad_token_id, dtype=np.int64)
    prompt_attended = np.zeros((rows, prompt_width), dtype=np.int64)
    response_attended = np.zeros((rows, response_width), dtype=np.int64)
    for row, (prompt, response) in enumerate(sequences):
        if prompt:
            prompt_ids[row, prompt_width - len(prompt):] = prompt
            prompt_attended[row, prompt_width - len(prompt):] = 1
        if response:
            response_ids[row, :len(response)] = response
            response_attended[row, :len(response)] = 1
    prompts, responses = torch.from_numpy(prompt_ids), torch.from_numpy(response_ids)
    prompt_mask, response_mask = torch.from_numpy(prompt_attended), torch.from_numpy(response_attended)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask
    margins = torch.tensor([pair.margin for pair in pairs], dtype=torch.float32).repeat_interleave(2)
    indices = torch.tensor(list(pair_indices), dtype=torch.long).repeat_interleave(2)
    return Batch.from_dict(tensors={
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask, "position_ids": position_ids, "response_mask": response_mask.float(),
        "margin": margins, "pair_index": indices, "pair_weight": torch.ones(rows)})


class PairLoader:
    """Batches of ``batch_size`` pairs; a seeded permutation per epoch, resumable from ``state_dict()``.

    Training iterates forever (epoch after epoch, the last batch of an epoch may be smaller); ``len()`` is the
    number of batches per epoch.
    """

    def __init__(self, pairs: Sequence[PreferencePair], batch_size: int, pad_token_id: int, *, shuffle: bool = True,
                 seed: int = 1):
        self.pairs = list(pairs)
        self.batch_size, self.pad_token_id, self.shuffle, self.seed = batch_size, pad_token_id, shuffle, seed
        self.epoch = 0
        self.position = 0
        self._peeked: tuple[tuple[int, int], Batch] | None = None
        """(epoch, position) and the batch ``peek_batch`` built for them."""
        self._data_digest: str | None = None
        self._warned_of_changes = False

    def __len__(self) -> int:
        return -(-len(self.pairs) // self.batch_size)

    def _digest(self) -> str:
        if self._data_digest is None:
            self._data_digest = pairs_digest(self.pairs)
        return self._data_digest

    def _batch(self, indices: Sequence[int]) -> Batch:
        return collate_pairs([self.pairs[index] for index in indices], indices, self.pad_token_id)

    def _upcoming(self) -> tuple[int, int]:
        """(epoch, position) of the batch ``next_batch`` returns next."""
        return (self.epoch + 1, 0) if self.position >= len(self) else (self.epoch, self.position)

    def _batch_at(self, epoch: int, position: int) -> Batch:
        if self._peeked is not None and self._peeked[0] == (epoch, position):
            return self._peeked[1]
        order = epoch_order(len(self.pairs), self.seed, epoch, self.shuffle)
        return self._batch(order[position * self.batch_size:(position + 1) * self.batch_size].tolist())

    def next_batch(self) -> Batch:
        self.epoch, position = self._upcoming()
        batch = self._batch_at(self.epoch, position)
        self.position, self._peeked = position + 1, None
        return batch

    def peek_batch(self) -> Batch:
        """The batch ``next_batch`` returns next (the same object), built now; the loader does not advance."""
        upcoming = self._upcoming()
        self._peeked = (upcoming, self._batch_at(*upcoming))
        return self._peeked[1]

    def batches_of_one_pass(self) -> list[Batch]:
        """Every pair once, in order (validation, the reference pass)."""
        return [self._batch(list(range(start, min(start + self.batch_size, len(self.pairs)))))
                for start in range(0, len(self.pairs), self.batch_size)]

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch comes from, and the pair and batch counts a resume must find again."""
        return {"epoch": self.epoch, "position": self.position, "num_pairs": len(self.pairs),
                "batch_size": self.batch_size, "data_digest": self._digest()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_resumed_counts(state, "num_pairs", len(self.pairs), "data had {} pairs", self.batch_size)
        if not self._warned_of_changes:
            self._warned_of_changes = warn_if_contents_changed(state, self._digest(), f"{len(self.pairs)} pairs")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._peeked = None
