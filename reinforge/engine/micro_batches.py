"""Forming micro-batches from a token budget.

``balanced_micro_batches`` (the RL workers, whose forwards pack rows without padding; they
iterate ``iter_balanced_micro_batches``, which builds each when it is needed) counts
real tokens only: it takes the fewest micro-batches in which a longest-first spread fits the
budget (``_fewest_bins``: a few counts from the token bound up, then a binary search), the same number on
every data-parallel rank (FSDP runs one collective per layer per forward, so ranks must run
the same number of forwards), and spreads the rows over them longest first so that their
token counts are even. With ``share_prompts`` the rows of one prompt stay together (their
prompt is computed once, ``engine.packing``) and a group costs its prompt once plus its
responses. Each micro-batch carries its packing plan, made here on the CPU. The update does
not depend on the split: losses are normalised by the mini-batch's global counts.

``iter_padded_micro_batches`` (the RL workers' passes over a model that runs padded rows): the same padded cost,
rows taken longest first, each micro-batch carrying its rows as the packed ones do.

``split_by_token_budget`` (the SFT trainer, whose forward sees padded rows): sequences are laid out as ``[left-padded prompt | right-padded response]``. A micro-batch
costs ``rows x (longest prompt + longest response)`` tokens once the padding columns shared
by all its rows are trimmed; we cut micro-batches greedily, in order, so that cost stays
within the budget. Keeping the order makes the result independent of the budget, which is
what lets gradient accumulation give the same update whatever the split.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from reinforge.engine.distributed import all_reduce
from reinforge.engine.packing import attach_plan, prompt_groups
from reinforge.protocol import Batch


def balanced_micro_batches(batch: Batch, max_tokens: int, mask_key: str = "response_mask",
                           share_prompts: bool = False) -> list[Batch]:
    """Micro-batches of at most ``max_tokens`` computed tokens (a longer item goes alone), equal in count on all ranks.

    An item is a row, or with ``share_prompts`` the rows of one prompt (cut into several items
    when they exceed the budget together). A rank with fewer items than micro-batches fills the
    rest with a copy of its first row whose ``mask_key`` is all zeros: it runs the forward and
    backward and adds nothing to the loss.
    """
    return list(iter_balanced_micro_batches(batch, max_tokens, mask_key, share_prompts))


def iter_balanced_micro_batches(batch: Batch, max_tokens: int, mask_key: str = "response_mask",
                                share_prompts: bool = False) -> Iterator[Batch]:
    """``balanced_micro_batches``, each built when the loop asks for it.

    Forwards and backwards are queued on the device without waiting for them, so the host
    builds micro-batch k+1 (its rows and packing plan, most of the CPU work here) while the
    device runs micro-batch k, instead of building them all before the device gets its first.
    The split is decided up front (and agreed over the ranks at the first ``next``).
    """
    items, costs = _items(batch, max_tokens, share_prompts)
    num_micro = _fewest_bins(costs, max_tokens)
    num_micro = int(all_reduce([float(num_micro)], torch.device("cpu"), op="max")[0])
    for item_ids in _longest_first(costs, num_micro):
        rows = sorted(row for item in item_ids for row in items[item])
        if rows:
            piece = trim_padding(batch.index(rows))
            piece.meta["rows"] = rows
        else:
            piece = without_loss_tokens(batch, mask_key)
            piece.meta["rows"] = [-1]
        yield attach_plan(piece, share_prompts)


def _items(batch: Batch, max_tokens: int, share_prompts: bool) -> tuple[list[list[int]], list[int]]:
    """Units of micro-batching and the tokens each puts through the model."""
    attention = batch["attention_mask"]
    lengths = attention.sum(-1).tolist()
    if not share_prompts:
        return [[row] for row in range(len(lengths))], lengths
    prompt_lengths = attention[:, :batch["prompts"].shape[1]].sum(-1).tolist()
    items, costs = [], []
    for rows in prompt_groups(batch):
        prompt = prompt_lengths[rows[0]]
        for positions, cost in split_group(prompt, [lengths[row] - prompt for row in rows], max_tokens):
            items.append([rows[position] for position in positions])
            costs.append(cost)
    return items, costs


def rows_in_batch_order(pieces: list[Batch], outputs: list[Tensor], num_rows: int, width: int) -> Tensor:
    """Per-micro-batch outputs (rows, <= width) put back at their batch rows, right-padded with zeros to width."""
    out = torch.zeros((num_rows, width), dtype=outputs[0].dtype)
    for piece, values in zip(pieces, outputs, strict=True):
        rows = piece.meta["rows"]
        if rows != [-1]:
            out[rows, :values.shape[1]] = values.cpu()
    return out


def _longest_first(lengths: list[int], num_bins: int) -> list[list[int]]:
    """Items longest first, each into the bin with the least load so far (the lowest index on a tie)."""
    heap = [(0, target) for target in range(num_bins)]  # already a heap: (load, bin) in order
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for row in sorted(range(len(lengths)), key=lambda row: -lengths[row]):
        load, target = heapq.heappop(heap)
        bins[target].append(row)
        heapq.heappush(heap, (load + lengths[row], target))
    return bins


def iter_padded_micro_batches(batch: Batch, max_tokens: int, mask_key: str = "response_mask") -> Iterator[Batch]:
    """Micro-batches for forwards over padded rows (a model whose attention does not take packed rows,
    ``engine.forward.runs_padded``): a micro-batch costs ``rows x (longest prompt + longest response)``, padding
    included, so rows are taken longest first and cut greedily where that cost would pass ``max_tokens`` (a row
    longer than the budget alone). Each carries its rows (``meta["rows"]``) and no packing plan; every rank runs as
    many as the rank with the most, the extra ones a row without loss tokens."""
    prompt_lengths, response_lengths = (lengths.tolist() for lengths in sequence_extents(batch))
    longest_first = sorted(range(len(batch)), key=lambda row: -(prompt_lengths[row] + response_lengths[row]))
    # trim_padding keeps one response column of an empty response: it counts
    chunks = _padded_chunks(prompt_lengths, response_lengths, longest_first, max_tokens, min_response=1)
    count = int(all_reduce([float(len(chunks))], torch.device("cpu"), op="max")[0])
    for rows in chunks + [[] for _ in range(count - len(chunks))]:
        if rows:
            piece = trim_padding(batch.index(sorted(rows)))
            piece.meta["rows"] = sorted(rows)
        else:
            piece = trim_padding(without_loss_tokens(batch, mask_key))
            piece.meta["rows"] = [-1]
        yield piece


def without_loss_tokens(batch: Batch, mask_key: str) -> Batch:
    """One row of ``batch`` with its loss tokens masked out: a micro-batch that adds nothing (a rank with fewer
    micro-batches than another runs it, so their collectives pair up)."""
    row = batch.index([0])
    row[mask_key] = torch.zeros_like(row[mask_key])
    return row


def _padded_chunks(prompt_lengths: list[int], response_lengths: list[int], order: Iterable[int], max_tokens: int,
                   min_response: int = 0) -> list[list[int]]:
    """The rows taken in ``order``, cut greedily where ``rows x (longest prompt + longest response)`` would pass
    ``max_tokens`` (a row longer than the budget alone); a response counts at least ``min_response`` columns."""
    chunks: list[list[int]] = []
    current: list[int] = []
    longest_prompt, longest_response = 0, min_response
    for row in order:
        prompt = max(longest_prompt, prompt_lengths[row])
        response = max(longest_response, response_lengths[row])
        if current and (len(current) + 1) * (prompt + response) > max_tokens:
            chunks.append(current)
            current, prompt, response = [], prompt_lengths[row], max(response_lengths[row], min_response)
        current.append(row)
        longest_prompt, longest_response = prompt, response
    if current:
        chunks.append(current)
    return chunks


def micro_batch_loads(costs: list[int], max_tokens: int) -> list[int]:
    """Tokens of each micro-batch that ``iter_balanced_micro_batches`` makes of items costing ``costs`` (one rank).

    The memory planner sizes a micro-batch's activations by the largest of these, which is often well
    under the budget: 64 groups of 4,224 tokens in 64k-token micro-batches make five of 54,912 at most.
    """
    num_bins = _fewest_bins(costs, max_tokens)
    return [sum(costs[item] for item in items) for items in _longest_first(costs, num_bins)]


def split_group(prompt_length: int, response_lengths: list[int], max_tokens: int) -> list[tuple[list[int], int]]:
    """The items one prompt group is cut into with ``share_prompts``: (positions of its responses, tokens).

    An item is the prompt once plus as many of the group's responses as fit the budget (at least
    one); each further item computes the prompt again.
    """
    items: list[tuple[list[int], int]] = []
    positions: list[int] = []
    cost = prompt_length
    for position, response in enumerate(response_lengths):
        if positions and cost + response > max_tokens:
            items.append((positions, cost))
            positions, cost = [], prompt_length
        positions.append(position)
        cost += response
    items.append((positions, cost))
    return items


def _fewest_bins(lengths: list[int], max_tokens: int) -> int:
    """The fewest bins (from the token count's lower bound up) in which longest-first stays within the budget.

    A few counts above the lower bound are tried in turn, then a binary search up to one item per
    bin: with many items of just over half the budget (responses cut at the same length) each needs
    its own bin, and trying every count between would take minutes.
    """
    if not lengths:
        return 1
    limit = max(max_tokens, max(lengths))

    def fits(num_bins: int) -> bool:
        return max(sum(lengths[row] for row in rows) for rows in _longest_first(lengths, num_bins)) <= limit

    low, high = max(1, -(-sum(lengths) // max_tokens)), len(lengths)
    for num_bins in range(low, min(low + 4, high)):
        if fits(num_bins):
            return num_bins
    low = min(low + 4, high)
    while low < high:  # fits(high) holds: one item per bin
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return high


def sequence_extents(batch: Batch) -> tuple[Tensor, Tensor]:
    """(prompt lengths, response lengths) per row, from the attention and response masks."""
    prompt_length = batch["prompts"].shape[1]
    prompt_lengths = batch["attention_mask"][:, :prompt_length].sum(-1)
    response_lengths = batch["attention_mask"][:, prompt_length:].sum(-1)
    return prompt_lengths, response_lengths


def split_by_token_budget(batch: Batch, max_tokens: int) -> list[Batch]:
    """Consecutive micro-batches whose padded token count stays within ``max_tokens``."""
    prompt_lengths, response_lengths = (lengths.tolist() for lengths in sequence_extents(batch))
    return [trim_padding(batch.index(slice(rows[0], rows[-1] + 1)))
            for rows in _padded_chunks(prompt_lengths, response_lengths, range(len(batch)), max_tokens)]


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
