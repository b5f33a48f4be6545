"""Forming micro-batches from a token budget, and trimming padding inside each.

Sequences are laid out as ``[left-padded prompt | right-padded response]``. A micro-batch
costs ``rows x (longest prompt + longest response)`` tokens once the padding columns shared
by all its rows are trimmed; we cut micro-batches greedily, in order, so that cost stays
within the budget. Keeping the order makes the result independent of the budget, which is
what lets gradient accumulation give the same update whatever the split.
"""

from __future__ import annotations

from torch import Tensor

from reinforge.protocol import Batch


def sequence_extents(batch: Batch) -> tuple[Tensor, Tensor]:
    """(prompt lengths, response lengths) per row, from the attention and response masks."""
    prompt_length = batch["prompts"].shape[1]
    prompt_lengths = batch["attention_mask"][:, :prompt_length].sum(-1)
    response_lengths = batch["attention_mask"][:, prompt_length:].sum(-1)
    return prompt_lengths, response_lengths


def split_by_token_budget(batch: Batch, max_tokens: int) -> list[Batch]:
    """Consecutive micro-batches whose padded token count stays within ``max_tokens``."""
    prompt_lengths, response_lengths = sequence_extents(batch)
    chunks: list[Batch] = []
    start, longest_prompt, longest_response = 0, 0, 0
    for row in range(len(batch)):
        prompt, response = int(prompt_lengths[row]), int(response_lengths[row])
        new_prompt, new_response = max(longest_prompt, prompt), max(longest_response, response)
        rows = row - start + 1
        if rows > 1 and rows * (new_prompt + new_response) > max_tokens:
            chunks.append(trim_padding(batch.index(slice(start, row))))
            start, new_prompt, new_response = row, prompt, response
        longest_prompt, longest_response = new_prompt, new_response
    chunks.append(trim_padding(batch.index(slice(start, len(batch)))))
    return chunks


def trim_padding(batch: Batch) -> Batch:
    """Drop prompt columns that are padding in every row and response columns past the longest response."""
    prompt_lengths, response_lengths = sequence_extents(batch)
    prompt_length = batch["prompts"].shape[1]
    keep_prompt = max(int(prompt_lengths.max()), 1)
    keep_response = max(int(response_lengths.max()), 1)
    start = prompt_length - keep_prompt
    stop = prompt_length + keep_response
    trimmed = Batch(dict(batch.tensors), dict(batch.non_tensors), dict(batch.meta))
    for key, value in batch.tensors.items():
        if key in ("input_ids", "attention_mask", "position_ids"):
            trimmed.tensors[key] = value[:, start:stop]
        elif key == "prompts":
            trimmed.tensors[key] = value[:, start:]
        elif value.dim() == 2 and value.shape[1] == batch["responses"].shape[1]:
            trimmed.tensors[key] = value[:, :keep_response]
    return trimmed
