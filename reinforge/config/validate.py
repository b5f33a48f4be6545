"""Cross-field rules, checked before any model loads. Each failure says how to fix it."""

from __future__ import annotations

from reinforge.config.loader import ConfigError
from reinforge.config.schema import Config

GROUP_ESTIMATORS = {"grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"}
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ROLLOUT_BACKENDS = ("hf", "native")


def _choice(key: str, value: object, choices: tuple[str, ...] | list[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, choices))}")


def critic_enabled(config: Config) -> bool:
    if config.critic.enable is None:
        return config.algorithm.adv_estimator == "gae"
    return config.critic.enable


def reference_needed(config: Config) -> bool:
    return config.actor.use_kl_loss or config.algorithm.use_kl_in_reward


def validate_config(config: Config) -> None:
    """Raise ConfigError with the fix in the message when fields disagree."""
    from reinforge.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATOR_ALIASES, KL_ESTIMATORS, POLICY_LOSSES

    data, actor, rollout, algorithm, trainer = config.data, config.actor, config.rollout, config.algorithm, config.trainer
    _choice("algorithm.adv_estimator", algorithm.adv_estimator, sorted(ADVANTAGE_ESTIMATORS))
    _choice("actor.policy_loss.loss_mode", actor.policy_loss.loss_mode, sorted(POLICY_LOSSES))
    _choice("actor.loss_agg_mode", actor.loss_agg_mode, LOSS_AGG_MODES)
    _choice("critic.loss_agg_mode", config.critic.loss_agg_mode, LOSS_AGG_MODES)
    kl_names = sorted({*KL_ESTIMATORS, *KL_ESTIMATOR_ALIASES})
    kl_names += [f"{name}+" for name in kl_names]
    _choice("actor.kl_loss_type", actor.kl_loss_type, kl_names)
    _choice("algorithm.kl_penalty", algorithm.kl_penalty, kl_names)
    _choice("algorithm.kl_ctrl.type", algorithm.kl_ctrl.type, ("fixed", "adaptive"))
    _choice("data.truncation", data.truncation, ("error", "left", "right"))
    _choice("rollout.name", rollout.name, ROLLOUT_BACKENDS)
    _choice("trainer.backend", trainer.backend, ("local", "ray"))
    _choice("trainer.device", trainer.device, ("auto", "cpu", "cuda"))
    _choice("actor.optim.schedule", actor.optim.schedule, ("constant", "cosine"))
    _choice("critic.optim.schedule", config.critic.optim.schedule, ("constant", "cosine"))

    if rollout.n < 1:
        raise ConfigError(f"rollout.n={rollout.n} must be at least 1")
    if algorithm.adv_estimator in GROUP_ESTIMATORS and rollout.n < 2:
        raise ConfigError(
            f"rollout.n={rollout.n} is too small for algorithm.adv_estimator={algorithm.adv_estimator}, "
            "which compares samples of one prompt; set rollout.n to 2 or more"
        )
    if algorithm.adv_estimator == "gae" and config.critic.enable is False:
        raise ConfigError("algorithm.adv_estimator=gae needs a critic but critic.enable=false; "
                          "remove critic.enable or choose a critic-free estimator such as grpo")
    if data.train_batch_size < 1:
        raise ConfigError(f"data.train_batch_size={data.train_batch_size} must be at least 1")
    if actor.mini_batch_size is not None:
        if actor.mini_batch_size < 1 or data.train_batch_size % actor.mini_batch_size:
            raise ConfigError(
                f"actor.mini_batch_size={actor.mini_batch_size} must divide data.train_batch_size="
                f"{data.train_batch_size}; pick a divisor or leave it unset (the whole batch, on-policy)"
            )
    if actor.ppo_epochs < 1:
        raise ConfigError(f"actor.ppo_epochs={actor.ppo_epochs} must be at least 1")
    longest = data.max_prompt_length + data.max_response_length
    if actor.max_tokens_per_micro_batch < longest:
        raise ConfigError(
            f"actor.max_tokens_per_micro_batch={actor.max_tokens_per_micro_batch} cannot hold one sequence of "
            f"data.max_prompt_length + data.max_response_length = {longest} tokens; raise it to at least {longest}"
        )
    clip = actor.policy_loss
    if clip.clip_ratio_c <= 1.0:
        raise ConfigError(f"actor.policy_loss.clip_ratio_c={clip.clip_ratio_c} must be greater than 1 (dual clip)")
    if rollout.temperature < 0 or rollout.val_kwargs.temperature < 0:
        raise ConfigError("rollout.temperature and rollout.val_kwargs.temperature must be >= 0 (0 is greedy)")
    if not 0.0 < rollout.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p={rollout.top_p} must be in (0, 1]")
    if rollout.val_kwargs.n < 1:
        raise ConfigError(f"rollout.val_kwargs.n={rollout.val_kwargs.n} must be at least 1")
    if trainer.resume not in ("auto", "never") and not trainer.resume:
        raise ConfigError("trainer.resume must be auto, never, or a checkpoint path")
    num_devices = trainer.nnodes * trainer.devices_per_node
    if trainer.backend == "local" and num_devices > 1:
        raise ConfigError(f"trainer.backend=local runs every worker in this process on one device, but "
                          f"trainer.nnodes x trainer.devices_per_node = {num_devices}; set trainer.backend=ray")
    if trainer.keep_last < 1:
        raise ConfigError(f"trainer.keep_last={trainer.keep_last} must be at least 1 (the latest checkpoint)")
    if algorithm.rollout_correction.rollout_is is not None:
        _choice("algorithm.rollout_correction.rollout_is", algorithm.rollout_correction.rollout_is, ("token", "sequence"))
