"""Sequence-level policy losses: GSPO and GMPO (geo_mean) judge a response by its geometric-mean ratio.

As in verl, neither bounds the token log-ratios to +-20 (see ``policy_losses``): a token far
from the old policy keeps its large gradient. GSPO bounds the log of its sequence ratio above
at 10, as verl does; geo_mean's exp is guarded against overflow only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from reinforge.algorithms.aggregation import aggregate_loss
from reinforge.algorithms.masked import masked_mean
from reinforge.algorithms.policy_losses import (
    clip_bounds,
    common_metrics,
    overflow_safe_exp,
    reduce_losses,
    register_policy_loss,
)

IMPORTANCE_WEIGHT_FLOOR = 1e-10
"""Added to a weight before its log in geo_mean: a zero weight (rejected or IcePop) stays finite."""


@register_policy_loss("gspo")
def compute_gspo_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: PPO clip on the sequence's geometric-mean ratio s_i = exp(mean_t log r_t).

    Token t uses s_it = sg(s_i) * pi(t) / sg(pi(t)): its value is s_i, its gradient
    sg(s_i) * grad log pi(t), so each token keeps its own direction. The log of s_it is
    clamped at 10 (no gradient beyond). Use loss_agg_mode=seq-mean-token-mean for the paper's
    objective. pg_clipfrac_lower is 0, as in verl.
    """
    low, high = clip_bounds(config)
    valid = response_mask.bool()
    log_ratio = torch.where(valid, log_probs - old_log_probs, torch.zeros_like(log_probs))
    lengths = valid.sum(dim=-1).clamp_min(1).to(log_ratio.dtype)
    sequence_log_ratio = log_ratio.sum(dim=-1) / lengths
    # Adding the detached sequence term last keeps its precision (verl PR 2775).
    token_log_ratio = log_probs - log_probs.detach() + sequence_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    loss_matrix = torch.maximum(unclipped, clipped)

    clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    loss = reduce_losses(loss_matrix, response_mask, loss_agg_mode, importance_weights, normalizer)
    return loss, common_metrics(log_probs, old_log_probs, response_mask, clipfrac)


@register_policy_loss("geo_mean")
def compute_geo_mean_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO: loss_i = -mean_t(A) * exp(mean_t clipped log r_t), one value per sequence.

    The log-ratio is clipped to [-clip_ratio_low, clip_ratio_high] in LOG space (the paper's
    e^-0.4..e^0.4 is low = high = 0.4), pessimistically by the sign of A; like verl, the
    log-ratio is not bounded to +-20 first. Importance weights enter as their geometric mean
    over the row, exp(mean_t log(w_t + 1e-10)). The sequence loss is placed on each valid token
    before aggregation, so seq-mean-token-mean gives the paper's mean over sequences.
    """
    low, high = clip_bounds(config)
    valid = response_mask.bool()
    zeros = torch.zeros_like(log_probs)
    log_ratio = torch.where(valid, log_probs - old_log_probs, zeros)
    sign = torch.sign(advantages)
    clamped_log_ratio = torch.clamp(log_ratio, -low, high)
    pessimistic_log_ratio = sign * torch.minimum(sign * log_ratio, sign * clamped_log_ratio)
    lengths = valid.sum(dim=-1).to(log_ratio.dtype) + 1e-8
    sequence_ratio = overflow_safe_exp(torch.where(valid, pessimistic_log_ratio, zeros).sum(dim=-1) / lengths)
    sequence_advantage = torch.where(valid, advantages, zeros).sum(dim=-1) / lengths
    sequence_loss = -sequence_advantage * sequence_ratio
    if importance_weights is not None:
        log_weights = torch.log(importance_weights.detach() + IMPORTANCE_WEIGHT_FLOOR)
        sequence_loss = sequence_loss * torch.exp(torch.where(valid, log_weights, zeros).sum(dim=-1) / lengths)
    loss_matrix = sequence_loss.unsqueeze(-1).expand_as(log_ratio)
    loss = aggregate_loss(loss_matrix, response_mask, loss_agg_mode, normalizer)

    clipped = log_ratio != clamped_log_ratio
    clipfrac = masked_mean((clipped & (advantages > 0)).float(), response_mask)
    clipfrac_lower = masked_mean((clipped & (advantages < 0)).float(), response_mask)
    return loss, common_metrics(log_probs, old_log_probs, response_mask, clipfrac, clipfrac_lower)
