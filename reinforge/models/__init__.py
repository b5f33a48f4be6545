"""Models: loading causal LMs and tokenizers, the PPO critic, tiny test models, and HF-folder export."""

from reinforge.models.export import atomic_folder, save_hf_folder
from reinforge.models.loading import (
    check_model_folder,
    enable_gradient_checkpointing,
    load_causal_lm,
    load_tokenizer,
    resolve_dtype,
    warn_if_beyond_context,
    warn_if_rollout_parts_from_training,
)
from reinforge.models.tiny import build_char_tokenizer, build_tiny_causal_lm, save_tiny_model
from reinforge.models.value_model import ValueModel

__all__ = [
    "ValueModel",
    "atomic_folder",
    "build_char_tokenizer",
    "build_tiny_causal_lm",
    "check_model_folder",
    "enable_gradient_checkpointing",
    "load_causal_lm",
    "load_tokenizer",
    "resolve_dtype",
    "save_hf_folder",
    "save_tiny_model",
    "warn_if_beyond_context",
    "warn_if_rollout_parts_from_training",
]
