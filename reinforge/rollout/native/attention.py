"""Attention over a paged KV cache: what one forward needs to know, and the PyTorch path.

Tokens of a step are packed (no padding between sequences). A prefill step attends causally
within each sequence's own tokens (the n samples of a prompt are forked after its prefill);
when some sequence of the step starts with blocks from the prefix cache, its new tokens also
attend to the cached ones, so that step reads every key and value from the cache through the
block tables (``prefill_attention_with_prefix``; written first, as in a decode step, on the
PyTorch and the Triton path alike); a decode step attends from one new token per sequence to
all of that sequence's cached tokens through its block table. The PyTorch functions here run
everywhere and are the reference; on CUDA the engine uses the Triton kernels instead
(``triton_kernels.py``), which compute the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class AttentionMetadata:
    """Where each token's keys and values go, and what each query may see.

    slot_mapping: (tokens,) cache slot (block * block_size + offset) of each token's k and v.
    Prefill: seq_lens lists the packed sequences' lengths; batch_index, token_index (tokens,)
    place each packed token in a (num_seqs, max_seq_len) grid.
    Decode: block_tables (batch, max_blocks) and context_lens (batch,), one token per sequence.
    Prefill after a prefix-cache hit: also block_tables and context_lens (every token, cached ones
    included), prefix_lens (num_seqs,), the cached tokens before each sequence's first packed one, and
    max_context_len, the largest context length (known on the host: reading it from context_lens would
    wait for the device at every layer). prefix_visible (num_seqs, 1, max_len, max_context_len) says which
    keys each query sees; the first layer makes it and the others reuse it.
    """

    slot_mapping: Tensor
    is_prefill: bool
    seq_lens: list[int] | None = None
    batch_index: Tensor | None = None
    token_index: Tensor | None = None
    block_tables: Tensor | None = None
    context_lens: Tensor | None = None
    prefix_lens: Tensor | None = None
    max_context_len: int = 0
    prefix_visible: Tensor | None = None


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x*cos + rotate_half(x)*sin, as transformers computes it. x: (tokens, heads, dim); cos, sin: (tokens, dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def write_kv_cache(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """k, v: (tokens, kv_heads, dim) into caches of shape (num_blocks, block_size, kv_heads, dim)."""
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """Causal attention within each packed sequence. q: (tokens, heads, dim); k, v: (tokens, kv_heads, dim)."""
    assert meta.seq_lens is not None and meta.batch_index is not None and meta.token_index is not None
    num_seqs, max_len = len(meta.seq_lens), max(meta.seq_lens)
    group = q.shape[1] // k.shape[1]

    def to_grid(x: Tensor) -> Tensor:
        grid = x.new_zeros(num_seqs, max_len, *x.shape[1:])
        grid[meta.batch_index, meta.token_index] = x
        return grid.transpose(1, 2)

    # right padding: with a causal mask a real query only ever sees real keys
    out = F.scaled_dot_product_attention(
        to_grid(q), to_grid(k).repeat_interleave(group, dim=1), to_grid(v).repeat_interleave(group, dim=1),
        is_causal=True, scale=scale)
    return out.transpose(1, 2)[meta.batch_index, meta.token_index]


def prefill_attention_with_prefix(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                                  scale: float) -> Tensor:
    """Causal attention of each sequence's packed tokens over its cached and new keys (all already in the cache).

    q: (tokens, heads, dim); caches: (num_blocks, block_size, kv_heads, dim). The query at packed index i of a
    sequence sits at position prefix_len + i and sees the keys at positions 0..prefix_len + i.
    """
    assert meta.seq_lens is not None and meta.block_tables is not None and meta.context_lens is not None
    assert meta.prefix_lens is not None and meta.batch_index is not None and meta.token_index is not None
    assert meta.max_context_len > 0
    num_seqs, max_len = len(meta.seq_lens), max(meta.seq_lens)
    group = q.shape[1] // k_cache.shape[2]
    max_context = meta.max_context_len
    block_tables = meta.block_tables[:, : -(-max_context // k_cache.shape[1])].long()

    def gather(cache: Tensor) -> Tensor:
        tokens = cache[block_tables].flatten(1, 2)[:, :max_context]  # (num_seqs, context, kv_heads, dim)
        return tokens.transpose(1, 2).repeat_interleave(group, dim=1)

    grid = q.new_zeros(num_seqs, max_len, *q.shape[1:])
    grid[meta.batch_index, meta.token_index] = q
    if meta.prefix_visible is None:
        query_positions = meta.prefix_lens[:, None] + torch.arange(max_len, device=q.device)[None, :]
        key_positions = torch.arange(max_context, device=q.device)
        # padding queries (past a sequence's length) still see key 0, so no row is all masked
        visible = (key_positions[None, None, :] <= query_positions[:, :, None]) \
            & (key_positions[None, None, :] < meta.context_lens[:, None, None])
        meta.prefix_visible = visible[:, None]
    out = F.scaled_dot_product_attention(grid.transpose(1, 2), gather(k_cache), gather(v_cache),
                                         attn_mask=meta.prefix_visible, scale=scale)
    return out.transpose(1, 2)[meta.batch_index, meta.token_index]


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """One query per sequence against its cached tokens. q: (batch, heads, dim). Gathers blocks; not graph-safe."""
    assert meta.block_tables is not None and meta.context_lens is not None
    batch, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[2]
    max_context = int(meta.context_lens.max())
    block_tables = meta.block_tables[:, : -(-max_context // k_cache.shape[1])].long()

    def gather(cache: Tensor) -> Tensor:
        tokens = cache[block_tables].flatten(1, 2)[:, :max_context]  # (batch, context, kv_heads, dim)
        return tokens.transpose(1, 2).repeat_interleave(group, dim=1)

    visible = torch.arange(max_context, device=q.device)[None, :] < meta.context_lens[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None, :], gather(k_cache), gather(v_cache),
                                         attn_mask=visible[:, None, None, :], scale=scale)
    return out[:, :, 0, :]
