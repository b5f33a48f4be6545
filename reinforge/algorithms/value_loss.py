"""The PPO critic loss: squared error of the value prediction, clipped around the rollout values.

loss = 1/2 * agg(max((V - R)**2, (clip(V, V_old - c, V_old + c) - R)**2)), as in verl; the
clip fraction counts tokens where the clipped error was the larger one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from reinforge.algorithms.aggregation import LossNormalizer, aggregate_loss
from reinforge.algorithms.masked import masked_mean


def compute_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str,
    normalizer: LossNormalizer | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss and the clip fraction (a detached scalar).

    values: the critic's new predictions; old_values: those at rollout time; returns: targets.
    All (batch, response_len).
    """
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_losses = (values - returns).square()
    clipped_losses = (clipped_values - returns).square()
    loss_matrix = torch.maximum(unclipped_losses, clipped_losses)
    loss = 0.5 * aggregate_loss(loss_matrix, response_mask, loss_agg_mode, normalizer)
    clipfrac = masked_mean((clipped_losses > unclipped_losses).float(), response_mask).detach()
    return loss, clipfrac
