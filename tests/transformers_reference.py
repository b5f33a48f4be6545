"""What transformers itself gives for a prompt: greedy tokens from ``generate`` and log-probs from one forward.

Tests of the native engine compare with these. Test modules import it with ``tests/`` on ``sys.path`` (pytest
imports them by path), as they do ``forked_python``.
"""

from __future__ import annotations

import torch


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``max_new_tokens`` greedy tokens after ``prompt`` (no end-of-sequence stop), on the model's device."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt], device=device)
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return output[0, len(prompt):].tolist()


def recomputed_log_probs(model: torch.nn.Module, prompt: list[int], tokens: list[int],
                         temperature: float = 1.0) -> torch.Tensor:
    """(len(tokens),) float32 log-probs of ``tokens`` after ``prompt`` at ``temperature``, from one forward, on the CPU."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens], device=device)).logits[0, len(prompt) - 1:-1].float()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    return log_probs.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0].cpu()
