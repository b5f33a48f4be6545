"""Rollout correction: the rollout engine's policy is not exactly the trainer's.

With log rho_t = old_log_probs - rollout_log_probs (training over rollout policy, per token):

- importance weights (TIS): ``token`` uses rho_t, ``sequence`` uses prod_t rho_t on every
  token of the row; log-weights are bounded to +-20, weights truncated above at
  rollout_is_threshold, 0 at masked positions, detached.
- rejection (MIS-style masking), a comma list, every rule must pass to keep a token:
  ``token_kX`` judges each token, ``seq_sum_kX``/``seq_mean_kX``/``seq_max_kX`` the sum, mean
  or max over a row and keep or drop the whole row. k1 rules bound the ratio (rho, prod rho,
  or the geometric mean) to [1/threshold, threshold]; k2 = (log rho)^2 / 2 and
  k3 = rho - 1 - log rho (an estimate of KL(rollout || training)) are bounded above.

As in verl; departure: one rollout_rs_threshold serves every rule (verl accepts one per rule
and "lower_upper" strings), since our config holds a single float. Bypass mode (old log-probs
= rollout log-probs) is the trainer's choice; here it simply yields weights of 1.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from reinforge.algorithms.masked import masked_mean

if TYPE_CHECKING:
    from reinforge.config.schema import RolloutCorrectionConfig

LOG_WEIGHT_BOUND = 20.0
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_RULES = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def compute_rollout_correction(
    old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, config: RolloutCorrectionConfig
) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """Importance weights (or None), keep mask and metrics; all tensors (batch, response_len).

    The keep mask is response_mask (as float) with rejected tokens set to 0; use it as the
    response mask of the losses so that rejected tokens also leave the denominators.
    """
    valid = response_mask.bool()
    log_ratio = torch.where(valid, old_log_probs - rollout_log_probs, torch.zeros_like(old_log_probs)).detach()
    metrics = _divergence_metrics(log_ratio, old_log_probs, rollout_log_probs, valid)

    weights = None
    if config.rollout_is is not None:
        weights = compute_importance_weights(log_ratio, valid, config.rollout_is, config.rollout_is_threshold)
        metrics.update(_weight_metrics(weights, log_ratio, valid, config))

    keep_mask = valid.clone()
    for rule in parse_rejection_rules(config.rollout_rs):
        rejected = compute_rejection(rule, log_ratio, valid, config.rollout_rs_threshold)
        metrics[f"rollout_corr/rollout_rs_{rule}_masked_fraction"] = masked_mean(rejected.float(), valid).item()
        keep_mask &= ~rejected
    if config.rollout_rs:
        rejected = valid & ~keep_mask
        has_tokens = valid.any(dim=-1)
        metrics["rollout_corr/rollout_rs_masked_fraction"] = masked_mean(rejected.float(), valid).item()
        metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = masked_mean(
            rejected.any(dim=-1).float(), has_tokens
        ).item()
    return weights, keep_mask.to(old_log_probs.dtype), metrics


def compute_importance_weights(log_ratio: Tensor, valid: Tensor, level: str, threshold: float) -> Tensor:
    """Truncated importance weights min(rho, threshold), per token or per sequence; 0 when masked."""
    if level == "token":
        log_weights = log_ratio
    elif level == "sequence":
        log_weights = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    else:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level!r} is unknown; use token, sequence or null")
    weights = torch.exp(log_weights.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)).clamp(max=threshold)
    return torch.where(valid, weights, torch.zeros_like(weights))


def parse_rejection_rules(rollout_rs: str | None) -> list[str]:
    """'token_k1, seq_mean_k3' -> ['token_k1', 'seq_mean_k3']; None or '' -> []."""
    if not rollout_rs:
        return []
    rules = [rule.strip() for rule in rollout_rs.split(",") if rule.strip()]
    for rule in rules:
        if rule not in ROLLOUT_RS_RULES:
            raise ValueError(
                f"algorithm.rollout_correction.rollout_rs has unknown rule {rule!r}; use any of {', '.join(ROLLOUT_RS_RULES)}"
            )
    return rules


def compute_rejection(rule: str, log_ratio: Tensor, valid: Tensor, threshold: float) -> Tensor:
    """Bool (batch, response_len): True at valid tokens the rule rejects."""
    level, estimator = rule.rsplit("_", 1)
    if estimator == "k1":
        if threshold <= 1.0:
            raise ValueError(
                f"rollout_rs_threshold={threshold} must exceed 1 for {rule}, which keeps ratios in [1/threshold, threshold]"
            )
        divergence = log_ratio
    elif estimator == "k2":
        divergence = 0.5 * log_ratio.square()
    else:
        bounded = log_ratio.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)
        divergence = torch.exp(bounded) - 1.0 - bounded
    divergence = torch.where(valid, divergence, torch.zeros_like(divergence))

    if level == "token":
        statistic = divergence
    elif level == "seq_sum":
        statistic = divergence.sum(dim=-1, keepdim=True)
    elif level == "seq_mean":
        statistic = masked_mean(divergence, valid, dim=-1).unsqueeze(-1)
    else:
        statistic = torch.where(valid, divergence, torch.full_like(divergence, -torch.inf)).amax(dim=-1, keepdim=True)

    if estimator == "k1":
        rejected = statistic.abs() > math.log(threshold)
    else:
        rejected = statistic > threshold
    return rejected.expand_as(valid) & valid


def _divergence_metrics(
    log_ratio: Tensor, old_log_probs: Tensor, rollout_log_probs: Tensor, valid: Tensor
) -> dict[str, float]:
    bounded = log_ratio.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)
    has_tokens = valid.any(dim=-1)
    training_ppl = torch.exp(-masked_mean(old_log_probs.detach(), valid, dim=-1))
    rollout_ppl = torch.exp(-masked_mean(rollout_log_probs.detach(), valid, dim=-1))
    return {
        "rollout_corr/kl": masked_mean(-log_ratio, valid).item(),
        "rollout_corr/k3_kl": masked_mean(torch.exp(bounded) - 1.0 - bounded, valid).item(),
        "rollout_corr/training_ppl": masked_mean(training_ppl, has_tokens).item(),
        "rollout_corr/rollout_ppl": masked_mean(rollout_ppl, has_tokens).item(),
    }


def _weight_metrics(
    weights: Tensor, log_ratio: Tensor, valid: Tensor, config: RolloutCorrectionConfig
) -> dict[str, float]:
    mean = masked_mean(weights, valid)
    second_moment = masked_mean(weights.square(), valid)
    valid_weights = weights[valid]
    if config.rollout_is == "sequence":
        raw_log_weights = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    else:
        raw_log_weights = log_ratio
    truncated = raw_log_weights > math.log(config.rollout_is_threshold)
    return {
        "rollout_corr/rollout_is_mean": mean.item(),
        "rollout_corr/rollout_is_max": valid_weights.max().item() if valid_weights.numel() else 0.0,
        "rollout_corr/rollout_is_min": valid_weights.min().item() if valid_weights.numel() else 0.0,
        "rollout_corr/rollout_is_std": (second_moment - mean.square()).clamp_min(0).sqrt().item(),
        "rollout_corr/rollout_is_eff_sample_size": (mean.square() / second_moment.clamp_min(1e-12)).item(),
        "rollout_corr/rollout_is_truncated_fraction": masked_mean(truncated.float(), valid).item(),
    }
