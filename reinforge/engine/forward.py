"""Forward passes over ``[prompt | response]`` rows: response log-probs, entropy, values.

Position ``t`` of the response is predicted by the logits at the token before it, so the
slice we need is ``logits[:, -response_length - 1 : -1]``. Logits are divided by the rollout
temperature: the sampler drew from ``softmax(logits / T)``, and the policy ratio must compare
like with like.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from reinforge.algorithms import entropy_from_logits, log_probs_from_logits
from reinforge.protocol import Batch


def model_inputs(micro: Batch) -> dict[str, Tensor]:
    return {"input_ids": micro["input_ids"], "attention_mask": micro["attention_mask"],
            "position_ids": micro["position_ids"]}


def response_log_probs(model: nn.Module, micro: Batch, temperature: float = 1.0,
                       with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each response token (B, R) and, if asked, the entropy at each position."""
    responses = micro["responses"]
    logits = model(**model_inputs(micro), use_cache=False).logits
    logits = logits[:, -responses.shape[1] - 1:-1].float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    log_probs = log_probs_from_logits(logits, responses)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return log_probs, entropy


def response_values(model: nn.Module, micro: Batch) -> Tensor:
    """Value of the state before each response token (B, R), float32."""
    values = model(**model_inputs(micro))
    return values[:, -micro["responses"].shape[1] - 1:-1].float()


def build_position_ids(attention_mask: Tensor) -> Tensor:
    """0, 1, 2, ... over the real tokens of each row; padding positions get 0."""
    return (torch.cumsum(attention_mask, dim=-1) - 1).clamp(min=0) * attention_mask
