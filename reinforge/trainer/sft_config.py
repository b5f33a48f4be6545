"""The SFT run's typed configuration and its loading: defaults, then a YAML file, then ``a.b=c``.

SFT has its own small schema (data, model, optim, trainer) rather than sections of the RL
``Config``; the model and optimizer sections are the RL ones, so a key means the same in both.
Unknown keys fail with the closest valid one, as ``reinforge train`` does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from reinforge.config.loader import ConfigError, load_structured
from reinforge.config.schema import ModelConfig, OptimConfig, RunConfig
from reinforge.config.validate import validate_optim, validate_run

TRUNCATION_MODES = ("drop", "right", "error")


@dataclass
class SFTDataConfig:
    train_files: list[str] = field(default_factory=list)
    """Parquet or JSONL files (or datasets folders) whose rows hold chat ``messages``."""
    val_files: list[str] = field(default_factory=list)
    """Held-out conversations for the validation loss; empty skips validation."""
    messages_key: str = "messages"
    """Column with the list of {role, content} messages."""
    max_length: int = 1024
    """Tokens of one conversation (and of one packed row) after the chat template."""
    truncation: str = "drop"
    """A conversation longer than max_length: drop (reported), right (cut its end) or error."""
    packing: bool = False
    """Concatenate conversations into rows of up to max_length tokens; attention stays within each."""
    batch_size: int = 32
    """Rows (conversations, or packed rows) per optimizer step."""
    val_batch_size: int = 64
    chat_template: Optional[str] = None
    """A Jinja chat template that overrides the tokenizer's own."""
    shuffle: bool = True
    seed: int = 1
    max_train_samples: Optional[int] = None
    max_val_samples: Optional[int] = None


@dataclass
class SFTTrainerConfig(RunConfig):
    """The shared run settings (``RunConfig``: folder, steps, cadence, resume, loggers) and SFT's own."""

    output_dir: str = "runs/sft"
    """The run folder: config.yaml, metrics.jsonl, checkpoints/step_N/{actor_state.pt, hf/}."""
    experiment_name: str = "sft"
    max_tokens_per_micro_batch: int = 16384
    """Token budget of one forward/backward; gradients are accumulated over micro-batches."""
    grad_clip: float = 1.0


@dataclass
class SFTConfig:
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, warmup_ratio=0.03, schedule="cosine"))
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)


def load_sft_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> SFTConfig:
    """Defaults, then the YAML file at ``path`` (if any), then ``overrides`` (``a.b=c`` strings), then checks."""
    config = load_structured(SFTConfig, path, overrides)
    validate_sft_config(config)
    return config


def validate_sft_config(config: SFTConfig) -> None:
    data, trainer = config.data, config.trainer
    if data.truncation not in TRUNCATION_MODES:
        raise ConfigError(f"data.truncation={data.truncation!r} is not one of {', '.join(TRUNCATION_MODES)}")
    for key, value in (("data.batch_size", data.batch_size), ("data.val_batch_size", data.val_batch_size),
                       ("data.max_length", data.max_length)):
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")
    if trainer.max_tokens_per_micro_batch < data.max_length:
        raise ConfigError(f"trainer.max_tokens_per_micro_batch={trainer.max_tokens_per_micro_batch} is smaller than "
                          f"data.max_length={data.max_length}, so one conversation may not fit; raise it")
    validate_run(trainer)
    validate_optim("optim", config.optim)
