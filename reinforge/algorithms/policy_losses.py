"""Policy losses: PPO's clipped surrogate and its descendants, one registered function each.

Every loss builds a (batch, response_len) matrix of per-token losses from the log-ratio
log_probs - old_log_probs, multiplies it by the optional (detached) rollout importance
weights and reduces it with ``aggregate_loss``. Metrics are detached scalar tensors:
``pg_clipfrac``, ``pg_clipfrac_lower`` and ``ppo_kl`` (the token-mean of old - new log-prob).

The formulas follow verl. Departures, each because verl's choice breaks micro-batching or
hides the user's setting:

- every loss honours ``loss_agg_mode`` (verl forces seq-mean-token-mean on gspo, and a plain
  sequence mean on geo_mean); pick ``seq-mean-token-mean`` to reproduce those papers. A
  sequence-level loss (geo_mean) is placed on each valid token of its row.
- log-ratios are clamped to +-20 before exp in every loss (verl: vanilla, geo_mean, cispo, sapo).
- clip_cov and kl_cov report the fraction of tokens they selected as ``pg_clipcov_frac`` /
  ``pg_klcov_frac``; ``pg_clipfrac`` keeps its PPO meaning, and ``ppo_kl`` is never |kl|.
- clip_cov and kl_cov choose tokens by covariance within the tensors they are given, so
  their loss depends on how a mini-batch is split (inherent to the method).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from reinforge.algorithms.aggregation import LossNormalizer, aggregate_loss
from reinforge.algorithms.masked import masked_mean
from reinforge.config.schema import PolicyLossConfig

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
"""fn(*, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config,
importance_weights, normalizer) -> (loss, metrics)."""

POLICY_LOSSES: dict[str, PolicyLossFn] = {}

LOG_RATIO_BOUND = 20.0
"""exp(20) ~ 5e8: far beyond any useful ratio, far below float32 overflow."""


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    def add(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = fn
        return fn

    return add


def compute_policy_loss(
    name: str,
    *,
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    config: PolicyLossConfig,
    importance_weights: Tensor | None = None,
    normalizer: LossNormalizer | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Run the policy loss registered as name. All tensors (batch, response_len).

    Returns (scalar loss, metrics with pg_clipfrac, pg_clipfrac_lower, ppo_kl and extras).
    """
    if name not in POLICY_LOSSES:
        raise ValueError(
            f"unknown policy loss {name!r} (actor.policy_loss.loss_mode); use one of {', '.join(sorted(POLICY_LOSSES))}"
        )
    if importance_weights is not None and importance_weights.shape != log_probs.shape:
        raise ValueError(
            f"importance_weights has shape {tuple(importance_weights.shape)}, log_probs {tuple(log_probs.shape)}; "
            "pass one weight per token"
        )
    return POLICY_LOSSES[name](
        old_log_probs=old_log_probs,
        log_probs=log_probs,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        importance_weights=importance_weights,
        normalizer=normalizer,
    )


def clip_bounds(config: PolicyLossConfig) -> tuple[float, float]:
    """(clip_ratio_low, clip_ratio_high), each falling back to clip_ratio."""
    low = config.clip_ratio if config.clip_ratio_low is None else config.clip_ratio_low
    high = config.clip_ratio if config.clip_ratio_high is None else config.clip_ratio_high
    return low, high


def _log_ratio(log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    return (log_probs - old_log_probs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _reduce(
    loss_matrix: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    importance_weights: Tensor | None,
    normalizer: LossNormalizer | None,
) -> Tensor:
    if importance_weights is not None:
        loss_matrix = loss_matrix * importance_weights.detach()
    return aggregate_loss(loss_matrix, response_mask, loss_agg_mode, normalizer)


def _metrics(
    log_ratio: Tensor, response_mask: Tensor, clipfrac: Tensor | None = None, clipfrac_lower: Tensor | None = None
) -> dict[str, Tensor]:
    zero = log_ratio.new_zeros(())
    return {
        "pg_clipfrac": (zero if clipfrac is None else clipfrac).detach(),
        "pg_clipfrac_lower": (zero if clipfrac_lower is None else clipfrac_lower).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }


@register_policy_loss("vanilla")
def compute_vanilla_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip with bounds [1 - low, 1 + high], plus dual clip at clip_ratio_c for A < 0.

    loss = max(-A r, -A clip(r)); for A < 0 additionally min(that, -A c).
    """
    if config.clip_ratio_c <= 1.0:
        raise ValueError(
            f"actor.policy_loss.clip_ratio_c={config.clip_ratio_c} must be greater than 1 (dual clip); 3.0 is usual"
        )
    low, high = clip_bounds(config)
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clipped_loss = torch.maximum(unclipped, clipped)
    dual_clip_bound = -advantages * config.clip_ratio_c
    negative_advantage = advantages < 0
    loss_matrix = torch.where(negative_advantage, torch.minimum(clipped_loss, dual_clip_bound), clipped_loss)

    clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    clipfrac_lower = masked_mean(((clipped_loss > dual_clip_bound) & negative_advantage).float(), response_mask)
    loss = _reduce(loss_matrix, response_mask, loss_agg_mode, importance_weights, normalizer)
    return loss, _metrics(log_ratio, response_mask, clipfrac, clipfrac_lower)


@register_policy_loss("gspo")
def compute_gspo_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: PPO clip on the sequence's geometric-mean ratio s_i = exp(mean_t log r_t).

    Token t uses s_it = sg(s_i) * pi(t) / sg(pi(t)): its value is s_i, its gradient
    sg(s_i) * grad log pi(t), so each token keeps its own direction. The log of s_it is
    clamped at 10. Use loss_agg_mode=seq-mean-token-mean for the paper's objective.
    """
    low, high = clip_bounds(config)
    raw_log_ratio = log_probs - old_log_probs
    valid = response_mask.to(raw_log_ratio.dtype)
    lengths = valid.sum(dim=-1).clamp_min(1)
    sequence_log_ratio = (raw_log_ratio * valid).sum(dim=-1) / lengths
    # Adding the detached sequence term last keeps its precision (verl PR 2775).
    token_log_ratio = log_probs - log_probs.detach() + sequence_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log_ratio.clamp(max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    loss_matrix = torch.maximum(unclipped, clipped)

    clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    loss = _reduce(loss_matrix, response_mask, loss_agg_mode, importance_weights, normalizer)
    return loss, _metrics(_log_ratio(log_probs, old_log_probs), response_mask, clipfrac)


@register_policy_loss("gpg")
def compute_gpg_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG: plain policy gradient, loss = -A * log pi (no ratio, no clip)."""
    loss = _reduce(-advantages * log_probs, response_mask, loss_agg_mode, importance_weights, normalizer)
    return loss, _metrics(_log_ratio(log_probs, old_log_probs), response_mask)


@register_policy_loss("clip_cov")
def compute_clip_cov_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov: PPO clip, then detach a random clip_cov_ratio share of the tokens whose
    covariance (A - mean A)(log pi - mean log pi) lies in (clip_cov_lb, clip_cov_ub).

    Tokens already clipped by PPO are not candidates. Uses torch's global RNG.
    """
    low, high = clip_bounds(config)
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    valid = response_mask.bool()
    ppo_clipped = (clipped > unclipped) & valid

    with torch.no_grad():
        covariance = (advantages - masked_mean(advantages, valid)) * (log_probs - masked_mean(log_probs, valid))
        candidates = valid & ~ppo_clipped & (covariance > config.clip_cov_lb) & (covariance < config.clip_cov_ub)
        candidate_index = torch.nonzero(candidates.reshape(-1)).squeeze(-1)
        num_selected = min(max(int(config.clip_cov_ratio * int(valid.sum().item())), 1), candidate_index.numel())
        chosen = candidate_index[torch.randperm(candidate_index.numel(), device=candidate_index.device)[:num_selected]]
        selected = torch.zeros_like(valid).reshape(-1)
        selected[chosen] = True
        selected = selected.reshape(valid.shape)

    loss_matrix = torch.where(selected, torch.zeros_like(unclipped), torch.maximum(unclipped, clipped))
    loss = _reduce(loss_matrix, response_mask, loss_agg_mode, importance_weights, normalizer)
    metrics = _metrics(log_ratio, response_mask, masked_mean(ppo_clipped.float(), valid))
    metrics["pg_clipcov_frac"] = masked_mean(selected.float(), valid).detach()
    return loss, metrics


@register_policy_loss("kl_cov")
def compute_kl_cov_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov: unclipped -A r, plus ppo_kl_coef * |log r| on the top kl_cov_ratio share of
    valid tokens by covariance (A - mean A)(log pi - mean log pi) (at least one token)."""
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio)
    valid = response_mask.bool()
    num_valid = int(valid.sum().item())

    with torch.no_grad():
        covariance = (advantages - masked_mean(advantages, valid)) * (log_probs - masked_mean(log_probs, valid))
        covariance = torch.where(valid, covariance, torch.full_like(covariance, -torch.inf))
        selected = torch.zeros_like(valid).reshape(-1)
        if num_valid > 0:
            num_selected = max(int(num_valid * config.kl_cov_ratio), 1)
            selected[torch.topk(covariance.reshape(-1), num_selected).indices] = True
        selected = selected.reshape(valid.shape)

    loss_matrix = -advantages * ratio + selected * config.ppo_kl_coef * log_ratio.abs()
    loss = _reduce(loss_matrix, response_mask, loss_agg_mode, importance_weights, normalizer)
    metrics = _metrics(log_ratio, response_mask)
    metrics["pg_klcov_frac"] = masked_mean(selected.float(), valid).detach()
    return loss, metrics


@register_policy_loss("geo_mean")
def compute_geo_mean_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO: loss_i = -mean_t(A) * exp(mean_t clipped log r_t), one value per sequence.

    The log-ratio is clipped to [-clip_ratio_low, clip_ratio_high] in LOG space (the paper's
    e^-0.4..e^0.4 is low = high = 0.4), pessimistically by the sign of A. Importance weights
    are averaged over the row. The sequence loss is placed on each valid token before
    aggregation, so seq-mean-token-mean gives the paper's mean over sequences.
    """
    low, high = clip_bounds(config)
    log_ratio = _log_ratio(log_probs, old_log_probs)
    sign = torch.sign(advantages)
    clamped_log_ratio = torch.clamp(log_ratio, -low, high)
    pessimistic_log_ratio = sign * torch.minimum(sign * log_ratio, sign * clamped_log_ratio)
    valid = response_mask.to(log_ratio.dtype)
    lengths = valid.sum(dim=-1) + 1e-8
    sequence_ratio = torch.exp((pessimistic_log_ratio * valid).sum(dim=-1) / lengths)
    sequence_advantage = (advantages * valid).sum(dim=-1) / lengths
    sequence_loss = -sequence_advantage * sequence_ratio
    if importance_weights is not None:
        sequence_loss = sequence_loss * (importance_weights.detach() * valid).sum(dim=-1) / lengths
    loss_matrix = sequence_loss.unsqueeze(-1).expand_as(log_ratio)
    loss = aggregate_loss(loss_matrix, response_mask, loss_agg_mode, normalizer)

    clipped = log_ratio != clamped_log_ratio
    clipfrac = masked_mean((clipped & (advantages > 0)).float(), response_mask)
    clipfrac_lower = masked_mean((clipped & (advantages < 0)).float(), response_mask)
    return loss, _metrics(log_ratio, response_mask, clipfrac, clipfrac_lower)


@register_policy_loss("cispo")
def compute_cispo_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: loss = -sg(clip(r, 1 - low, 1 + high)) * A * log pi; clipped tokens keep a gradient.

    pg_clipfrac counts weights cut at the top, pg_clipfrac_lower those cut at the bottom.
    """
    low, high = clip_bounds(config)
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - low, 1.0 + high).detach()
    loss_matrix = -weight * advantages * log_probs
    loss = _reduce(loss_matrix, response_mask, loss_agg_mode, importance_weights, normalizer)
    clipfrac = masked_mean((ratio > 1.0 + high).float(), response_mask)
    clipfrac_lower = masked_mean((ratio < 1.0 - low).float(), response_mask)
    return loss, _metrics(log_ratio, response_mask, clipfrac, clipfrac_lower)


@register_policy_loss("sapo")
def compute_sapo_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO: a soft gate instead of a hard clip, loss = -A * sigmoid(tau (r - 1)) * 4 / tau.

    tau = tau_pos where A > 0, else tau_neg. At r = 1 the gradient equals plain policy
    gradient's; it fades smoothly as r leaves 1. The paper aggregates seq-mean-token-mean.
    pg_clipfrac / pg_clipfrac_lower report ratios outside [1 - low, 1 + high] (no clipping).
    """
    if config.tau_pos <= 0 or config.tau_neg <= 0:
        raise ValueError(
            f"actor.policy_loss.tau_pos={config.tau_pos} and tau_neg={config.tau_neg} must both be positive"
        )
    low, high = clip_bounds(config)
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, config.tau_pos, config.tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = _reduce(-gate * advantages, response_mask, loss_agg_mode, importance_weights, normalizer)
    clipfrac = masked_mean((ratio > 1.0 + high).float(), response_mask)
    clipfrac_lower = masked_mean((ratio < 1.0 - low).float(), response_mask)
    return loss, _metrics(log_ratio, response_mask, clipfrac, clipfrac_lower)
