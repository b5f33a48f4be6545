"""Loss aggregation: turn a (batch, response_len) matrix of per-token losses into a scalar.

Modes (mask M, per-token loss L, n_i valid tokens of row i):

- ``token-mean``: sum(L*M) / num_tokens (DAPO; verl's default)
- ``token-sum``: sum(L*M)
- ``seq-mean-token-sum``: sum_i sum_t L*M / num_sequences
- ``seq-mean-token-mean``: sum_i (sum_t L*M / n_i) / num_sequences (the GRPO paper)
- ``seq-mean-token-sum-norm``: sum_i sum_t L*M / max_response_length / num_sequences (Dr. GRPO; a
  constant of the run's choosing in place of max_response_length: ``actor.loss_scale_factor``)

num_sequences counts rows with at least one valid token. A ``LossNormalizer`` supplies the
counts of the whole mini-batch (all micro-batches, all data-parallel ranks); then the sum of
the micro-batch losses equals the mini-batch loss in every mode, so micro-batching and
sharding never change the gradient. The trainer must therefore SUM gradients over
micro-batches and ranks (multiply by the world size before an all-reduce that averages).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


@dataclass(frozen=True)
class LossNormalizer:
    """Global counts of the whole mini-batch, across micro-batches and data-parallel ranks.

    A None field falls back to the local count of the tensor being aggregated.
    """

    num_tokens: float | None = None
    """Valid tokens (sum of the response mask)."""
    num_sequences: float | None = None
    """Rows with at least one valid token."""
    max_response_length: float | None = None
    """The constant length of seq-mean-token-sum-norm; defaults to the mask's last dim."""

    @classmethod
    def from_mask(cls, response_mask: Tensor) -> LossNormalizer:
        """Counts of one (batch, response_len) mask; sum them over micro-batches and ranks."""
        valid_mask = response_mask.bool()
        return cls(
            num_tokens=float(valid_mask.sum().item()),
            num_sequences=float(valid_mask.any(dim=-1).sum().item()),
            max_response_length=int(response_mask.shape[-1]),
        )

    @classmethod
    def of_counts(cls, counts: object, loss_scale_factor: float | None = None) -> LossNormalizer:
        """The normaliser of a mini-batch's counts (an object with this class's fields, as the engine's
        ``MiniBatchCounts``); ``loss_scale_factor``, where given, is seq-mean-token-sum-norm's constant in place of
        the response length."""
        normalizer = cls(**vars(counts))
        if loss_scale_factor is not None:
            normalizer = replace(normalizer, max_response_length=loss_scale_factor)
        return normalizer


def aggregate_loss(loss_matrix: Tensor, mask: Tensor, mode: str, normalizer: LossNormalizer | None = None) -> Tensor:
    """Reduce a (batch, response_len) loss matrix to a scalar with one of LOSS_AGG_MODES.

    Masked positions never contribute, even if they hold inf or nan.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; use one of {', '.join(LOSS_AGG_MODES)}")
    normalizer = normalizer or LossNormalizer()
    valid_mask = mask.bool()
    weights = mask.to(loss_matrix.dtype)
    masked_loss = torch.where(valid_mask, loss_matrix * weights, torch.zeros_like(loss_matrix))

    if mode == "token-sum":
        return masked_loss.sum()
    if mode == "token-mean":
        num_tokens = normalizer.num_tokens if normalizer.num_tokens is not None else weights.sum()
        return masked_loss.sum() / _at_least_one(num_tokens, masked_loss)

    if normalizer.num_sequences is not None:
        num_sequences = normalizer.num_sequences
    else:
        num_sequences = valid_mask.any(dim=-1).sum()
    sequence_losses = masked_loss.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        sequence_losses = sequence_losses / weights.sum(dim=-1).clamp_min(1e-8)
    elif mode == "seq-mean-token-sum-norm":
        max_response_length = normalizer.max_response_length or mask.shape[-1]
        sequence_losses = sequence_losses / max_response_length
    return sequence_losses.sum() / _at_least_one(num_sequences, masked_loss)


def _at_least_one(count: float | Tensor, like: Tensor) -> Tensor:
    """A count as a tensor, floored at 1 so that an all-masked batch gives a loss of 0."""
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp_min(1)
