"""Bytes of the native engine's paged KV cache, per block, for its model-dtype and fp8 layouts.

The rollout engine allocates its cache by these sizes and the memory planner and the bandwidth floor count
by them, so a plan's pool holds the blocks the engine asks for and a floor reads the bytes a step reads.

- model dtype (``kv_cache_dtype="auto"``): ``entries`` vectors of ``heads x head_dim`` values per token
  (K and V; one latent entry for latent attention), each value ``dtype_bytes``;
- fp8: per token and KV head, ``head_dim`` float8 e4m3 values and one float32 scale
  (``rollout/native/kv_quant.py``), for K and V: a 128-dim head takes 132 bytes against bf16's 256.
"""

from __future__ import annotations

FP8_SCALE_BYTES = 4
"""One float32 scale per (token, KV head) vector of an fp8 cache."""


def fp8_block_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block of one layer's K (or V) in the fp8 layout: the values, then one scale per vector."""
    return block_size * num_kv_heads * (head_dim + FP8_SCALE_BYTES)


def kv_block_bytes(num_layers: int, entries: int, num_kv_heads: int, head_dim: int, block_size: int,
                   kv_cache_dtype: str, dtype_bytes: float) -> float:
    """Bytes of one block of ``block_size`` tokens over every layer: ``entries`` (2: K and V) vectors of
    ``num_kv_heads x head_dim`` per token, in the model dtype (``dtype_bytes`` a value) or fp8 with its scales."""
    if kv_cache_dtype == "fp8":
        return num_layers * entries * fp8_block_bytes(block_size, num_kv_heads, head_dim)
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of auto, fp8 (rollout.kv_cache_dtype)")
    return num_layers * entries * block_size * num_kv_heads * head_dim * dtype_bytes
