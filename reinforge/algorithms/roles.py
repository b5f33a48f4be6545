"""Which models beside the actor a run's algorithm needs: a critic, a reference policy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reinforge.algorithms.advantages import ADVANTAGE_ESTIMATORS

if TYPE_CHECKING:
    from reinforge.config.schema import Config


def critic_enabled(config: Config) -> bool:
    """critic.enable, or by default whether the advantage estimator reads values."""
    if config.critic.enable is None:
        return ADVANTAGE_ESTIMATORS[config.algorithm.adv_estimator].needs_critic
    return config.critic.enable


def reference_needed(config: Config) -> bool:
    """A KL loss or a KL penalty in the reward compares the actor with the reference policy."""
    return config.actor.use_kl_loss or config.algorithm.use_kl_in_reward
