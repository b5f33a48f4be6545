"""The SFT run's typed configuration: data, model, optim, trainer.

SFT has its own small schema rather than sections of the RL ``Config``; the model and
optimizer sections are the RL ones and the trainer section extends the shared ``RunConfig`` and
``UpdateConfig``, so a key means the same in both. Loaded by ``config.loader.load_sft_config`` and checked by
``config.validate.validate_sft_config``, like the RL config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from reinforge.config.schema import ModelConfig, OptimConfig, RunConfig, UpdateConfig

SFT_TRUNCATION_MODES = ("drop", "right", "error")
"""The values of the SFT data.truncation."""
SFT_LOSS_TOKENS = ("assistant", "all")
"""The values of data.loss_on."""


@dataclass
class SFTDataConfig:
    train_files: list[str] = field(default_factory=list)
    """Parquet or JSONL files (or datasets folders) whose rows hold chat ``messages``, a ``prompt`` and a
    ``completion`` (two strings, or two lists of chat messages), or a ``text``."""
    val_files: list[str] = field(default_factory=list)
    """Held-out conversations for the validation loss; empty skips validation."""
    messages_key: str = "messages"
    """Column with the list of {role, content} messages."""
    text_key: str = "text"
    """Column of a plain text row, trained whole (TRL's dataset_text_field)."""
    image_key: Optional[str] = None
    """Column of a conversation's images (a list, or one image); None reads ``images``, else ``image``."""
    min_pixels: Optional[int] = None
    """A vision-language model's image, in pixels, at least: the processor scales a smaller one up (its
    ``size.shortest_edge``, Qwen2-VL's min_pixels). None keeps the model folder's preprocessor_config.json."""
    max_pixels: Optional[int] = None
    """A vision-language model's image, in pixels, at most: the processor scales a larger one down (its
    ``size.longest_edge``, Qwen2-VL's max_pixels; an image's tokens are its pixels over (patch_size * merge_size)^2).
    None keeps the model folder's. Prompts, rollouts, tool images and training all see the image resized so."""
    max_length: int = 1024
    """Tokens of one conversation (and of one packed row) after the chat template."""
    truncation: str = "drop"
    """A conversation longer than max_length: drop (reported), right (cut its end) or error."""
    loss_on: str = "assistant"
    """The tokens the loss covers: assistant (each assistant turn of a conversation, the completion of a
    prompt/completion row) or all (every token of the row, as TRL trains a 'messages' row unless
    assistant_only_loss=True). A 'text' row is trained whole either way."""
    packing: bool = False
    """Concatenate conversations into rows of up to max_length tokens; attention stays within each."""
    batch_size: int = 32
    """Rows (conversations, or packed rows) per optimizer step."""
    val_batch_size: int = 64
    chat_template: Optional[str] = None
    """A Jinja chat template that overrides the tokenizer's own: its text, or the path of a file holding it (read when
    the config loads)."""
    shuffle: bool = True
    seed: int = 1
    max_train_samples: Optional[int] = None
    max_val_samples: Optional[int] = None


@dataclass
class SFTTrainerConfig(RunConfig, UpdateConfig):
    """The shared run settings (``RunConfig``: folder, steps, cadence, resume, loggers), the update's
    (``UpdateConfig``: micro-batch budget, gradient clipping) and SFT's own."""

    output_dir: str = "runs/sft"
    """The run folder: config.yaml, metrics.jsonl, checkpoints/step_N/{actor_state.pt, hf/}."""
    experiment_name: str = "sft"
    max_tokens_per_micro_batch: int = 16384
    """SFT has no memory planner: a fixed budget, at least data.max_length."""
    router_aux_loss_coef: Optional[Union[float, str]] = None
    """Mixture-of-experts models: weight of the routers' load-balancing loss (transformers' aux loss over all MoE
    layers and every unpadded token, a packed row's conversations counted as in a padded forward) added to the
    token-mean loss, as actor.router_aux_loss_coef is to the actor's; a finite number >= 0, 0: none. None: the model
    config's router_aux_loss_coef when its output_router_logits is true, else 0. declared: the model config's
    router_aux_loss_coef whatever its output_router_logits says, as TRL's SFTTrainer takes it (what
    reinforge.api.SFTConfig passes for TRL's default). A number above 0 on a model without experts is refused before
    it loads. Logged as train/moe/aux_loss either way, beside train/moe/load_imbalance and train/moe/unused_experts."""


@dataclass
class SFTConfig:
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, warmup_ratio=0.03, schedule="cosine"))
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
