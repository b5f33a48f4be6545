"""The typed configuration of the preference runs: ``reinforge rm`` (a reward model) and ``reinforge dpo``.

Both read pairs of completions, one chosen and one rejected (``data``), and share the model, optimizer and
trainer sections with SFT, so a key means the same in all three. ``rm`` adds the reward model's loss settings,
``dpo`` the DPO loss's. ``load_rm_config`` and ``load_dpo_config`` load and check them before torch loads.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from reinforge.config.errors import ConfigError
from reinforge.config.loader import load_structured, naming_sources
from reinforge.config.schema import ModelConfig, OptimConfig, RunConfig, UpdateConfig
from reinforge.config.validate import (
    choose,
    validate_lora,
    validate_model_dtype,
    validate_optim,
    validate_router_aux_loss_coef,
    validate_run,
    validate_sample_limits,
    validate_update,
)

PAIR_TRUNCATION_MODES = ("drop", "error")
"""A pair whose prompt and longer completion exceed data.max_length: dropped (counted) or refused."""
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
"""The values of dpo.loss_type (``reinforge.algorithms.preference_losses``)."""


@dataclass
class PreferenceDataConfig:
    train_files: list[str] = field(default_factory=list)
    """Parquet or JSONL files (or datasets folders) of preference pairs: {prompt, chosen, rejected} (explicit
    prompt) or {chosen, rejected} (implicit: the shared beginning is the prompt); plain text or chat messages."""
    val_files: list[str] = field(default_factory=list)
    """Held-out pairs for the eval_ metrics; empty skips validation."""
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    margin_key: str = "margin"
    """An optional column: the reward model's loss asks r_chosen - r_rejected to exceed it (rm only)."""
    max_length: int = 1024
    """Tokens of the prompt plus one completion."""
    truncation: str = "drop"
    """A longer pair: drop (counted in the log) or error."""
    batch_size: int = 32
    """Pairs per optimizer step."""
    val_batch_size: int = 64
    chat_template: Optional[str] = None
    """A Jinja chat template that overrides the tokenizer's own (conversational pairs): its text, or the path of a file
    holding it."""
    shuffle: bool = True
    seed: int = 1
    max_train_samples: Optional[int] = None
    max_val_samples: Optional[int] = None


@dataclass
class PreferenceTrainerConfig(RunConfig, UpdateConfig):
    """The shared run settings (``RunConfig``), the update's (``UpdateConfig``) and the preference runs' own."""

    output_dir: str = "runs/preference"
    """The run folder: config.yaml, metrics.jsonl, checkpoints/step_N/{actor_state.pt, hf/}."""
    max_tokens_per_micro_batch: Union[int, str] = "auto"
    """Packed tokens of one forward and backward; a pair (its prompt once, both completions) never splits, so a
    number must be at least 2 x data.max_length. auto: on a GPU the memory planner's largest budget that fits
    (with model.gradient_checkpointing=auto, its recompute), on the CPU 16384."""
    router_aux_loss_coef: Optional[Union[float, str]] = None
    """Mixture-of-experts models: weight of the routers' load-balancing loss (transformers' aux loss over all MoE
    layers, a shared prompt's tokens counted once for each completion as in a padded forward), each micro-batch's
    counted for its share of the step's pairs, added to the preference loss; a finite number >= 0, 0: none. None:
    the model config's router_aux_loss_coef when its output_router_logits is true, else 0. declared: the model
    config's router_aux_loss_coef whatever its output_router_logits says, as TRL's DPOTrainer takes it (what
    reinforge.api.DPOConfig passes for TRL's default; reinforge.api.RewardConfig passes 0, as TRL's RewardTrainer
    adds none). A number above 0 on a model without experts is refused before it loads. Logged as train/moe/aux_loss
    either way, beside train/moe/load_imbalance and train/moe/unused_experts."""


@dataclass
class RewardLossConfig:
    center_rewards_coefficient: float = 0.0
    """Adds coefficient x mean((r_chosen + r_rejected)^2), keeping rewards centred on 0 (0.01 is usual)."""


@dataclass
class DPOLossConfig:
    loss_type: str = "sigmoid"
    """sigmoid (DPO), ipo (log-ratios per completion token), hinge (SLiC) or robust (rDPO)."""
    beta: float = 0.1
    """How far the policy may move from the reference: the implicit reward is beta x the log-ratio."""
    label_smoothing: float = 0.0
    """The fraction of pairs assumed mislabelled; read by the robust loss only (sigmoid ignores it, as TRL's)."""
    reference_path: Optional[str] = None
    """The reference model; null: model.path (the policy's starting weights)."""


@dataclass
class RMConfig:
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    """model.path: a causal LM (the score head starts new), or a sequence- or token-classification model (verl's
    reward models), which trains and exports as its own class."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, warmup_ratio=0.03, schedule="cosine"))
    trainer: PreferenceTrainerConfig = field(
        default_factory=lambda: PreferenceTrainerConfig(output_dir="runs/rm", experiment_name="rm"))
    rm: RewardLossConfig = field(default_factory=RewardLossConfig)


@dataclass
class DPOConfig:
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6, warmup_ratio=0.03, schedule="cosine"))
    trainer: PreferenceTrainerConfig = field(
        default_factory=lambda: PreferenceTrainerConfig(output_dir="runs/dpo", experiment_name="dpo"))
    dpo: DPOLossConfig = field(default_factory=DPOLossConfig)


def validate_preference_config(config: RMConfig | DPOConfig) -> None:
    """The checks of an rm or dpo config that need no model: data, budget, loss settings, run and optimizer."""
    data, trainer = config.data, config.trainer
    choose("data.truncation", data.truncation, PAIR_TRUNCATION_MODES)
    for key, value in (("data.batch_size", data.batch_size), ("data.val_batch_size", data.val_batch_size),
                       ("data.max_length", data.max_length)):
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")
    validate_sample_limits(data)  # type: ignore[arg-type]  # the same two fields as SFT's
    validate_model_dtype(config.model.dtype)
    validate_lora(config.model.lora)
    budget = trainer.max_tokens_per_micro_batch
    if isinstance(budget, str) and budget != "auto" or isinstance(budget, bool):
        raise ConfigError(f"trainer.max_tokens_per_micro_batch={budget!r} must be a number of tokens or auto")
    if budget != "auto" and budget < 2 * data.max_length:
        raise ConfigError(f"trainer.max_tokens_per_micro_batch={trainer.max_tokens_per_micro_batch} is smaller than "
                          f"2 x data.max_length={2 * data.max_length}, so one pair (its prompt and both completions) "
                          "may not fit one micro-batch; raise it")
    validate_run(trainer)
    validate_optim("optim", config.optim)
    validate_update("trainer", trainer)
    validate_router_aux_loss_coef("trainer.router_aux_loss_coef", trainer.router_aux_loss_coef)
    if isinstance(config, RMConfig):
        coefficient = config.rm.center_rewards_coefficient
        if not 0.0 <= coefficient < float("inf"):
            raise ConfigError(f"rm.center_rewards_coefficient={coefficient} must be a finite number >= 0 (0.01 is "
                              "usual, 0 turns the centring off)")
        return
    loss = config.dpo
    choose("dpo.loss_type", loss.loss_type, DPO_LOSS_TYPES)
    if not 0.0 < loss.beta < float("inf"):
        raise ConfigError(f"dpo.beta={loss.beta} must be a positive number (0.1 is usual)")
    if not 0.0 <= loss.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing={loss.label_smoothing} must be in [0, 0.5): the fraction of pairs "
                          "assumed mislabelled (the robust loss divides by 1 - 2 x label_smoothing)")


def load_rm_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RMConfig:
    """``reinforge rm``'s config: defaults, the YAML at ``path`` (if any), then ``overrides``, then checks."""
    sources: dict[str, str] = {}
    config = load_structured(RMConfig, path, overrides, sources=sources)
    with naming_sources(sources):
        validate_preference_config(config)
    return config


def load_dpo_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> DPOConfig:
    """``reinforge dpo``'s config: defaults, the YAML at ``path`` (if any), then ``overrides``, then checks."""
    sources: dict[str, str] = {}
    config = load_structured(DPOConfig, path, overrides, sources=sources)
    with naming_sources(sources):
        validate_preference_config(config)
    return config
