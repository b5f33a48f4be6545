"""Rollout correction: the rollout engine's policy is not exactly the trainer's.

With log rho_t = old_log_probs - rollout_log_probs (training over rollout policy, per token),
as in verl 0.9.1:

- importance weights: ``token`` uses rho_t, ``sequence`` uses prod_t rho_t (over valid tokens)
  on every token of the row; log-weights are bounded to +-20. A threshold "hi" truncates the
  weights above hi (TIS); "lo_hi" keeps them unchanged inside [lo, hi] and sets them to 0
  outside (IcePop). ``rollout_is_batch_normalize`` then divides them by their mean (over valid
  tokens, or over sequences at sequence level) so that they average 1. 0 at masked
  positions, detached.
- rejection (MIS-style masking), a comma list, every rule must pass to keep a token:
  ``token_kX`` judges each token, ``seq_sum_kX``/``seq_mean_kX``/``seq_max_kX`` the sum, mean
  or max over a row and keep or drop the whole row; the statistics use log rho bounded to
  +-20. k1 = -log rho, and its bounds apply to exp(k1) (pi_rollout / pi_train, verl's
  convention): "hi" keeps [1/hi, hi], "lo_hi" keeps [lo, hi]. k2 = (log rho)^2 / 2 and
  k3 = rho - 1 - log rho (estimates of KL(rollout || training)) are bounded above. A
  threshold list "0.3,0.8_1.25" gives each rule its own threshold, in order; one value serves
  every rule.

The metrics follow verl's conventions and names: ``k3_kl`` averages rho - 1 - log rho over valid
tokens with log rho unbounded, ``rollout_is_max`` at sequence level is the largest weight before
truncation, ``rollout_is_ratio_fraction_{high,low}`` and ``rollout_is_seq_*`` are verl's, and
``rollout_rs_<rule>_seq_masked_fraction`` counts the rows each rule touched.

Bypass mode (old log-probs = rollout log-probs) corrects inside the loss instead, with the
current log-probs: see ``bypass_policy_loss``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Bounds:
    """An optional lower and an upper bound, both positive."""

    lower: float | None
    upper: float


def _positive_number(text: str, key: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{key}={spec!r} holds {text!r}, which is not a positive number; "
                         "write a number such as 2.0, or lower_upper such as 0.5_5.0")
    return value


def _parse_bounds(spec: str, key: str, allow_lower: bool) -> Bounds:
    spec = spec.strip()
    if "_" not in spec:
        return Bounds(None, _positive_number(spec, key, spec))
    if not allow_lower:
        raise ValueError(f"{key}={spec!r}: this rule takes one upper bound, not lower_upper; write e.g. 0.3")
    lower_text, upper_text = spec.split("_", 1)
    bounds = Bounds(_positive_number(lower_text, key, spec), _positive_number(upper_text, key, spec))
    if bounds.lower > bounds.upper:
        raise ValueError(f"{key}={spec!r} has its lower bound above its upper bound; write lower_upper, e.g. 0.5_5.0")
    return bounds


def parse_is_threshold(spec: str | float) -> Bounds:
    """rollout_is_threshold: "2.0" (truncate above 2) or "0.5_5.0" (IcePop: zero outside [0.5, 5])."""
    return _parse_bounds(str(spec), "algorithm.rollout_correction.rollout_is_threshold", allow_lower=True)


def parse_rejection_rules(rollout_rs: str | None, threshold: str | float = 2.0) -> dict[str, Bounds]:
    """'token_k1, seq_mean_k3' with '0.8_1.25,0.3' -> {rule: its bounds}; None or '' -> {}.

    k1 rules get lower = 1 / upper when only the upper bound is given.
    """
    if not rollout_rs:
        return {}
    rules = list(dict.fromkeys(rule.strip() for rule in rollout_rs.split(",") if rule.strip()))
    for rule in rules:
        if rule not in ROLLOUT_RS_RULES:
            raise ValueError(
                f"algorithm.rollout_correction.rollout_rs has unknown rule {rule!r}; use any of {', '.join(ROLLOUT_RS_RULES)}"
            )
    specs = [part for part in str(threshold).split(",") if part.strip()]
    if len(specs) == 1:
        specs = specs * len(rules)
    if len(specs) != len(rules):
        raise ValueError(
            f"algorithm.rollout_correction.rollout_rs_threshold={threshold!r} has {len(specs)} values for "
            f"{len(rules)} rules ({', '.join(rules)}); give one value for all, or one per rule in the same order"
        )
    parsed = {}
    for rule, spec in zip(rules, specs, strict=True):
        is_k1 = rule.endswith("k1")
        bounds = _parse_bounds(spec, f"algorithm.rollout_correction.rollout_rs_threshold ({rule})", allow_lower=is_k1)
        if is_k1 and bounds.lower is None:
            if bounds.upper < 1.0:
                raise ValueError(
                    f"algorithm.rollout_correction.rollout_rs_threshold={spec.strip()} must be at least 1 for {rule}, "
                    "which keeps ratios in [1/threshold, threshold]; or write lower_upper, e.g. 0.8_1.25"
                )
            bounds = Bounds(1.0 / bounds.upper, bounds.upper)
        parsed[rule] = bounds
    return parsed


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
        bounds = parse_is_threshold(config.rollout_is_threshold)
        weights = compute_importance_weights(log_ratio, valid, config.rollout_is, bounds)
        metrics.update(_weight_metrics(weights, log_ratio, valid, config.rollout_is, bounds))
        if config.rollout_is_batch_normalize:
            weights, factor = normalize_importance_weights(weights, valid, config.rollout_is)
            metrics["rollout_corr/rollout_is_batch_norm_factor"] = factor

    keep_mask = valid.clone()
    rules = parse_rejection_rules(config.rollout_rs, config.rollout_rs_threshold)
    for rule, bounds in rules.items():
        rejected = compute_rejection(rule, log_ratio, valid, bounds)
        metrics[f"rollout_corr/rollout_rs_{rule}_masked_fraction"] = masked_mean(rejected.float(), valid).item()
        metrics[f"rollout_corr/rollout_rs_{rule}_seq_masked_fraction"] = masked_mean(
            rejected.any(dim=-1).float(), valid.any(dim=-1)).item()
        keep_mask &= ~rejected
    if rules:
        rejected = valid & ~keep_mask
        has_tokens = valid.any(dim=-1)
        metrics["rollout_corr/rollout_rs_masked_fraction"] = masked_mean(rejected.float(), valid).item()
        metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = masked_mean(
            rejected.any(dim=-1).float(), has_tokens
        ).item()
    return weights, keep_mask.to(old_log_probs.dtype), metrics


def compute_importance_weights(log_ratio: Tensor, valid: Tensor, level: str, bounds: Bounds | float) -> Tensor:
    """Per-token or per-sequence weights exp(log rho), truncated (TIS) or zeroed outside (IcePop).

    log_ratio, valid: (batch, response_len); masked log-ratios are ignored (also when summing a
    sequence). bounds: a Bounds, or a float upper bound. Returns (batch, response_len), 0 at
    masked positions, detached.
    """
    if not isinstance(bounds, Bounds):
        bounds = Bounds(None, float(bounds))
    valid = valid.bool()
    log_ratio = torch.where(valid, log_ratio.detach(), torch.zeros_like(log_ratio))
    if level == "token":
        log_weights = log_ratio
    elif level == "sequence":
        log_weights = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    else:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level!r} is unknown; use token, sequence or null")
    weights = torch.exp(log_weights.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND))
    if bounds.lower is None:
        weights = weights.clamp(max=bounds.upper)
    else:
        inside = (weights >= bounds.lower) & (weights <= bounds.upper)
        weights = torch.where(inside, weights, torch.zeros_like(weights))
    return torch.where(valid, weights, torch.zeros_like(weights))


def normalize_importance_weights(weights: Tensor, valid: Tensor, level: str) -> tuple[Tensor, float]:
    """Weights over their mean (valid tokens, or sequences at sequence level) and that mean.

    A mean of 1e-8 or less leaves the weights as they are (factor 1).
    """
    valid = valid.bool()
    if level == "sequence":
        has_tokens = valid.any(dim=-1)
        mean = masked_mean(masked_mean(weights, valid, dim=-1), has_tokens)
    else:
        mean = masked_mean(weights, valid)
    if mean.item() <= 1e-8:
        return weights, 1.0
    return weights / mean, mean.item()


def compute_rejection(rule: str, log_ratio: Tensor, valid: Tensor, bounds: Bounds | float) -> Tensor:
    """Bool (batch, response_len): True at valid tokens the rule rejects.

    bounds: a Bounds (from parse_rejection_rules), or a float (k1: keeps [1/x, x]; k2, k3: upper bound).
    """
    level, estimator = rule.rsplit("_", 1)
    if not isinstance(bounds, Bounds):
        bounds = Bounds(1.0 / bounds if estimator == "k1" else None, float(bounds))
    valid = valid.bool()
    bounded = torch.where(valid, log_ratio, torch.zeros_like(log_ratio)).clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)
    if estimator == "k1":
        divergence = -bounded
    elif estimator == "k2":
        divergence = 0.5 * bounded.square()
    else:
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
        rejected = (statistic < math.log(bounds.lower)) | (statistic > math.log(bounds.upper))
    else:
        rejected = statistic > bounds.upper
    return rejected.expand_as(valid) & valid


def _divergence_metrics(
    log_ratio: Tensor, old_log_probs: Tensor, rollout_log_probs: Tensor, valid: Tensor
) -> dict[str, float]:
    has_tokens = valid.any(dim=-1)
    training_ppl = torch.exp(-masked_mean(old_log_probs.detach(), valid, dim=-1))
    rollout_ppl = torch.exp(-masked_mean(rollout_log_probs.detach(), valid, dim=-1))
    return {
        "rollout_corr/kl": masked_mean(-log_ratio, valid).item(),
        "rollout_corr/k3_kl": masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, valid).item(),
        "rollout_corr/training_ppl": masked_mean(training_ppl, has_tokens).item(),
        "rollout_corr/rollout_ppl": masked_mean(rollout_ppl, has_tokens).item(),
    }


def _weight_metrics(weights: Tensor, log_ratio: Tensor, valid: Tensor, level: str, bounds: Bounds) -> dict[str, float]:
    """Statistics of the applied weights (before batch normalisation), and how many left the bounds.

    At sequence level ``rollout_is_max`` is the largest weight before truncation or IcePop's zeroing,
    exp of the largest row sum of log rho bounded above by 20 (verl's convention); at token level it
    is the largest applied weight.
    """
    mean = masked_mean(weights, valid)
    second_moment = masked_mean(weights.square(), valid)
    valid_weights = weights[valid]
    if level == "sequence":
        raw_log_weights = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
        row_log_weights = raw_log_weights[:, 0][valid.any(dim=-1)]
        largest = (torch.exp(row_log_weights.max().clamp(max=LOG_WEIGHT_BOUND)).item()
                   if row_log_weights.numel() else 0.0)
    else:
        raw_log_weights = log_ratio
        largest = valid_weights.max().item() if valid_weights.numel() else 0.0
    above = raw_log_weights > math.log(bounds.upper)
    metrics = {
        "rollout_corr/rollout_is_mean": mean.item(),
        "rollout_corr/rollout_is_max": largest,
        "rollout_corr/rollout_is_min": valid_weights.min().item() if valid_weights.numel() else 0.0,
        "rollout_corr/rollout_is_std": (second_moment - mean.square()).clamp_min(0).sqrt().item(),
        "rollout_corr/rollout_is_eff_sample_size": (mean.square() / second_moment.clamp_min(1e-12)).item(),
        "rollout_corr/rollout_is_truncated_fraction": masked_mean(above.float(), valid).item(),
    }
    if bounds.lower is not None:
        outside = above | (raw_log_weights < math.log(bounds.lower))
        metrics["rollout_corr/rollout_is_oob_ratio"] = masked_mean(outside.float(), valid).item()
    return metrics | _verl_weight_fractions(weights, log_ratio, valid, level, bounds)


def _verl_weight_fractions(weights: Tensor, log_ratio: Tensor, valid: Tensor, level: str,
                           bounds: Bounds) -> dict[str, float]:
    """verl's names for how the weights sit against the bounds, and its per-sequence statistics.

    ``rollout_is_ratio_fraction_high``/``_low``: the raw weights (before truncation) above the upper bound and below
    the lower one (1 / upper for a plain truncation threshold), over valid tokens, or over rows at sequence level.
    ``rollout_is_seq_*``: each row's mean applied weight, over the rows; ``seq_fraction_*`` judge each row's mean
    raw weight.
    """
    lower = bounds.lower if bounds.lower is not None else 1.0 / bounds.upper
    log_upper, log_lower = math.log(bounds.upper), math.log(lower)
    if level == "sequence":
        row_log_weights = log_ratio.sum(dim=-1)
        high = (row_log_weights > log_upper).float().mean().item()
        low = (row_log_weights < log_lower).float().mean().item()
        raw = torch.exp(row_log_weights.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)).unsqueeze(-1).expand_as(log_ratio)
    else:
        high = masked_mean((log_ratio > log_upper).float(), valid).item()
        low = masked_mean((log_ratio < log_lower).float(), valid).item()
        raw = torch.exp(log_ratio.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND))
    raw_row_means = masked_mean(raw, valid, dim=-1)  # 0 for a row without tokens, as verl's
    row_means = masked_mean(weights, valid, dim=-1)
    return {
        "rollout_corr/rollout_is_ratio_fraction_high": high,
        "rollout_corr/rollout_is_ratio_fraction_low": low,
        "rollout_corr/rollout_is_seq_mean": row_means.mean().item(),
        "rollout_corr/rollout_is_seq_std": row_means.std().item() if row_means.numel() > 1 else 0.0,
        "rollout_corr/rollout_is_seq_max": row_means.max().item(),
        "rollout_corr/rollout_is_seq_min": row_means.min().item(),
        "rollout_corr/rollout_is_seq_max_deviation": (row_means - 1.0).abs().max().item(),
        "rollout_corr/rollout_is_seq_fraction_high": (raw_row_means > bounds.upper).float().mean().item(),
        "rollout_corr/rollout_is_seq_fraction_low": (raw_row_means < lower).float().mean().item(),
    }
