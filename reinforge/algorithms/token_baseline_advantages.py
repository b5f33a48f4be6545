"""Optimal token baseline (OTB): a baseline per prompt group and per position, weighted by path variance.

For a group of samples of one prompt, with G_t the reward-to-go of a sample at position t,
as in verl 0.9.1:

    w_t = 1 - 2 pi_t + sum_v pi(v)^2       (||grad log pi||^2 of a softmax, up to the hidden layer)
    W_t = sum_{j <= t} w_j                  (the path's variance so far; w_j * rho_j^2 with rollout_is weights)
    B_t = sum_i G_it W_it / (sum_i W_it + 1e-8)      advantage A_t = G_t - B_t

pi_t is the old policy's probability of the sampled token (exp old_log_probs) and
sum pi^2 comes from the log-prob pass (``sum_pi_squared``). A group of one has baseline 0.
Where one sample is longer than all the others, its positions past the second longest get
baseline 0 (there the baseline would be its own return, and its advantage 0).

``optimal_token_baseline`` aligns samples by position in the response;
``tir_optimal_token_baseline`` (tool-integrated reasoning) by the index among each sample's
valid tokens, so tool output (masked) between turns does not shift the alignment, and
ignores samples with no valid token. For single-turn responses both are the same.
Departure: returns are 0 at masked positions (verl keeps the reward-to-go there).
"""

from __future__ import annotations

import torch
from torch import Tensor

from reinforge.algorithms.advantages import register_advantage

BASELINE_EPSILON = 1e-8


def _path_variance(response_mask: Tensor, old_log_probs: Tensor | None, sum_pi_squared: Tensor | None,
                   rollout_is_weights: Tensor | None, name: str) -> Tensor:
    """W (batch, response_len): cumulative w_t over valid tokens."""
    if sum_pi_squared is None or old_log_probs is None:
        raise ValueError(f"adv_estimator={name} needs old_log_probs and sum_pi_squared (sum over the vocabulary of "
                         "pi^2 per token) from the actor's compute_log_prob; the trainer asks for them with this "
                         "estimator, so pass them when calling it directly")
    per_token = 1.0 - 2.0 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights.square()
    return torch.where(response_mask.bool(), per_token, torch.zeros_like(per_token)).cumsum(dim=-1)


def _reward_to_go(token_level_rewards: Tensor, response_mask: Tensor) -> Tensor:
    mask = response_mask.to(token_level_rewards.dtype)
    return (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)


def _group_baselines(returns: Tensor, path_variance: Tensor, weights_mask: Tensor, lengths: Tensor,
                     group_ids: Tensor, members_mask: Tensor) -> Tensor:
    """Per-position baselines (batch, len) from aligned rows; rows outside members_mask get 0."""
    baselines = torch.zeros_like(returns)
    for group_id in torch.unique(group_ids[members_mask]):
        members = torch.nonzero((group_ids == group_id) & members_mask).squeeze(-1)
        if members.numel() < 2:
            continue
        weighted = path_variance[members] * weights_mask[members]
        baseline = (returns[members] * weighted).sum(dim=0) / (weighted.sum(dim=0) + BASELINE_EPSILON)
        baselines[members] = baseline.to(baselines.dtype)
        member_lengths = lengths[members]
        longest, second_longest = torch.sort(member_lengths).values[-2:].flip(0)
        if longest > second_longest:
            only_longest = members[member_lengths == longest]
            baselines[only_longest, int(second_longest.item()):] = 0.0
    return baselines


@register_advantage("optimal_token_baseline", needs_sum_pi_squared=True)
def compute_optimal_token_baseline_advantages(
    *, token_level_rewards: Tensor, response_mask: Tensor, group_ids: Tensor, old_log_probs: Tensor | None = None,
    sum_pi_squared: Tensor | None = None, rollout_is_weights: Tensor | None = None, **_
) -> tuple[Tensor, Tensor]:
    """A_t = G_t - B_t with B_t the path-variance-weighted mean of the group's G_t at position t.

    old_log_probs, sum_pi_squared, rollout_is_weights: (batch, response_len). Returns (advantages, returns).
    """
    with torch.no_grad():
        path_variance = _path_variance(response_mask, old_log_probs, sum_pi_squared, rollout_is_weights,
                                       "optimal_token_baseline")
        returns = _reward_to_go(token_level_rewards, response_mask)
        mask = response_mask.to(returns.dtype)
        lengths = response_mask.sum(dim=-1)
        everyone = torch.ones_like(group_ids, dtype=torch.bool)
        baselines = _group_baselines(returns, path_variance, mask, lengths, group_ids, everyone)
        return (returns - baselines) * mask, returns * mask


@register_advantage("tir_optimal_token_baseline", needs_sum_pi_squared=True)
def compute_tir_optimal_token_baseline_advantages(
    *, token_level_rewards: Tensor, response_mask: Tensor, group_ids: Tensor, old_log_probs: Tensor | None = None,
    sum_pi_squared: Tensor | None = None, rollout_is_weights: Tensor | None = None, **_
) -> tuple[Tensor, Tensor]:
    """As optimal_token_baseline, with samples aligned by the index of each valid token (multi-turn)."""
    with torch.no_grad():
        path_variance = _path_variance(response_mask, old_log_probs, sum_pi_squared, rollout_is_weights,
                                       "tir_optimal_token_baseline")
        returns = _reward_to_go(token_level_rewards, response_mask)
        valid = response_mask.bool()
        rows, columns = torch.nonzero(valid, as_tuple=True)
        compact_columns = (valid.cumsum(dim=-1) - 1)[rows, columns]
        compact_returns, compact_variance = torch.zeros_like(returns), torch.zeros_like(path_variance)
        compact_returns[rows, compact_columns] = returns[rows, columns]
        compact_variance[rows, compact_columns] = path_variance[rows, columns]
        lengths = valid.sum(dim=-1)
        # the compact rows are zero past each length, so every entry may take part in the sums
        baselines = _group_baselines(compact_returns, compact_variance, torch.ones_like(compact_returns), lengths,
                                     group_ids, lengths > 0)
        advantages = torch.zeros_like(returns)
        advantages[rows, columns] = (compact_returns - baselines)[rows, compact_columns]
        return advantages, returns * response_mask.to(returns.dtype)
