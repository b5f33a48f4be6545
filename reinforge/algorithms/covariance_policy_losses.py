"""Covariance-based policy losses (Clip-Cov, KL-Cov): keep entropy up by restraining the tokens
whose log-prob moves most with their advantage.

The covariance of a token is (A - mean A)(log pi - mean log pi) over the valid tokens of the
tensors given, so these losses depend on how a mini-batch is split (inherent to the method).
As in verl the ratio is exp of the unbounded log-ratio (no +-20 bound), guarded against
overflow only. Metrics named as verl's hold verl's value: clip_cov's ``pg_clipfrac`` is the
share of tokens it detached (also ``pg_clipcov_frac``) and kl_cov's ``ppo_kl`` is the mean
|log r|. The other figures get their own names: ``pg_ppo_clipfrac`` (clip_cov: the share PPO's
clip cut), ``ppo_kl_signed`` (kl_cov: the mean of old - new log-prob) and ``pg_klcov_frac``
(kl_cov: the share of tokens penalised).
"""

from __future__ import annotations

import torch
from torch import Tensor

from reinforge.algorithms.masked import masked_mean
from reinforge.algorithms.policy_losses import (
    clip_bounds,
    common_metrics,
    overflow_safe_exp,
    reduce_losses,
    register_policy_loss,
)


def _covariance(advantages: Tensor, log_probs: Tensor, valid: Tensor) -> Tensor:
    """(A - mean A)(log pi - mean log pi), means over valid tokens; detached."""
    advantages, log_probs = advantages.detach(), log_probs.detach()
    return (advantages - masked_mean(advantages, valid)) * (log_probs - masked_mean(log_probs, valid))


@register_policy_loss("clip_cov")
def compute_clip_cov_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov: PPO clip, then detach a random clip_cov_ratio share of the tokens whose
    covariance lies in (clip_cov_lb, clip_cov_ub).

    Tokens already clipped by PPO are not candidates. Uses torch's global RNG.
    """
    low, high = clip_bounds(config)
    ratio = overflow_safe_exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    valid = response_mask.bool()
    ppo_clipped = (clipped > unclipped) & valid

    with torch.no_grad():
        covariance = _covariance(advantages, log_probs, valid)
        candidates = valid & ~ppo_clipped & (covariance > config.clip_cov_lb) & (covariance < config.clip_cov_ub)
        candidate_index = torch.nonzero(candidates.reshape(-1)).squeeze(-1)
        num_selected = min(max(int(config.clip_cov_ratio * int(valid.sum().item())), 1), candidate_index.numel())
        chosen = candidate_index[torch.randperm(candidate_index.numel(), device=candidate_index.device)[:num_selected]]
        selected = torch.zeros_like(valid).reshape(-1)
        selected[chosen] = True
        selected = selected.reshape(valid.shape)

    loss_matrix = torch.where(selected, torch.zeros_like(unclipped), torch.maximum(unclipped, clipped))
    loss = reduce_losses(loss_matrix, response_mask, loss_agg_mode, importance_weights, normalizer)
    selected_share = masked_mean(selected.float(), valid).detach()
    metrics = common_metrics(log_probs, old_log_probs, response_mask, selected_share)
    metrics["pg_clipcov_frac"] = selected_share
    metrics["pg_ppo_clipfrac"] = masked_mean(ppo_clipped.float(), valid).detach()
    return loss, metrics


@register_policy_loss("kl_cov")
def compute_kl_cov_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov: unclipped -A r, plus ppo_kl_coef * |log r| on the top kl_cov_ratio share of
    valid tokens by covariance (at least one token)."""
    log_ratio = log_probs - old_log_probs
    ratio = overflow_safe_exp(log_ratio)
    valid = response_mask.bool()
    num_valid = int(valid.sum().item())

    with torch.no_grad():
        covariance = _covariance(advantages, log_probs, valid)
        covariance = torch.where(valid, covariance, torch.full_like(covariance, -torch.inf))
        selected = torch.zeros_like(valid).reshape(-1)
        if num_valid > 0:
            num_selected = max(int(num_valid * config.kl_cov_ratio), 1)
            selected[torch.topk(covariance.reshape(-1), num_selected).indices] = True
        selected = selected.reshape(valid.shape)

    penalty = torch.where(selected, config.ppo_kl_coef * log_ratio.abs(), torch.zeros_like(log_ratio))
    loss_matrix = -advantages * ratio + penalty
    loss = reduce_losses(loss_matrix, response_mask, loss_agg_mode, importance_weights, normalizer)
    metrics = common_metrics(log_probs, old_log_probs, response_mask)
    metrics["ppo_kl_signed"] = metrics["ppo_kl"]
    metrics["ppo_kl"] = masked_mean(log_ratio.detach().abs(), response_mask)
    metrics["pg_klcov_frac"] = masked_mean(selected.float(), valid).detach()
    return loss, metrics
