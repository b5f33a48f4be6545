"""Where the run's roles go: the default placement of every role on one pool, and the roles that get worker groups."""

from __future__ import annotations

from reinforge.algorithms.roles import critic_enabled, reference_needed
from reinforge.config import Config
from reinforge.controller import ResourcePool, RolePlacement

ROLES = ("actor_rollout", "ref", "critic", "reward", "reward_model", "judge", "rollout")


def default_placement(config: Config) -> RolePlacement:
    """Every role on one pool of trainer.nnodes x trainer.devices_per_node devices: the hybrid-engine layout."""
    trainer, reward_model = config.trainer, config.reward.reward_model
    placement = RolePlacement.colocated(ROLES, ResourcePool("global", [trainer.devices_per_node] * trainer.nnodes))
    if reward_model.enable and reward_model.enable_resource_pool:  # verl's standalone reward-model pool
        placement.pools["reward_model"] = ResourcePool("reward_model", [reward_model.n_gpus_per_node] * reward_model.nnodes)
        placement.role_to_pool["reward_model"] = "reward_model"
    return placement


def roles_with_groups(config: Config) -> list[str]:
    """The roles that get worker groups of their own: a LoRA actor is its own reference, the policy its own judge."""
    roles = ["actor_rollout"]
    if reference_needed(config) and not config.model.lora.rank:
        roles.append("ref")
    if critic_enabled(config):
        roles.append("critic")
    roles.append("reward")
    if config.reward.reward_model.enable:
        roles.append("reward_model")
    if config.reward.judge.enable and config.reward.judge.model_path != "policy":
        roles.append("judge")
    if config.trainer.mode != "sync" and config.trainer.separate_rollout:
        roles.append("rollout")
    return roles
