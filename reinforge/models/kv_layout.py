"""Bytes of the native engine's paged KV cache, per block, for its model-dtype and fp8 layouts.

The rollout engine allocates its cache by these sizes and the memory planner and the bandwidth floor count
by them, so a plan's pool holds the blocks the engine asks for and a floor reads the bytes a step reads.

- model dtype (``kv_cache_dtype="auto"``): ``entries`` vectors of ``heads x head_dim`` values per token
  (K and V; one latent entry for latent attention), each value ``dtype_bytes``;
- fp8: per token and KV head, ``head_dim`` float8 e4m3 values and one float32 scale
  (``rollout/native/kv_quant.py``), for K and V: a 128-dim head takes 132 bytes against bf16's 256.

A model whose full and sliding layers keep separate pools (Gemma 2 and 3, Qwen2 with ``max_window_layers``)
splits its cache bytes between them by ``window_pool_blocks`` and ``split_pool_blocks``: the engine sizes its
pools by them and the planner asks for the bytes that give every sequence of a step its blocks.
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


def window_pool_blocks(window: int | None, max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The most blocks a pool whose layers attend through ``window`` keys (None: the whole context) can use at
    once: every sequence at ``max_model_len`` and the token a decode step launched ahead writes; with a window,
    one such full-length sequence (a prefill) and every other sequence's window and the block it fills, plus one."""
    full = -(-(max_model_len + 1) // block_size)
    useful = max_num_seqs * full
    if window is not None:
        useful = min(useful, full + (max_num_seqs - 1) * (-(-(window - 1) // block_size) + 2))
    return useful


def pool_blocks(first: float, caps: list[int]) -> list[float]:
    """Each pool's blocks when the first (full attention) pool has ``first`` (whole blocks in the engine, a
    fraction in a plan for part of the sequences): no pool more than it can use."""
    return [min(first, cap) for cap in caps]


def split_pool_blocks(budget: float, block_bytes: list[float], caps: list[int]) -> list[int]:
    """Each pool's blocks from ``budget`` bytes: the largest first-pool count F (at least 1) whose pools
    ``pool_blocks(F, caps)``, at ``block_bytes`` a block each, fit the budget."""

    def cost(first: int) -> float:
        return sum(size * count for size, count in zip(block_bytes, pool_blocks(first, caps), strict=True))

    low, high = 0, caps[0]
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if cost(middle) <= budget else (low, middle - 1)
    return pool_blocks(max(low, 1), caps)
