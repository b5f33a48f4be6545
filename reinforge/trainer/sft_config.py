"""The SFT run's typed configuration and its loading: defaults, then a YAML file, then ``a.b=c``.

SFT has its own small schema (data, model, optim, trainer) rather than sections of the RL
``Config``; the model and optimizer sections are the RL ones, so a key means the same in both.
Unknown keys fail with the closest valid one, as ``reinforge train`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from reinforge.config.loader import ConfigError, schema_keys, suggest_key
from reinforge.config.schema import ModelConfig, OptimConfig

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
class SFTTrainerConfig:
    output_dir: str = "runs/sft"
    """The run folder: config.yaml, metrics.jsonl, checkpoints/step_N/{actor_state.pt, hf/}."""
    total_epochs: int = 1
    total_steps: Optional[int] = None
    """Stop after this many optimizer steps; None runs total_epochs over the data."""
    max_tokens_per_micro_batch: int = 16384
    """Token budget of one forward/backward; gradients are accumulated over micro-batches."""
    grad_clip: float = 1.0
    seed: int = 1
    device: str = "auto"
    """auto (cuda when available), cuda or cpu."""
    test_every: int = 0
    """Validation loss every this many steps (and before and after training); 0: before and after only."""
    save_every: int = 0
    """Checkpoint every this many steps (and at the end); 0 saves only at the end."""
    keep_last: int = 2
    resume: str = "auto"
    """auto (latest checkpoint in output_dir), never, or a checkpoint path."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    project_name: str = "reinforge"
    experiment_name: str = "sft"


@dataclass
class SFTConfig:
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, warmup_ratio=0.03, schedule="cosine"))
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)


def load_sft_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> SFTConfig:
    """Defaults, then the YAML file at ``path`` (if any), then ``overrides`` (``a.b=c`` strings), then checks."""
    merged = OmegaConf.structured(SFTConfig)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass a YAML file with data:, model:, optim:, "
                              "trainer: sections, or only a.b=c overrides")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"{path} is not valid YAML: {error}") from error
        if not isinstance(tree, Mapping):
            raise ConfigError(f"{path} must hold a mapping of sections (data:, model:, ...), not {type(tree).__name__}")
        merged = _merge(merged, tree, f"from {path.name}")
    overrides = list(overrides)
    if overrides:
        merged = _merge(merged, _overrides_to_tree(overrides), "command line")
    config: SFTConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
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
    if trainer.total_steps is None and trainer.total_epochs < 1:
        raise ConfigError("trainer.total_epochs must be at least 1 when trainer.total_steps is unset")
    if config.optim.schedule not in ("constant", "cosine"):
        raise ConfigError(f"optim.schedule={config.optim.schedule!r} is not one of constant, cosine")


def _merge(base: Any, tree: Mapping[str, Any], source: str) -> Any:
    known = schema_keys(SFTConfig)
    _check_keys(tree, source, known)
    try:
        return OmegaConf.merge(base, tree)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "a value"
        raise ConfigError(f"{key} ({source}) has a value of the wrong type: {error.msg}") from error


def _check_keys(tree: Mapping[str, Any], source: str, known: dict[str, Any], prefix: str = "") -> None:
    sections = {key for key in known if any(other.startswith(key + ".") for other in known)}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if dotted not in known:
            close = suggest_key(dotted, known)
            hint = f"; did you mean {close}?" if close else "; see reinforge/trainer/sft_config.py for the keys"
            raise ConfigError(f"unknown key {dotted} ({source}){hint}")
        if dotted in sections:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{dotted}={value!r} ({source}) is a section; set its keys, e.g. {dotted}.<key>=...")
            _check_keys(value, source, known, prefix=f"{dotted}.")


def _overrides_to_tree(overrides: Iterable[str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} (command line) is not of the form key=value, e.g. optim.lr=1e-5")
        key, raw = item.split("=", 1)
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} (command line) sets a key below a value")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return tree
