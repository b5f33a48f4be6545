"""The memory planner's standard workload for plan tests: one H200 (139 GiB), the native engine, 64 prompts x 8
samples of 128 prompt and 512 response tokens. Test modules import it with ``tests/`` on ``sys.path``."""

from __future__ import annotations

from pathlib import Path

from reinforge.config import Config

QWEN25_1_5B = dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                   num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=True, model_type="qwen2")
"""Qwen2.5-1.5B's config.json, less its architectures."""


def standard_config(policy: str | Path) -> Config:
    """The standard workload's config for the policy at ``policy`` (a folder with its config.json)."""
    config = Config()
    config.model.path = str(policy)
    config.trainer.device = "cuda"
    config.trainer.gpu_memory_gib = 139.0
    config.rollout.name = "native"
    config.data.train_batch_size, config.rollout.n = 64, 8
    config.data.max_prompt_length, config.data.max_response_length = 128, 512
    return config
