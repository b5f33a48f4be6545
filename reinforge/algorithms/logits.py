"""Per-token log-probabilities and entropies from a model's logits.

log_softmax over a large vocabulary is the biggest tensor of an RL step, so
``log_probs_from_logits`` avoids materialising a float32 copy of bfloat16/float16 logits: it
works a slice of rows at a time. Results are float32 for low-precision logits (a bfloat16
log-prob has only about three significant digits, too few for a PPO ratio); verl returns the
logits' dtype. ``entropy_from_logits`` is the plain formula, the reference that the fused
pass of ``engine.log_probs`` is tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def log_probs_from_logits(logits: Tensor, labels: Tensor, chunk_size: int = 1024) -> Tensor:
    """log softmax(logits)[label] for every position.

    logits: (..., vocab); labels: (...) int64. Returns (...), float32 or the logits' dtype if wider.
    """
    if logits.dtype not in _LOW_PRECISION:
        label_logits = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return label_logits - torch.logsumexp(logits, dim=-1)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    pieces = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        chunk = flat_logits[start : start + chunk_size].float()
        chunk_labels = flat_labels[start : start + chunk_size]
        label_logits = chunk.gather(-1, chunk_labels.unsqueeze(-1)).squeeze(-1)
        pieces.append(label_logits - torch.logsumexp(chunk, dim=-1))
    return torch.cat(pieces).reshape(labels.shape)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits): logsumexp(logits) - sum(softmax * logits).

    logits: (..., vocab). Returns (...) in the logits' dtype.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
