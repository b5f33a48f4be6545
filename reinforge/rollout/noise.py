"""Seeded Gumbel noise: the randomness of both rollout backends, a pure function of seeds and positions.

Each sample of a request gets a 63-bit seed from (request seed, sample index) (``sample_seed``).
The token a sample draws at a position (its index in prompt + response) takes the argmax of
its tempered logits plus Gumbel noise, -log(-log(u)), where u comes from a 32-bit integer
hash (lowbias32) of the column under a key hashed from (sample seed, position). Nothing
depends on the batch a sample runs in, the step it runs at or the device. The native
engine's Triton sampler computes the same hashes in its kernel; ``gumbel_noise`` is the
PyTorch form (the hf backend and the native engine's PyTorch path), so with the same logits
both backends draw the same tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_SEED_MULTIPLIER = 0x9E3779B97F4A7C15
_INDEX_MULTIPLIER = 0xBF58476D1CE4E5B9
_POSITION_MULTIPLIER = 0x5851F42D4C957F2D
_COLUMN_MULTIPLIER = 0x9E3779B1


def sample_seed(request_seed: int, sample_index: int) -> int:
    """A 63-bit seed for sample ``sample_index`` of a request, stable across runs and machines."""
    value = (request_seed * _SEED_MULTIPLIER + sample_index * _INDEX_MULTIPLIER) & _MASK64
    value ^= value >> 31
    return value & 0x7FFFFFFFFFFFFFFF


def _lowbias32(x):
    """A 32-bit integer hash of each value (Python ints, or int64 tensors holding 32-bit values)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def noise_keys(sample_seeds: list[int], positions: list[int], device: torch.device | str = "cpu") -> Tensor:
    """(rows,) int64 keys, one per (sample seed, position of the token being drawn)."""
    keys = []
    for seed, position in zip(sample_seeds, positions, strict=True):
        mixed = (seed + position * _POSITION_MULTIPLIER) & _MASK64  # 64-bit wrap-around, as the kernel's
        keys.append(_lowbias32((mixed ^ (mixed >> 32)) & _MASK32))
    return torch.tensor(keys, dtype=torch.int64, device=device)


def gumbel_noise(keys: Tensor, vocab_size: int) -> Tensor:
    """Gumbel noise (rows, vocab) float32 for ``noise_keys``' keys (on their device)."""
    columns = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    bits = _lowbias32(((columns * _COLUMN_MULTIPLIER) & _MASK32)[None, :] ^ keys[:, None])
    return -torch.log(-torch.log(uniform_from_bits(bits)))


def uniform_from_bits(bits: Tensor) -> Tensor:
    """Uniforms in (0, 1), float32, from 32-bit hashes (int64 tensors): the top 23 bits plus a half, over 2^23.

    Every value is exact in float32 and lies in [2^-24, 1 - 2^-24]. (24 bits plus a half is not exact: its top
    value rounds to 1.0, whose noise is +inf, and about one sampled token in a hundred over a 150k vocabulary
    would then be a uniformly random token.)
    """
    return ((bits >> 9).float() + 0.5) * (1.0 / 8388608.0)
