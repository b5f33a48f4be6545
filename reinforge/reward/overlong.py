"""DAPO's soft overlong punishment: a penalty that grows linearly over the last tokens of the budget.

A response of ``L`` tokens under a budget of ``max_length`` with a buffer of ``buffer`` tokens
gets ``min(-(L - (max_length - buffer)) / buffer * factor, 0)``: nothing up to
``max_length - buffer`` tokens, then down to ``-factor`` at ``max_length``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, factor: float) -> Tensor:
    """The penalty (<= 0) of each response length; lengths (batch,) int. Returns (batch,) float32."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"reward.overlong_buffer.len={buffer} must be in 1..data.max_response_length={max_length}")
    exceed = lengths.float() - (max_length - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0)
