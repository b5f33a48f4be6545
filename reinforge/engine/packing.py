"""Padding-free rows: the real tokens of a micro-batch's sequences packed into one row.

A micro-batch arrives in the rollout layout, ``[left-padded prompt | right-padded response]``
(B, P + R). ``pack_rows`` keeps only the attended tokens, one sequence after another, with
position ids restarting at 0 for each, and records which packed positions predict a response
token: the hidden state before response token t of row b. Results computed at those
positions (log-probs, entropy, values) go back to (B, R) with ``unpack_responses``, zeros at
padding, so the losses of ``reinforge.algorithms`` see the layout they always see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from reinforge.protocol import Batch


@dataclass
class PackedRows:
    input_ids: Tensor
    """(1, tokens): every attended token of every sequence, in row order."""
    position_ids: Tensor
    """(1, tokens): 0, 1, ... within each sequence."""
    cu_seqlens: Tensor
    """(sequences + 1,) int32: where each sequence starts in the row, then the total."""
    lengths: list[int]
    max_length: int
    predictor_index: Tensor
    """(response tokens,): packed position whose hidden state predicts each response token."""
    response_targets: Tensor
    """(response tokens,): the response token ids themselves."""
    response_valid: Tensor
    """(B, R) bool: which response slots are real tokens."""

    def attention_kwargs(self) -> dict:
        """Keyword arguments of an HF forward that route attention through the varlen path."""
        return {"packed_cu_seqlens": self.cu_seqlens, "packed_max_length": self.max_length,
                "packed_lengths": self.lengths}

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def pack_rows(micro: Batch) -> PackedRows:
    """Pack the attended tokens of ``micro`` (on any device) into one row."""
    attention = micro["attention_mask"].bool()
    input_ids = micro["input_ids"]
    response_width = micro["responses"].shape[1]
    lengths_tensor = attention.sum(-1)
    lengths = lengths_tensor.tolist()
    if min(lengths) < 1:
        raise ValueError("a row of the micro-batch has no attended token; every sample needs a prompt")
    packed_index = (attention.flatten().cumsum(0) - 1).view_as(attention)
    positions = (torch.cumsum(attention.long(), dim=-1) - 1)[attention]
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = torch.cumsum(lengths_tensor, 0)
    response_valid = attention[:, -response_width:]
    # The token before a response token is in the same sequence: every row has at least one prompt token.
    predictor_index = (packed_index[:, -response_width:] - 1)[response_valid]
    return PackedRows(input_ids=input_ids[attention].unsqueeze(0), position_ids=positions.unsqueeze(0),
                      cu_seqlens=cu_seqlens, lengths=lengths, max_length=max(lengths),
                      predictor_index=predictor_index, response_targets=micro["responses"][response_valid],
                      response_valid=response_valid)


def unpack_responses(values: Tensor, packed: PackedRows) -> Tensor:
    """(response tokens,) -> (B, R) with zeros at padding."""
    out = values.new_zeros(packed.response_valid.shape)
    out[packed.response_valid] = values
    return out
