"""Masked reductions: sum, mean, variance and whitening over the valid entries of a tensor.

A mask is 1 (or True) where an entry counts and 0 where it is padding or a tool token. We
follow verl's conventions (Bessel-corrected variance, 1e-8 inside the rsqrt of whitening)
with two departures, both so that a degenerate micro-batch never stops a run: a mean over
no valid entries is 0, and the unbiased variance of fewer than two entries is 0 (verl
raises). ``masked_whiten`` writes 0 at masked positions (verl leaves them arbitrary).
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of values where mask is set; over everything (dim=None) or along dim."""
    masked_values = torch.where(mask.bool(), values, torch.zeros_like(values))
    if dim is None:
        return masked_values.sum()
    return masked_values.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of values where mask is set; 0 where there are no valid entries.

    values, mask: same shape. dim=None reduces to a scalar, otherwise along dim.
    """
    total = masked_sum(values, mask, dim)
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return total / count.clamp_min(1e-8)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of all valid entries (a scalar), Bessel-corrected by default.

    Fewer than two valid entries give 0 with unbiased=True.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if not unbiased:
        return variance
    count = mask.to(values.dtype).sum()
    # torch.where rather than an `if`: no host sync on the GPU.
    bessel = count / (count - 1).clamp_min(1)
    return torch.where(count >= 2, variance * bessel, torch.zeros_like(variance))


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(values - mean) / sqrt(var + 1e-8) over the valid entries; 0 at masked positions.

    shift_mean=False adds the mean back (only rescales). Same shape as values.
    """
    mean = masked_mean(values, mask)
    variance = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
