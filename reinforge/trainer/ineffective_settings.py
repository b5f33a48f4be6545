"""Settings that the rest of the config makes ineffective: one warning line each, before any model loads.

A setting counts only when it differs from the schema's default (a default merely present never warns):
``actor.kl_loss_coef=5`` with ``actor.use_kl_loss=false`` warns, the default coefficient does not. Mistakes
that are certain, where the run could only do something else than asked (``data.gen_batch_size`` without
dynamic sampling, a policy loss that bypass mode would replace), are refusals of ``config.validate``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reinforge.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from reinforge.algorithms.roles import critic_enabled, reference_needed
from reinforge.config import Config
from reinforge.config.sft_schema import SFTConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IgnoredWhen:
    """``keys`` have no effect when ``applies(config)``; ``because`` says why, ``fix`` how to make them count."""

    keys: tuple[str, ...]
    applies: Callable[[Any], bool]
    because: str
    fix: str


def _loss_params(mode: str, *names: str) -> IgnoredWhen:
    return IgnoredWhen(tuple(f"actor.policy_loss.{name}" for name in names),
                       lambda config: config.actor.policy_loss.loss_mode != mode,
                       f"they are parameters of actor.policy_loss.loss_mode={mode}",
                       f"set actor.policy_loss.loss_mode={mode}")


def _estimator_params(keys: tuple[str, ...], readers: tuple[str, ...], use: str) -> IgnoredWhen:
    """``keys`` are read by the built-in estimators ``readers`` alone; an estimator registered elsewhere (a plugin)
    may read them, so it never warns."""
    def applies(config: Any) -> bool:
        name = config.algorithm.adv_estimator
        estimator = ADVANTAGE_ESTIMATORS.get(name)
        built_in = estimator is not None and estimator.compute.__module__.startswith("reinforge.algorithms.")
        return built_in and name not in readers

    return IgnoredWhen(keys, applies, f"only the {', '.join(readers)} estimators {use}",
                       f"set algorithm.adv_estimator={readers[0]}")


def _clip_params(keys: tuple[str, ...], readers: tuple[str, ...],
                 bounds: Callable[[Any], bool] = lambda config: True) -> list[IgnoredWhen]:
    """``keys`` are read by the built-in policy losses ``readers`` alone (a loss registered elsewhere may read
    them), and by bypass mode's ppo_clip loss, not its reinforce loss; they count only where ``bounds(config)``
    (an infinite dual clip bound, the API's for TRL's delta=None, bounds nothing under any loss)."""
    def other_loss(config: Any) -> bool:
        mode = config.actor.policy_loss.loss_mode
        loss = POLICY_LOSSES.get(mode)
        built_in = loss is not None and loss.__module__.startswith("reinforge.algorithms.")
        return not config.algorithm.rollout_correction.bypass_mode and built_in and mode not in readers

    def reinforce(config: Any) -> bool:
        correction = config.algorithm.rollout_correction
        return correction.bypass_mode and correction.loss_type == "reinforce"

    return [
        IgnoredWhen(keys, lambda config: bounds(config) and other_loss(config),
                    f"only the policy losses {', '.join(readers)} read it", f"set actor.policy_loss.loss_mode={readers[0]}"),
        IgnoredWhen(keys, lambda config: bounds(config) and reinforce(config),
                    "bypass mode's loss algorithm.rollout_correction.loss_type=reinforce clips nothing",
                    "set algorithm.rollout_correction.loss_type=ppo_clip"),
    ]


def _optim_params(prefix: str, when: Callable[[Any], bool] = lambda config: True) -> list[IgnoredWhen]:
    def section(config: Any) -> Any:
        return _value(config, prefix)

    return [
        IgnoredWhen((f"{prefix}.warmup_ratio",), lambda config: when(config) and section(config).warmup_steps > 0,
                    f"{prefix}.warmup_steps is set, which takes precedence", f"set {prefix}.warmup_steps=0"),
        IgnoredWhen((f"{prefix}.min_lr_ratio",), lambda config: when(config) and section(config).schedule != "cosine",
                    f"it is the floor of the cosine schedule and {prefix}.schedule is not cosine",
                    f"set {prefix}.schedule=cosine"),
    ]


REWARD_MODEL_KEYS = ("model_path", "input_tokenizer", "max_length", "max_tokens_per_micro_batch", "offload",
                     "trust_remote_code", "enable_resource_pool", "n_gpus_per_node", "nnodes")
"""reward.reward_model's settings besides enable."""

CRITIC_KEYS = ("critic.model_path", "critic.optim.lr", "critic.optim.weight_decay", "critic.optim.betas",
               "critic.optim.eps", "critic.optim.warmup_steps", "critic.optim.warmup_ratio", "critic.optim.schedule",
               "critic.optim.min_lr_ratio", "critic.cliprange_value", "critic.loss_agg_mode", "critic.loss_scale_factor",
               "critic.ppo_epochs", "critic.max_tokens_per_micro_batch", "critic.grad_clip", "critic.warmup_steps",
               "critic.param_offload", "critic.optimizer_offload")

IGNORED_WHEN: list[IgnoredWhen] = [
    IgnoredWhen(("trainer.test_every", "data.val_batch_size", "data.max_val_samples", "rollout.val_kwargs.n",
                 "rollout.val_kwargs.temperature", "rollout.val_kwargs.top_p", "rollout.val_kwargs.top_k"),
                lambda config: not config.data.val_files, "data.val_files is empty, so the run never validates",
                "give data.val_files"),
    IgnoredWhen(("actor.kl_loss_coef", "actor.kl_loss_type"), lambda config: not config.actor.use_kl_loss,
                "actor.use_kl_loss is false", "set actor.use_kl_loss=true"),
    IgnoredWhen(("algorithm.kl_penalty", "algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef",
                 "algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.horizon"),
                lambda config: not config.algorithm.use_kl_in_reward, "algorithm.use_kl_in_reward is false",
                "set algorithm.use_kl_in_reward=true"),
    IgnoredWhen(("algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.horizon"),
                lambda config: config.algorithm.use_kl_in_reward and config.algorithm.kl_ctrl.type != "adaptive",
                "they steer the adaptive controller and algorithm.kl_ctrl.type is fixed",
                "set algorithm.kl_ctrl.type=adaptive"),
    IgnoredWhen(CRITIC_KEYS, lambda config: not critic_enabled(config),
                "the run has no critic (algorithm.adv_estimator reads no values, or critic.enable=false)",
                "use algorithm.adv_estimator=gae or critic.enable=true"),
    IgnoredWhen(("ref.max_tokens_per_micro_batch", "ref.param_offload"), lambda config: not reference_needed(config),
                "the run loads no reference model (actor.use_kl_loss and algorithm.use_kl_in_reward are false)",
                "turn on a KL loss or a KL-in-reward penalty"),
    IgnoredWhen(("ref.max_tokens_per_micro_batch", "ref.param_offload"),
                lambda config: reference_needed(config) and config.model.lora.rank > 0,
                "with LoRA the reference is the actor itself with its adapters off", "use the actor's settings"),
    IgnoredWhen(("actor.loss_scale_factor",), lambda config: config.actor.loss_agg_mode != "seq-mean-token-sum-norm"
                and not (critic_enabled(config) and config.critic.loss_scale_factor is None
                         and config.critic.loss_agg_mode == "seq-mean-token-sum-norm"),
                "only seq-mean-token-sum-norm divides by it and actor.loss_agg_mode is another mode",
                "set actor.loss_agg_mode=seq-mean-token-sum-norm"),
    IgnoredWhen(("critic.loss_scale_factor",), lambda config: critic_enabled(config)
                and config.critic.loss_agg_mode != "seq-mean-token-sum-norm",
                "only seq-mean-token-sum-norm divides by it and critic.loss_agg_mode is another mode",
                "set critic.loss_agg_mode=seq-mean-token-sum-norm"),
    IgnoredWhen(("algorithm.lam",), lambda config: config.algorithm.adv_estimator != "gae",
                "only GAE reads lambda", "set algorithm.adv_estimator=gae"),
    _estimator_params(("algorithm.gamma",), ("gae", "reinforce_plus_plus"), "discount returns"),
    _estimator_params(("algorithm.norm_adv_by_std", "algorithm.grpo_epsilon"), ("grpo", "gdpo", "grpo_passk"),
                      "divide by a group's std"),
    IgnoredWhen(("algorithm.grpo_epsilon",), lambda config: not config.algorithm.norm_adv_by_std,
                "algorithm.norm_adv_by_std is false, so no group std is divided by", "set algorithm.norm_adv_by_std=true"),
    IgnoredWhen(("algorithm.gdpo_reward_keys", "algorithm.gdpo_reward_weights"),
                lambda config: config.algorithm.adv_estimator != "gdpo", "only the gdpo estimator reads them",
                "set algorithm.adv_estimator=gdpo"),
    IgnoredWhen(("rollout.gpu_memory_utilization", "rollout.kv_cache_gib", "rollout.free_cache_engine",
                 "rollout.enable_prefix_caching", "rollout.max_prefill_chunk_tokens",
                 "rollout.kv_cache_dtype", "rollout.decode_products", "rollout.shared_prefix_decode"),
                lambda config: config.rollout.name == "hf", "they are settings of the native engine and rollout.name "
                "is hf", "set rollout.name=native"),
    IgnoredWhen(("trainer.max_staleness", "trainer.trigger_sync_steps", "trainer.async_deterministic",
                 "trainer.max_in_flight_groups", "rollout.segment_tokens"),
                lambda config: config.trainer.mode != "async", "they are settings of trainer.mode=async",
                "set trainer.mode=async"),
    IgnoredWhen(("trainer.separate_rollout", "trainer.proximal"), lambda config: config.trainer.mode == "sync",
                "they are settings of the off-policy modes and trainer.mode is sync",
                "set trainer.mode=one_step_off or async"),
    IgnoredWhen(("algorithm.filter_groups.metric", "algorithm.filter_groups.max_num_gen_batches"),
                lambda config: not config.algorithm.filter_groups.enable,
                "algorithm.filter_groups.enable is false (no dynamic sampling)",
                "set algorithm.filter_groups.enable=true"),
    IgnoredWhen(("model.lora.alpha", "model.lora.target_modules", "model.lora.dropout"),
                lambda config: config.model.lora.rank == 0, "model.lora.rank is 0 (no adapters)",
                "set model.lora.rank, e.g. to 32"),
    IgnoredWhen(("reward.overlong_buffer.len", "reward.overlong_buffer.penalty_factor"),
                lambda config: not config.reward.overlong_buffer.enable, "reward.overlong_buffer.enable is false",
                "set reward.overlong_buffer.enable=true"),
    IgnoredWhen(("algorithm.rollout_correction.rollout_is_threshold",
                 "algorithm.rollout_correction.rollout_is_batch_normalize"),
                lambda config: config.algorithm.rollout_correction.rollout_is is None and config.trainer.mode == "sync",
                "algorithm.rollout_correction.rollout_is is null (no importance weights)",
                "set algorithm.rollout_correction.rollout_is=token or sequence"),
    IgnoredWhen(("algorithm.rollout_correction.rollout_rs_threshold",),
                lambda config: config.algorithm.rollout_correction.rollout_rs is None,
                "algorithm.rollout_correction.rollout_rs is null (no rejection rules)",
                "name rules in algorithm.rollout_correction.rollout_rs"),
    IgnoredWhen(("algorithm.rollout_correction.loss_type",),
                lambda config: not config.algorithm.rollout_correction.bypass_mode,
                "it is the loss of bypass mode and algorithm.rollout_correction.bypass_mode is false",
                "set algorithm.rollout_correction.bypass_mode=true"),
    *_clip_params(("actor.policy_loss.clip_ratio", "actor.policy_loss.clip_ratio_low",
                   "actor.policy_loss.clip_ratio_high"),
                  ("vanilla", "dppo_tv", "dppo_kl", "cispo", "sapo", "gspo", "geo_mean", "clip_cov")),
    *_clip_params(("actor.policy_loss.clip_ratio_c",), ("vanilla", "dppo_tv", "dppo_kl"),
                  lambda config: math.isfinite(config.actor.policy_loss.clip_ratio_c)),
    _loss_params("clip_cov", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    _loss_params("kl_cov", "kl_cov_ratio", "ppo_kl_coef"),
    _loss_params("sapo", "tau_pos", "tau_neg"),
    _loss_params("dro", "dro_beta"),
    *_optim_params("actor.optim"),
    *_optim_params("critic.optim", critic_enabled),
    IgnoredWhen(("data.truncation",), lambda config: config.data.filter_overlong_prompts,
                "data.filter_overlong_prompts drops every overlong prompt, so none is left to truncate",
                "set data.filter_overlong_prompts=false"),
    IgnoredWhen(("model.attn_implementation",), lambda config: True,
                "the RL workers use their own attention (packed varlen passes, sdpa for generation); it is an SFT "
                "setting", "remove it"),
    IgnoredWhen(("trainer.total_epochs",), lambda config: config.trainer.total_steps is not None,
                "trainer.total_steps is set, so the run takes that many steps and the data repeats as needed",
                "leave trainer.total_steps unset (null) to train trainer.total_epochs over the data"),
    IgnoredWhen(("reward.max_memory_mb",), lambda config: config.reward.num_workers == 0,
                "reward.num_workers=0 scores in this process, which no heap cap applies to",
                "set reward.num_workers=1 or more"),
    IgnoredWhen(("trainer.ray_address",), lambda config: config.trainer.backend != "ray",
                "trainer.backend is local", "set trainer.backend=ray"),
    IgnoredWhen(tuple(f"reward.reward_model.{name}" for name in REWARD_MODEL_KEYS),
                lambda config: not config.reward.reward_model.enable, "reward.reward_model.enable is false",
                "set reward.reward_model.enable=true"),
    IgnoredWhen(("reward.reward_model.n_gpus_per_node", "reward.reward_model.nnodes"),
                lambda config: config.reward.reward_model.enable and not config.reward.reward_model.enable_resource_pool,
                "the reward model shares the actor's devices (reward.reward_model.enable_resource_pool is false)",
                "set reward.reward_model.enable_resource_pool=true"),
    IgnoredWhen(("reward.combine.rm_weight", "reward.combine.rule_weight"),
                lambda config: config.reward.combine.mode != "sum", "they weigh the scores of reward.combine.mode=sum",
                "set reward.combine.mode=sum"),
    IgnoredWhen(("reward.combine.gate_threshold",), lambda config: config.reward.combine.mode != "gate",
                "it is the rule's pass mark of reward.combine.mode=gate", "set reward.combine.mode=gate"),
]
"""Every setting the rest of the config can make ineffective, with the condition that does."""


SFT_IGNORED_WHEN: list[IgnoredWhen] = [
    IgnoredWhen(("trainer.test_every", "data.val_batch_size", "data.max_val_samples"),
                lambda config: not config.data.val_files, "data.val_files is empty, so the run never validates",
                "give data.val_files"),
    IgnoredWhen(("trainer.total_epochs",), lambda config: config.trainer.total_steps is not None,
                "trainer.total_steps is set, so the run takes that many steps and the data repeats as needed",
                "leave trainer.total_steps unset (null) to train trainer.total_epochs over the data"),
    *_optim_params("optim"),
]
"""The same for an SFT run's config."""


def _value(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def ineffective_settings(config: Config | SFTConfig) -> list[str]:
    """One line per setting changed from its default that has no effect under the rest of ``config``."""
    defaults, lines, seen = type(config)(), [], set()
    for rule in SFT_IGNORED_WHEN if isinstance(config, SFTConfig) else IGNORED_WHEN:
        changed = [key for key in rule.keys if key not in seen and _value(config, key) != _value(defaults, key)]
        if changed and rule.applies(config):
            seen.update(changed)
            lines += [f"{key}={_shown(_value(config, key))} has no effect: {rule.because}; {rule.fix}, or remove {key}"
                      for key in changed]
    if isinstance(config, Config):
        lines += _unread_critic(config)
    return lines


def _unread_critic(config: Config) -> list[str]:
    """critic.enable=true beside a built-in estimator that reads no values: the critic is built, planned and updated
    each step (its critic/* metrics logged, as verl does), yet the advantages never read it."""
    name = config.algorithm.adv_estimator
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    if config.critic.enable is not True or estimator is None or estimator.needs_critic \
            or not estimator.compute.__module__.startswith("reinforge.algorithms."):
        return []
    return [f"critic.enable=true with algorithm.adv_estimator={name}, which reads no values: the run plans, loads and "
            "trains a critic whose values no advantage uses (its memory and time spent for the critic/* metrics "
            "alone); remove critic.enable to train without it, or use algorithm.adv_estimator=gae to train with its "
            "values"]


def warn_ineffective_settings(config: Config | SFTConfig) -> None:
    """Warn, one line each, about the settings that the rest of ``config`` makes ineffective."""
    for line in ineffective_settings(config):
        logger.warning(line)
