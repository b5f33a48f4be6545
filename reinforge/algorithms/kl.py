"""KL estimators between the policy and a reference, the KL controllers, and the in-reward penalty.

With log-ratio d = log_probs - ref_log_probs on tokens sampled from the policy (see
http://joschu.net/blog/kl-approx.html):

- ``k1`` (alias ``kl``): d; unbiased, high variance, can be negative
- ``abs``: |d|
- ``k2`` (alias ``mse``): d**2 / 2; its gradient is the unbiased gradient of the KL
- ``k3`` (alias ``low_var_kl``): exp(-d) + d - 1, with d clamped to +-20 and the result to +-10

A name ending in ``+`` (``k3+``, ``low_var_kl+``) is straight-through: the value of the named
estimator, the gradient of k2. verl's ``full`` estimator (needs all logits) is not provided.
The adaptive controller is Ziegler et al. (2019), as in verl.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from reinforge.algorithms.masked import masked_mean

if TYPE_CHECKING:
    from reinforge.config.schema import KLControlConfig

KLEstimator = Callable[[Tensor, Tensor], Tensor]

KL_ESTIMATORS: dict[str, KLEstimator] = {}
"""Estimator name -> fn(log_probs, ref_log_probs) -> (batch, response_len)."""
KL_ESTIMATOR_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
"""verl's names for the same estimators."""


def register_kl_estimator(name: str) -> Callable[[KLEstimator], KLEstimator]:
    def add(fn: KLEstimator) -> KLEstimator:
        if name in KL_ESTIMATORS:
            raise ValueError(f"KL estimator {name!r} is registered twice")
        KL_ESTIMATORS[name] = fn
        return fn

    return add


@register_kl_estimator("k1")
def kl_k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    return log_probs - ref_log_probs


@register_kl_estimator("abs")
def kl_abs(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    return (log_probs - ref_log_probs).abs()


@register_kl_estimator("k2")
def kl_k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    return 0.5 * (log_probs - ref_log_probs).square()


@register_kl_estimator("k3")
def kl_k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """exp(r) - r - 1 with r = ref - log_probs clamped to +-20; the result clamped to +-10."""
    log_ratio = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimate of the policy from the reference, (batch, response_len).

    estimator: a name in KL_ESTIMATORS or KL_ESTIMATOR_ALIASES, optionally ending in ``+``.
    """
    straight_through = estimator.endswith("+")
    base_name = estimator[:-1] if straight_through else estimator
    base_name = KL_ESTIMATOR_ALIASES.get(base_name, base_name)
    if base_name not in KL_ESTIMATORS:
        known = sorted([*KL_ESTIMATORS, *KL_ESTIMATOR_ALIASES])
        raise ValueError(
            f"unknown KL estimator {estimator!r}; use one of {', '.join(known)} (a trailing '+' uses the k2 gradient)"
        )
    value = KL_ESTIMATORS[base_name](log_probs, ref_log_probs)
    if not straight_through:
        return value
    k2 = kl_k2(log_probs, ref_log_probs)
    return value.detach() + (k2 - k2.detach())


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, num_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Steers the KL towards target_kl: value *= 1 + clip(kl / target - 1, +-0.2) * num_steps / horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL control needs target_kl > 0 and horizon > 0, got {target_kl} and {horizon}; "
                "set algorithm.kl_ctrl.target_kl and algorithm.kl_ctrl.horizon"
            )
        self.value = init_kl_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, num_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * num_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


KL_CONTROLLERS: dict[str, Callable[[KLControlConfig], KLController]] = {
    "fixed": lambda config: FixedKLController(config.kl_coef),
    "adaptive": lambda config: AdaptiveKLController(config.kl_coef, config.target_kl, config.horizon),
}
"""algorithm.kl_ctrl.type -> the controller built from algorithm.kl_ctrl."""


def build_kl_controller(config: KLControlConfig) -> KLController:
    """The controller named by config.type (a key of KL_CONTROLLERS)."""
    if config.type not in KL_CONTROLLERS:
        raise ValueError(f"unknown algorithm.kl_ctrl.type {config.type!r}; use one of {', '.join(KL_CONTROLLERS)}")
    return KL_CONTROLLERS[config.type](config)


def apply_kl_penalty(
    token_level_scores: Tensor,
    old_log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    controller: KLController,
    estimator: str,
) -> tuple[Tensor, dict[str, float]]:
    """Rewards = scores - beta * KL per token; then the controller sees the batch's mean KL.

    All tensors (batch, response_len). The mean KL is the mean over sequences of each
    sequence's token-mean KL (rows without valid tokens are left out; verl counts them as 0).
    Returns (token_level_rewards, metrics) with metrics actor/reward_kl_penalty and
    actor/reward_kl_penalty_coeff (the beta that was applied).
    """
    valid_mask = response_mask.bool()
    token_kl = kl_penalty(old_log_probs, ref_log_probs, estimator)
    token_kl = torch.where(valid_mask, token_kl, torch.zeros_like(token_kl))
    beta = controller.value
    token_level_rewards = token_level_scores - beta * token_kl

    sequence_kl = masked_mean(token_kl, valid_mask, dim=-1)
    has_tokens = valid_mask.any(dim=-1)
    current_kl = masked_mean(sequence_kl, has_tokens).item()
    controller.update(current_kl=current_kl, num_steps=int(token_level_scores.shape[0]))
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
