"""Tiny Qwen2, Qwen3 and Llama models built in code, and helpers comparing with transformers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

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
    else:
        raise ValueError(architecture)
    return model.to(device).eval()


def random_prompts(lengths: list[int], seed: int = 1, vocab_size: int = 128) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt], device=device)
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return output[0, len(prompt):].tolist()


def recomputed_log_probs(model: torch.nn.Module, prompt: list[int], tokens: list[int],
                         temperature: float = 1.0) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens], device=device)).logits[0, len(prompt) - 1:-1].float()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    return log_probs.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0].cpu()


@pytest.fixture(scope="session")
def tiny():
    """The helpers above, for tests (pytest imports test modules by path, so they cannot import conftest)."""
    return SimpleNamespace(build=build_tiny, prompts=random_prompts, hf_greedy=hf_greedy,
                           recomputed_log_probs=recomputed_log_probs)
