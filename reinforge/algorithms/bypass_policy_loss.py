"""Bypass mode's policy loss: the rollout policy is the old policy, and the correction runs in the loss.

With ``rollout_correction.bypass_mode`` the trainer skips recomputing old log-probs and takes
the rollout engine's instead. As in verl 0.9.1, the importance weights and rejection mask are
then computed inside the loss from the *current* log-probs against the rollout's (detached),
and ``loss_type`` picks the objective:

- ``ppo_clip``: PPO's clipped surrogate (``vanilla``) on r = pi / pi_rollout over the kept
  tokens; the clip already bounds the correction, so no weights are applied.
- ``reinforce``: loss = -w A log pi over the kept tokens, w the rollout_is weights (1 when
  rollout_is is null); log pi is not a ratio, so nothing is bounded to +-20 but the weights.

Rejected tokens leave the loss but, with a ``LossNormalizer``, still count in its denominator
(verl's global token counts are also taken before the rejection). Batch normalisation of the
weights here averages over the micro-batch, so with it the loss depends on the split.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from reinforge.algorithms.aggregation import LossNormalizer, aggregate_loss
from reinforge.algorithms.masked import masked_mean
from reinforge.algorithms.policy_losses import compute_policy_loss
from reinforge.algorithms.rollout_correction import compute_rollout_correction

if TYPE_CHECKING:
    from reinforge.config.schema import PolicyLossConfig, RolloutCorrectionConfig

BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


def compute_bypass_policy_loss(
    *,
    log_probs: Tensor,
    rollout_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    config: PolicyLossConfig,
    correction: RolloutCorrectionConfig,
    normalizer: LossNormalizer | None = None,
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """Scalar loss and metrics (pg_clipfrac, pg_clipfrac_lower, ppo_kl and rollout_corr/*).

    All tensors (batch, response_len).
    """
    if correction.loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"algorithm.rollout_correction.loss_type={correction.loss_type!r} is unknown; "
                         f"use {' or '.join(BYPASS_LOSS_TYPES)}")
    with torch.no_grad():
        weights, keep_mask, metrics = compute_rollout_correction(
            log_probs.detach(), rollout_log_probs, response_mask, correction)
    if correction.loss_type == "ppo_clip":
        loss, pg_metrics = compute_policy_loss(
            "vanilla", old_log_probs=rollout_log_probs, log_probs=log_probs, advantages=advantages,
            response_mask=keep_mask, loss_agg_mode=loss_agg_mode, config=config, normalizer=normalizer)
        return loss, {**pg_metrics, **metrics}
    loss_matrix = -advantages * log_probs
    if weights is not None:
        loss_matrix = loss_matrix * weights
    loss = aggregate_loss(loss_matrix, keep_mask, loss_agg_mode, normalizer)
    zero = log_probs.new_zeros(())
    pg_metrics = {
        "pg_clipfrac": zero,
        "pg_clipfrac_lower": zero,
        "ppo_kl": masked_mean((rollout_log_probs - log_probs).detach(), keep_mask),
    }
    return loss, {**pg_metrics, **metrics}
