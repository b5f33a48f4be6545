"""Policy losses: PPO's clipped surrogate and its descendants, one registered function each.

Every loss builds a (batch, response_len) matrix of per-token losses from the log-ratio
log_probs - old_log_probs, multiplies it by the optional (detached) rollout importance
weights and reduces it with ``aggregate_loss``. Metrics are detached scalar tensors:
``pg_clipfrac``, ``pg_clipfrac_lower`` and ``ppo_kl`` (the token-mean of old - new log-prob, bounded
to +-20 in the losses that bound it),
plus extras some losses add. This module holds the registry and the token-level losses;
``sequence_policy_losses`` (gspo, geo_mean) and ``covariance_policy_losses`` (clip_cov,
kl_cov) register the others.

The formulas follow verl 0.9.1, including where it bounds the log-ratio to +-20 before exp
(vanilla, dppo_tv, dppo_kl, cispo, sapo) and where it does not (gspo, clip_cov, kl_cov,
geo_mean, gpg, dro): there a token with a log-ratio of 25 keeps verl's large gradient. ``ppo_kl``
follows the same split, as verl's does: the losses that bound the log-ratio average the bounded
one (a token at log-ratio 25 counts as 20), the others the raw one, and kl_cov reports the mean
|log r|. Where
exp of an unbounded log-ratio could overflow we cap its argument at the largest value whose
exp is finite in the tensor's dtype, which changes no finite result (verl gives inf or nan
there). Departures, each because verl's choice breaks micro-batching, hides the user's
setting or hides information:

- every loss honours ``loss_agg_mode`` (verl forces seq-mean-token-mean on sapo, and a plain
  sequence mean on geo_mean); pick ``seq-mean-token-mean`` to reproduce those papers. A
  sequence-level loss (geo_mean) is placed on each valid token of its row.
- every loss reports the three common metrics (verl's gpg reports none and dro only ppo_kl).
- clip_cov's ``pg_clipfrac`` is the share of tokens it detached (as in verl); PPO's clip share
  is ``pg_ppo_clipfrac``. kl_cov adds ``ppo_kl_signed`` and ``pg_klcov_frac``.
- clip_cov and kl_cov choose tokens by covariance within the tensors they are given, so
  their loss depends on how a mini-batch is split (inherent to the method).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from reinforge.algorithms.aggregation import LossNormalizer, aggregate_loss
from reinforge.algorithms.masked import masked_mean

if TYPE_CHECKING:
    from reinforge.config.schema import PolicyLossConfig

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
"""fn(*, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config,
importance_weights, normalizer) -> (loss, metrics)."""

POLICY_LOSSES: dict[str, PolicyLossFn] = {}

LOG_RATIO_BOUND = 20.0
"""exp(20) ~ 5e8: far beyond any useful ratio, far below float32 overflow (verl's bound)."""


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


def bounded_log_ratio(log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    """log_probs - old_log_probs clamped to +-LOG_RATIO_BOUND (no gradient beyond it), as verl's PPO does."""
    return (log_probs - old_log_probs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


@functools.cache
def _largest_finite_exp_argument(dtype: torch.dtype) -> float:
    x = torch.tensor(math.log(torch.finfo(dtype).max), dtype=dtype)
    while torch.isinf(torch.exp(x)):
        x = torch.nextafter(x, torch.tensor(-math.inf, dtype=dtype))
    return x.item()


def overflow_safe_exp(x: Tensor) -> Tensor:
    """exp(x) wherever that is finite in x's dtype; beyond, the largest finite value, with no gradient.

    Unlike a fixed bound, this changes no finite result: only arguments whose exp would be inf
    (and whose gradient inf or nan) are capped.
    """
    return torch.exp(x.clamp(max=_largest_finite_exp_argument(x.dtype)))


def reduce_losses(
    loss_matrix: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    importance_weights: Tensor | None,
    normalizer: LossNormalizer | None,
) -> Tensor:
    """Weight a (batch, response_len) loss matrix by the detached importance weights, then aggregate."""
    if importance_weights is not None:
        loss_matrix = loss_matrix * importance_weights.detach()
    return aggregate_loss(loss_matrix, response_mask, loss_agg_mode, normalizer)


def common_metrics(
    log_probs: Tensor,
    old_log_probs: Tensor,
    response_mask: Tensor,
    clipfrac: Tensor | None = None,
    clipfrac_lower: Tensor | None = None,
    *,
    bounded: bool = False,
) -> dict[str, Tensor]:
    """pg_clipfrac, pg_clipfrac_lower (0 when not given) and ppo_kl, the token-mean of old - new log-prob.

    ``bounded``: the loss bounds the log-ratio to +-LOG_RATIO_BOUND, and ppo_kl averages the bounded one.
    """
    log_ratio = (bounded_log_ratio(log_probs, old_log_probs) if bounded else log_probs - old_log_probs).detach()
    zero = log_ratio.new_zeros(())
    return {
        "pg_clipfrac": (zero if clipfrac is None else clipfrac).detach(),
        "pg_clipfrac_lower": (zero if clipfrac_lower is None else clipfrac_lower).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask),
    }


def _ratio_band_metrics(ratio: Tensor, response_mask: Tensor, low: float, high: float) -> dict[str, Tensor]:
    """Shares of tokens whose ratio lies above 1 + high and below 1 - low."""
    return {
        "pg_ratio_above_frac": masked_mean((ratio > 1.0 + high).float(), response_mask).detach(),
        "pg_ratio_below_frac": masked_mean((ratio < 1.0 - low).float(), response_mask).detach(),
    }


@register_policy_loss("vanilla")
def compute_vanilla_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip with bounds [1 - low, 1 + high], plus dual clip at clip_ratio_c for A < 0.

    loss = max(-A r, -A clip(r)); for A < 0 additionally min(that, -A c). log r is bounded to +-20.
    """
    if config.clip_ratio_c <= 1.0:
        raise ValueError(
            f"actor.policy_loss.clip_ratio_c={config.clip_ratio_c} must be greater than 1 (dual clip); 3.0 is usual"
        )
    low, high = clip_bounds(config)
    ratio = torch.exp(bounded_log_ratio(log_probs, old_log_probs))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clipped_loss = torch.maximum(unclipped, clipped)
    dual_clip_bound = -advantages * config.clip_ratio_c
    negative_advantage = advantages < 0
    loss_matrix = torch.where(negative_advantage, torch.minimum(clipped_loss, dual_clip_bound), clipped_loss)

    clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    clipfrac_lower = masked_mean(((clipped_loss > dual_clip_bound) & negative_advantage).float(), response_mask)
    loss = reduce_losses(loss_matrix, response_mask, loss_agg_mode, importance_weights, normalizer)
    return loss, common_metrics(log_probs, old_log_probs, response_mask, clipfrac, clipfrac_lower, bounded=True)


def _dppo_loss(
    keep: Tensor, ratio: Tensor, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, response_mask: Tensor,
    loss_agg_mode: str, config: PolicyLossConfig, importance_weights: Tensor | None,
    normalizer: LossNormalizer | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """-A * sg(min(r, clip_ratio_c)) * log pi on the tokens DPPO keeps (its trust region)."""
    keep = keep.detach().to(log_probs.dtype)
    truncated_ratio = torch.clamp(ratio, max=config.clip_ratio_c).detach()
    loss_matrix = -advantages * truncated_ratio * log_probs * keep
    loss = reduce_losses(loss_matrix, response_mask, loss_agg_mode, importance_weights, normalizer)
    clipfrac = masked_mean(1.0 - keep, response_mask)
    truncated_fraction = masked_mean((ratio > config.clip_ratio_c).to(keep.dtype) * keep, response_mask)
    return loss, common_metrics(log_probs, old_log_probs, response_mask, clipfrac, truncated_fraction, bounded=True)


@register_policy_loss("dppo_tv")
def compute_dppo_tv_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV (arXiv 2602.04879): a trust region on pi - pi_old instead of on the ratio.

    A token learns, from -A sg(min(r, clip_ratio_c)) log pi, unless it already moved too far
    in its advantage's direction: pi - pi_old > clip_ratio_high for A > 0, or < -clip_ratio_low
    otherwise (clip_ratio_* are probability differences here). pg_clipfrac is the share of
    tokens dropped; pg_clipfrac_lower the share kept whose ratio was truncated at clip_ratio_c.
    """
    low, high = clip_bounds(config)
    ratio = torch.exp(bounded_log_ratio(log_probs, old_log_probs))
    difference = torch.exp(log_probs) - torch.exp(old_log_probs)
    keep = torch.where(advantages > 0, difference <= high, difference >= -low)
    return _dppo_loss(keep, ratio, log_probs, old_log_probs, advantages, response_mask, loss_agg_mode, config,
                      importance_weights, normalizer)


@register_policy_loss("dppo_kl")
def compute_dppo_kl_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-KL: as dppo_tv, with the binary KL between Bernoulli(pi_old) and Bernoulli(pi).

    KL = pi_old log(pi_old / pi) + (1 - pi_old) log((1 - pi_old + 1e-8) / (1 - pi + 1e-8)).
    A token is dropped when KL exceeds clip_ratio_high while pi rose (A > 0), or clip_ratio_low
    while pi fell (A <= 0).
    """
    low, high = clip_bounds(config)
    ratio = torch.exp(bounded_log_ratio(log_probs, old_log_probs))
    probs, old_probs = torch.exp(log_probs), torch.exp(old_log_probs)
    binary_kl = old_probs * (old_log_probs - log_probs) + (1.0 - old_probs) * torch.log(
        (1.0 - old_probs + 1e-8) / (1.0 - probs + 1e-8)
    )
    keep_if_positive = (binary_kl <= high) | (probs <= old_probs)
    keep_if_negative = (binary_kl <= low) | (probs >= old_probs)
    keep = torch.where(advantages > 0, keep_if_positive, keep_if_negative)
    return _dppo_loss(keep, ratio, log_probs, old_log_probs, advantages, response_mask, loss_agg_mode, config,
                      importance_weights, normalizer)


@register_policy_loss("gpg")
def compute_gpg_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG: plain policy gradient, loss = -A * log pi (no ratio, no clip)."""
    loss = reduce_losses(-advantages * log_probs, response_mask, loss_agg_mode, importance_weights, normalizer)
    return loss, common_metrics(log_probs, old_log_probs, response_mask)


@register_policy_loss("dro")
def compute_dro_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """DRO: policy gradient with a quadratic log-ratio penalty, loss = -(A log pi - beta/2 (log r)^2).

    beta is dro_beta (required, > 0); the penalty pulls log pi back towards log pi_old.
    """
    if config.dro_beta is None or config.dro_beta <= 0:
        raise ValueError(
            f"actor.policy_loss.dro_beta={config.dro_beta} must be a positive number for loss_mode=dro, e.g. 0.1"
        )
    log_ratio = log_probs - old_log_probs
    loss_matrix = -(log_probs * advantages - 0.5 * config.dro_beta * log_ratio.square())
    loss = reduce_losses(loss_matrix, response_mask, loss_agg_mode, importance_weights, normalizer)
    return loss, common_metrics(log_probs, old_log_probs, response_mask)


@register_policy_loss("cispo")
def compute_cispo_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: loss = -sg(clip(r, 1 - low, 1 + high)) * A * log pi; clipped tokens keep a gradient.

    As in verl, pg_clipfrac counts weights cut on either side and pg_clipfrac_lower is 0;
    pg_ratio_above_frac / pg_ratio_below_frac split the cut ones by side.
    """
    low, high = clip_bounds(config)
    ratio = torch.exp(bounded_log_ratio(log_probs, old_log_probs))
    clipped_ratio = torch.clamp(ratio, 1.0 - low, 1.0 + high)
    loss_matrix = -clipped_ratio.detach() * advantages * log_probs
    loss = reduce_losses(loss_matrix, response_mask, loss_agg_mode, importance_weights, normalizer)
    clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)
    metrics = common_metrics(log_probs, old_log_probs, response_mask, clipfrac, bounded=True)
    return loss, metrics | _ratio_band_metrics(ratio, response_mask, low, high)


@register_policy_loss("sapo")
def compute_sapo_policy_loss(
    *, old_log_probs, log_probs, advantages, response_mask, loss_agg_mode, config, importance_weights, normalizer
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO: a soft gate instead of a hard clip, loss = -A * sigmoid(tau (r - 1)) * 4 / tau.

    tau = tau_pos where A > 0, else tau_neg. At r = 1 the gradient equals plain policy
    gradient's; it fades smoothly as r leaves 1. The paper aggregates seq-mean-token-mean.
    Nothing is clipped, so pg_clipfrac and pg_clipfrac_lower are 0 (as in verl);
    pg_ratio_above_frac / pg_ratio_below_frac count ratios outside [1 - low, 1 + high].
    """
    if config.tau_pos <= 0 or config.tau_neg <= 0:
        raise ValueError(
            f"actor.policy_loss.tau_pos={config.tau_pos} and tau_neg={config.tau_neg} must both be positive"
        )
    low, high = clip_bounds(config)
    ratio = torch.exp(bounded_log_ratio(log_probs, old_log_probs))
    tau = torch.where(advantages > 0, config.tau_pos, config.tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = reduce_losses(-gate * advantages, response_mask, loss_agg_mode, importance_weights, normalizer)
    metrics = common_metrics(log_probs, old_log_probs, response_mask, bounded=True)
    return loss, metrics | _ratio_band_metrics(ratio, response_mask, low, high)
