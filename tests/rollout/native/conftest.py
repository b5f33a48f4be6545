"""Tiny Qwen2, Qwen3 and Llama models built in code, and the helpers comparing with transformers (tests/
transformers_reference.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parents[2]))
from transformers_reference import hf_greedy, recomputed_log_probs  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=256)


def build_tiny(architecture: str, device: str = "cpu", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if architecture == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY))
    elif architecture == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, head_dim=16))
    elif architecture == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, rope_theta=500000.0))
    else:  # any family of the architecture table, reinforge's tiny config of it
        from reinforge.models.tiny import build_tiny_causal_lm

        model = build_tiny_causal_lm(architecture, vocab_size=TINY["vocab_size"], seed=seed)
    return model.to(device).eval()


def random_prompts(lengths: list[int], seed: int = 1, vocab_size: int = 128) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for length in lengths]


@pytest.fixture(scope="session")
def tiny():
    """The helpers of this folder, for tests (pytest imports test modules by path, so they cannot import conftest)."""
    return SimpleNamespace(build=build_tiny, prompts=random_prompts, hf_greedy=hf_greedy,
                           recomputed_log_probs=recomputed_log_probs)
