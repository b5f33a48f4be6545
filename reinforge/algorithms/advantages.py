"""Advantage estimators: how much better each sampled response (or token) was than expected.

Every estimator returns ``(advantages, returns)``, both (batch, response_len) and 0 at masked
positions. A sequence's score is the sum of its row of token_level_rewards; samples of one
prompt share a group id. The formulas follow verl 0.9.1, including its edge cases (GRPO:
Bessel std, algorithm.grpo_epsilon (1e-6) added outside the sqrt, a group of one has mean 0
and std 1). gdpo is GRPO on each of the scorer's named rewards, weighted and summed, then
whitened; the optimal token baselines live in ``token_baseline_advantages``. Departures:

- REINFORCE++ carries the running return across masked (tool) tokens, as GAE does, instead
  of resetting it there; for single-turn right-padded responses both are identical.
- Masked positions of advantages and returns are 0 for every estimator (verl leaves GAE's
  and ReMax's non-zero there; no loss reads them).
- verl's epsilon is a fixed argument; here it is configurable (algorithm.grpo_epsilon).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from reinforge.algorithms.masked import masked_whiten

if TYPE_CHECKING:
    from reinforge.config.schema import AlgorithmConfig

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]
"""fn(*, token_level_rewards, response_mask, group_ids, config, values, reward_baselines, old_log_probs,
sum_pi_squared, rollout_is_weights, reward_components) -> (advantages, returns); an estimator takes the
keywords it needs and ignores the rest."""


@dataclass(frozen=True)
class AdvantageEstimator:
    compute: AdvantageFn
    needs_groups: bool = False
    """Compares the samples of one prompt, so rollout.n must be 2 or more."""
    needs_critic: bool = False
    """Reads the critic's values, so the critic runs (critic.enable cannot be false)."""
    needs_sum_pi_squared: bool = False
    """Reads sum_v pi(v)^2 and the old log-probs, so the actor's log-prob pass runs (also on-policy) and adds it."""


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}

def register_advantage(name: str, *, needs_groups: bool = False, needs_critic: bool = False,
                       needs_sum_pi_squared: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
    def add(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(fn, needs_groups=needs_groups, needs_critic=needs_critic,
                                                        needs_sum_pi_squared=needs_sum_pi_squared)
        return fn

    return add


def compute_advantages(
    name: str,
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    config: AlgorithmConfig,
    values: Tensor | None = None,
    reward_baselines: Tensor | None = None,
    old_log_probs: Tensor | None = None,
    sum_pi_squared: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
    reward_components: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Run the estimator registered as name. Returns (advantages, returns), each (batch, response_len).

    token_level_rewards, response_mask, values, old_log_probs, sum_pi_squared,
    rollout_is_weights: (batch, response_len); group_ids, reward_baselines and each of
    reward_components (a scorer output by name, for gdpo): (batch,).
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r} (algorithm.adv_estimator); use one of {', '.join(sorted(ADVANTAGE_ESTIMATORS))}"
        )
    if group_ids.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"group_ids has shape {tuple(group_ids.shape)} but the batch has {token_level_rewards.shape[0]} rows; pass one id per row"
        )
    return ADVANTAGE_ESTIMATORS[name].compute(
        token_level_rewards=token_level_rewards,
        response_mask=response_mask,
        group_ids=group_ids,
        config=config,
        values=values,
        reward_baselines=reward_baselines,
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
        rollout_is_weights=rollout_is_weights,
        reward_components=reward_components,
    )


def group_statistics(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Each sample's group mean, Bessel-corrected group std and group size, all (batch,).

    A group of one has std 0 here; callers decide what that means.
    """
    _, group_index = torch.unique(group_ids, return_inverse=True)
    num_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    counts = scores.new_zeros(num_groups).index_add_(0, group_index, torch.ones_like(scores))
    means = scores.new_zeros(num_groups).index_add_(0, group_index, scores) / counts
    centered = scores - means[group_index]
    squares = scores.new_zeros(num_groups).index_add_(0, group_index, centered.square())
    stds = torch.sqrt(squares / (counts - 1).clamp_min(1))
    return means[group_index], stds[group_index], counts[group_index]


def _broadcast(per_sequence: Tensor, response_mask: Tensor) -> Tensor:
    """(batch,) -> (batch, response_len), 0 at masked positions."""
    return per_sequence.unsqueeze(-1) * response_mask.to(per_sequence.dtype)


@register_advantage("gae", needs_critic=True)
def compute_gae_advantages(
    *, token_level_rewards: Tensor, response_mask: Tensor, config: AlgorithmConfig, values: Tensor | None, **_
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation; advantages whitened over the batch's valid tokens.

    Walks backwards; a masked (tool) token neither adds a TD error nor breaks the chain, so the
    next valid token's value bootstraps across it. returns = raw advantages + values.
    """
    if values is None:
        raise ValueError("adv_estimator=gae needs critic values; enable the critic or pick a critic-free estimator")
    gamma, lam = config.gamma, config.lam
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    running_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running_advantage
        running_advantage = mask[:, t] * candidate + (1 - mask[:, t]) * running_advantage
        next_value = mask[:, t] * values[:, t] + (1 - mask[:, t]) * next_value
        advantages[:, t] = running_advantage
    returns = (advantages + values) * mask
    return masked_whiten(advantages, response_mask), returns


def _grpo_per_sequence(scores: Tensor, group_ids: Tensor, config: AlgorithmConfig) -> Tensor:
    """(score - group mean) / (group std + grpo_epsilon), (batch,); a group of one has mean 0 and std 1."""
    means, stds, counts = group_statistics(scores, group_ids)
    singleton = counts == 1
    means = torch.where(singleton, torch.zeros_like(means), means)
    stds = torch.where(singleton, torch.ones_like(stds), stds)
    centered = scores - means
    return centered / (stds + config.grpo_epsilon) if config.norm_adv_by_std else centered


@register_advantage("grpo", needs_groups=True)
def compute_grpo_advantages(
    *, token_level_rewards: Tensor, response_mask: Tensor, group_ids: Tensor, config: AlgorithmConfig, **_
) -> tuple[Tensor, Tensor]:
    """(score - group mean) / (group std + grpo_epsilon); norm_adv_by_std=False drops the std (Dr. GRPO)."""
    per_sequence = _grpo_per_sequence(token_level_rewards.sum(dim=-1), group_ids, config)
    advantages = _broadcast(per_sequence, response_mask)
    return advantages, advantages


@register_advantage("gdpo", needs_groups=True)
def compute_gdpo_advantages(
    *, response_mask: Tensor, group_ids: Tensor, config: AlgorithmConfig,
    reward_components: dict[str, Tensor] | None = None, **_
) -> tuple[Tensor, Tensor]:
    """GDPO: GRPO on each reward component by itself, their weighted sum, whitened over the batch's tokens.

    reward_components: {name: (batch,) scores} holding every name of config.gdpo_reward_keys;
    weights config.gdpo_reward_weights (default 1 each). As in verl, token_level_rewards (and a
    KL penalty in them) is not used.
    """
    keys = list(config.gdpo_reward_keys)
    if not keys:
        raise ValueError("adv_estimator=gdpo needs algorithm.gdpo_reward_keys: the names of the scorer's separate "
                         "rewards (keys of the dict it returns), e.g. algorithm.gdpo_reward_keys=[format,acc]")
    weights = config.gdpo_reward_weights or [1.0] * len(keys)
    if len(weights) != len(keys):
        raise ValueError(f"algorithm.gdpo_reward_weights has {len(weights)} values for {len(keys)} "
                         "gdpo_reward_keys; give one weight per key")
    components = reward_components or {}
    total = None
    for key, weight in zip(keys, weights, strict=True):
        if key not in components:
            raise ValueError(f"adv_estimator=gdpo: the scorer returned no {key!r} (algorithm.gdpo_reward_keys); "
                             f"it returned {', '.join(sorted(components)) or 'no extras'}")
        term = weight * _grpo_per_sequence(components[key].to(torch.float32), group_ids, config)
        total = term if total is None else total + term
    advantages = masked_whiten(_broadcast(total, response_mask), response_mask)
    return advantages, advantages


@register_advantage("grpo_passk", needs_groups=True)
def compute_grpo_passk_advantages(
    *, token_level_rewards: Tensor, response_mask: Tensor, group_ids: Tensor, config: AlgorithmConfig, **_
) -> tuple[Tensor, Tensor]:
    """Pass@k: only each group's best sample learns, from (best - second best) [/ (std + 1e-6)]."""
    scores = token_level_rewards.sum(dim=-1)
    per_sequence = torch.zeros_like(scores)
    for group_id in torch.unique(group_ids):
        members = torch.nonzero(group_ids == group_id).squeeze(-1)
        if members.numel() < 2:
            raise ValueError(
                f"grpo_passk needs at least 2 samples per prompt, group {group_id.item()} has 1; set rollout.n >= 2"
            )
        group_scores = scores[members]
        top_two, top_index = torch.topk(group_scores, 2)
        advantage = top_two[0] - top_two[1]
        if config.norm_adv_by_std:
            advantage = advantage / (group_scores.std() + config.grpo_epsilon)
        per_sequence[members[top_index[0]]] = advantage
    advantages = _broadcast(per_sequence, response_mask)
    return advantages, advantages


@register_advantage("rloo", needs_groups=True)
def compute_rloo_advantages(
    *, token_level_rewards: Tensor, response_mask: Tensor, group_ids: Tensor, **_
) -> tuple[Tensor, Tensor]:
    """Leave-one-out baseline: n/(n-1) * (score - group mean); a group of one keeps its score."""
    scores = token_level_rewards.sum(dim=-1)
    means, _, counts = group_statistics(scores, group_ids)
    scale = counts / (counts - 1).clamp_min(1)
    per_sequence = torch.where(counts > 1, scale * (scores - means), scores)
    advantages = _broadcast(per_sequence, response_mask)
    return advantages, advantages


@register_advantage("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantages(
    *, token_level_rewards: Tensor, response_mask: Tensor, config: AlgorithmConfig, **_
) -> tuple[Tensor, Tensor]:
    """Discounted return-to-go per token, whitened over all valid tokens of the batch."""
    mask = response_mask.to(token_level_rewards.dtype)
    running_return = torch.zeros_like(token_level_rewards[:, 0])
    returns = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[1])):
        candidate = token_level_rewards[:, t] + config.gamma * running_return
        running_return = mask[:, t] * candidate + (1 - mask[:, t]) * running_return
        returns[:, t] = running_return * mask[:, t]
    return masked_whiten(returns, response_mask), returns


@register_advantage("reinforce_plus_plus_baseline", needs_groups=True)
def compute_reinforce_plus_plus_baseline_advantages(
    *, token_level_rewards, response_mask, group_ids, **_
) -> tuple[Tensor, Tensor]:
    """Score minus group mean (0 for a group of one) on every token, then whitened over the batch."""
    scores = token_level_rewards.sum(dim=-1)
    means, _, counts = group_statistics(scores, group_ids)
    means = torch.where(counts == 1, torch.zeros_like(means), means)
    advantages = masked_whiten(_broadcast(scores - means, response_mask), response_mask)
    return advantages, advantages


@register_advantage("remax")
def compute_remax_advantages(
    *, token_level_rewards: Tensor, response_mask: Tensor, reward_baselines: Tensor | None, **_
) -> tuple[Tensor, Tensor]:
    """Undiscounted return-to-go minus the greedy sample's score (reward_baselines, (batch,))."""
    if reward_baselines is None:
        raise ValueError("adv_estimator=remax needs reward_baselines, the score of a greedy sample per prompt")
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
    advantages = returns - _broadcast(reward_baselines.to(returns.dtype), response_mask)
    return advantages, returns


@register_advantage("opo", needs_groups=True)
def compute_opo_advantages(
    *, token_level_rewards: Tensor, response_mask: Tensor, group_ids: Tensor, **_
) -> tuple[Tensor, Tensor]:
    """Score minus the length-weighted group mean sum(len * score) / sum(len); 0 baseline alone."""
    scores = token_level_rewards.sum(dim=-1)
    lengths = response_mask.to(scores.dtype).sum(dim=-1)
    _, group_index = torch.unique(group_ids, return_inverse=True)
    num_groups = int(group_index.max().item()) + 1
    weighted = scores.new_zeros(num_groups).index_add_(0, group_index, lengths * scores)
    total_lengths = scores.new_zeros(num_groups).index_add_(0, group_index, lengths)
    counts = scores.new_zeros(num_groups).index_add_(0, group_index, torch.ones_like(scores))
    baselines = weighted / total_lengths.clamp_min(1e-8)
    baselines = torch.where(counts > 1, baselines, torch.zeros_like(baselines))[group_index]
    advantages = _broadcast(scores - baselines, response_mask)
    return advantages, advantages


@register_advantage("gpg", needs_groups=True)
def compute_gpg_advantages(
    *, token_level_rewards: Tensor, response_mask: Tensor, group_ids: Tensor, **_
) -> tuple[Tensor, Tensor]:
    """alpha * (score - group mean), alpha = batch size / number of non-zero scores (at least 1)."""
    scores = token_level_rewards.sum(dim=-1)
    means, _, counts = group_statistics(scores, group_ids)
    means = torch.where(counts == 1, torch.zeros_like(means), means)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp_min(1)
    advantages = _broadcast(alpha * (scores - means), response_mask)
    return advantages, advantages
