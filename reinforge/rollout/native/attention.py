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

A prefill after a prefix-cache hit (an agent's next turn: a few dozen new tokens over a context
of hundreds) runs, on CUDA in bf16/fp16, as one flash varlen call (``packed_prefix_attention``)
over each sequence's whole context gathered by slot (``context_slots``), its causal mask aligned
to the end of the keys; the reference pads every sequence to the longest context and builds a
dense mask in every layer, which on an H200 costs as much as some 25 decode steps.
``flash_prefix_applies`` probes the kernel once per device against the reference. Soft-capped layers
(Gemma 2) prefill on CUDA, with or without a cached prefix, through the Triton kernels of
``packed_attention/softcap_kernels.py``, unpadded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor

from reinforge.packed_attention import padded_packed_attention
from reinforge.packed_attention.softcap_kernels import softcap_kernel_runs_on, softcap_varlen_attention
from reinforge.rollout.native.kv_quant import QuantizedCache


@dataclass(frozen=True)
class DecodeTiling:
    """How a decode step's paged attention is launched: the chunks each (sequence, KV head) is split into, the
    tokens a loop iteration reads, warps and pipeline stages (None: ``decode_kernels.default_num_warps``,
    ``default_num_stages``)."""

    splits: int = 1
    block_n: int = 64
    num_warps: int | None = None
    num_stages: int | None = None
    heads_first: bool = False
    """The grid's order: programs launched together read one sequence's KV heads (True) or one KV head of many
    sequences (``decode_kernels._sequence_and_head``). ``decode_tiling`` chooses it for a KV head read by one query
    head on the unsplit model-dtype path."""
    elementwise: bool = False
    """Scores and values as float32 products on the CUDA cores instead of matrix products (no query rows padded
    to 16; ``decode_kernels._attend_blocks``). Not chosen by ``decode_tiling``: an option for the tilings bench
    (``reinforge bench kernels decode-attention``), where it measured slower at every shape timed."""

    def options(self) -> dict[str, int | bool | None]:
        """``paged_decode_attention``'s keyword arguments for this tiling."""
        return dict(num_splits=self.splits, block_n=self.block_n, num_warps=self.num_warps,
                    num_stages=self.num_stages, heads_first=self.heads_first, elementwise=self.elementwise)


@dataclass
class SharedPrefix:
    """Sequences of a decode batch that share their first blocks (the n samples of a prompt share its full
    blocks): each group's shared blocks are read once for all its members (``decode_kernels._shared_prefix_kernel``)."""

    members: Tensor
    """(groups, members) int32: each group's sequences (rows of the batch), -1 where a group has fewer."""
    group_prefix_lens: Tensor
    """(groups,) int32: the positions the group's members share (whole blocks)."""
    prefix_lens: Tensor
    """(batch,) int32: each sequence's shared positions, 0 for one in no group."""


@dataclass
class AttentionMetadata:
    """Where each token's keys and values go, and what each query may see.

    slot_mapping: (tokens,) cache slot (block * block_size + offset) of each token's k and v.
    Prefill: seq_lens lists the packed sequences' lengths; batch_index, token_index (tokens,)
    place each packed token in a (num_seqs, max_seq_len) grid.
    Decode: block_tables (batch, max_blocks) and context_lens (batch,), one token per sequence;
    decode_tiling, how the Triton path launches the paged attention (``decode_kernels.decode_tiling``: split count,
    block, warps, stages; fixed when a decode graph is captured).
    Prefill after a prefix-cache hit: also block_tables and context_lens (every token, cached ones
    included), prefix_lens (num_seqs,), the cached tokens before each sequence's first packed one, and
    max_context_len, the largest context length (known on the host: reading it from context_lens would
    wait for the device at every layer). prefix_visible maps a sliding window (None: none) to the mask
    (num_seqs, 1, max_len, max_context_len) of the keys each query sees; the first layer of each window makes
    it and the others reuse it. For the packed path:
    context_slots (context tokens,) the cache slot of every token of every sequence's context, in order,
    context_lengths those contexts' lengths, and cu_seqlens_q / cu_seqlens_k (num_seqs + 1,) int32, the
    packed queries' and contexts' offsets.
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
    prefix_visible: dict[int | None, Tensor] = field(default_factory=dict)
    context_slots: Tensor | None = None
    context_lengths: list[int] | None = None
    cu_seqlens_q: Tensor | None = None
    cu_seqlens_k: Tensor | None = None
    decode_tiling: DecodeTiling = DecodeTiling()
    shared_prefix: SharedPrefix | None = None
    """Decode: the groups of sequences whose first blocks are the same (``SharedPrefix``), read once
    a group by the unsplit Triton kernel; None: each sequence reads its own."""
    per_layer: list[AttentionMetadata] | None = None
    """Each layer's metadata when the layers' caches form several groups (``model_runner.layer_groups``: a group's
    slots and block tables are its own); None: every layer reads this one."""


def per_layer_metadata(layer_groups: list[list[int]], group_metas: list[AttentionMetadata]) -> list[AttentionMetadata]:
    """Each layer's metadata when the layers' caches form groups: ``group_metas[g]`` for the layers of
    ``layer_groups[g]``."""
    per_layer: list[AttentionMetadata] = [group_metas[0]] * sum(len(layers) for layers in layer_groups)
    for layers, group_meta in zip(layer_groups, group_metas, strict=True):
        for layer in layers:
            per_layer[layer] = group_meta
    return per_layer


def write_kv_cache(k: Tensor, v: Tensor, k_cache: Tensor | QuantizedCache, v_cache: Tensor | QuantizedCache,
                   slot_mapping: Tensor) -> None:
    """k, v: (tokens, kv_heads, dim) into caches of shape (num_blocks, block_size, kv_heads, dim) (fp8 ones
    quantise each vector, kv_quant.py)."""
    if isinstance(k_cache, QuantizedCache):
        k_cache.write(k, slot_mapping)
        v_cache.write(v, slot_mapping)
        return
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v


def cache_rows(cache: Tensor | QuantizedCache, slots: Tensor) -> Tensor:
    """The cached vectors at ``slots`` (block * block_size + offset): (len(slots), kv_heads, dim), dequantised
    from an fp8 cache."""
    if isinstance(cache, QuantizedCache):
        return cache.rows(slots)
    return cache.flatten(0, 1).index_select(0, slots)


def attend(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float, softcap: float | None) -> Tensor:
    """Masked attention as transformers computes it. q: (batch, heads, queries, dim); k, v: (batch, heads, keys,
    dim); visible: bool, broadcast to (batch, heads, queries, keys). A soft-cap (softcap * tanh(scores / softcap)
    on the scaled scores, before the mask) runs transformers' eager math: SDPA has no soft-cap."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def visible_keys(query_positions: Tensor, key_positions: Tensor, window: int | None) -> Tensor:
    """Whether each key is visible to each query: causal, and within the last ``window`` positions (the query
    included) when the layer slides. Broadcasts query_positions (..., queries, 1) against key_positions (keys,)."""
    visible = key_positions <= query_positions
    if window is not None:
        visible &= key_positions > query_positions - window
    return visible


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata, scale: float,
                      window: int | None = None, softcap: float | None = None) -> Tensor:
    """Causal attention within each packed sequence (within its last ``window`` keys when the layer slides).
    q: (tokens, heads, dim); k, v: (tokens, kv_heads, dim)."""
    assert meta.seq_lens is not None and meta.batch_index is not None and meta.token_index is not None
    num_seqs, max_len = len(meta.seq_lens), max(meta.seq_lens)
    if softcap is not None and q.is_cuda and softcap_kernel_runs_on(q.device, q.dtype, q.shape[-1]):
        if meta.cu_seqlens_q is None:  # made by the first layer, read by the others
            meta.cu_seqlens_q = torch.tensor([0, *accumulate(meta.seq_lens)], dtype=torch.int32, device=q.device)
        return softcap_varlen_attention(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, max_len, max_len, scale,
                                        softcap, window)
    group = q.shape[1] // k.shape[1]

    def to_grid(x: Tensor) -> Tensor:
        grid = x.new_zeros(num_seqs, max_len, *x.shape[1:])
        grid[meta.batch_index, meta.token_index] = x
        return grid.transpose(1, 2)

    if window is not None and window >= max_len:  # no sequence is longer than the window: plain causal
        window = None
    q_grid, k_grid, v_grid = to_grid(q), to_grid(k).repeat_interleave(group, dim=1), \
        to_grid(v).repeat_interleave(group, dim=1)
    # right padding: with a causal mask a real query only ever sees real keys
    if window is None and softcap is None:
        out = F.scaled_dot_product_attention(q_grid, k_grid, v_grid, is_causal=True, scale=scale)
    else:
        positions = torch.arange(max_len, device=q.device)
        out = attend(q_grid, k_grid, v_grid, visible_keys(positions[:, None], positions, window), scale, softcap)
    return out.transpose(1, 2)[meta.batch_index, meta.token_index]


def prefill_attention_with_prefix(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                                  scale: float, window: int | None = None, softcap: float | None = None) -> Tensor:
    """Causal attention of each sequence's packed tokens over its cached and new keys (all already in the cache).

    q: (tokens, heads, dim); caches: (num_blocks, block_size, kv_heads, dim). The query at packed index i of a
    sequence sits at position prefix_len + i and sees the keys at positions 0..prefix_len + i (the last
    ``window`` of them when the layer slides).
    """
    assert meta.seq_lens is not None and meta.max_context_len > 0
    num_seqs, max_len = len(meta.seq_lens), max(meta.seq_lens)
    if (softcap is not None and q.is_cuda and meta.context_slots is not None and meta.cu_seqlens_q is not None
            and softcap_kernel_runs_on(q.device, q.dtype, q.shape[-1])):  # what a prefill graph runs (no tables)
        k = cache_rows(k_cache, meta.context_slots)  # (context tokens, kv_heads, dim)
        v = cache_rows(v_cache, meta.context_slots)
        return softcap_varlen_attention(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, max_len, meta.max_context_len,
                                        scale, softcap, window)
    assert meta.block_tables is not None and meta.context_lens is not None
    assert meta.prefix_lens is not None and meta.batch_index is not None and meta.token_index is not None
    group = q.shape[1] // k_cache.shape[2]
    max_context = meta.max_context_len
    block_tables = meta.block_tables[:, : -(-max_context // k_cache.shape[1])].long()

    def gather(cache: Tensor) -> Tensor:
        tokens = cache[block_tables].flatten(1, 2)[:, :max_context]  # (num_seqs, context, kv_heads, dim)
        return tokens.transpose(1, 2).repeat_interleave(group, dim=1)

    grid = q.new_zeros(num_seqs, max_len, *q.shape[1:])
    grid[meta.batch_index, meta.token_index] = q
    if window not in meta.prefix_visible:
        query_positions = meta.prefix_lens[:, None] + torch.arange(max_len, device=q.device)[None, :]
        key_positions = torch.arange(max_context, device=q.device)
        visible = visible_keys(query_positions[:, :, None], key_positions, window) \
            & (key_positions[None, None, :] < meta.context_lens[:, None, None])
        visible[:, :, 0] |= ~visible.any(dim=-1)  # a padding query (past its sequence) sees key 0: no empty row
        meta.prefix_visible[window] = visible[:, None]
    out = attend(grid.transpose(1, 2), gather(k_cache), gather(v_cache), meta.prefix_visible[window], scale, softcap)
    return out.transpose(1, 2)[meta.batch_index, meta.token_index]


def packed_prefix_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                            scale: float, window: int | None = None) -> Tensor:
    """What ``prefill_attention_with_prefix`` computes, from each sequence's context gathered by slot, unpadded.

    On CUDA in bf16/fp16: the flash varlen kernel (key/value heads shared by their query heads in the
    kernel, the causal mask aligned to the end of each sequence's keys, a sliding window as the kernel's
    left window of ``window - 1`` keys). Elsewhere: the same packed inputs through one masked SDPA call (what
    the tests compare with the reference); a sliding layer there runs the reference itself."""
    assert meta.context_slots is not None and meta.cu_seqlens_q is not None and meta.cu_seqlens_k is not None
    assert meta.seq_lens is not None and meta.context_lengths is not None
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        k = cache_rows(k_cache, meta.context_slots)  # (context tokens, kv_heads, dim)
        v = cache_rows(v_cache, meta.context_slots)
        windowed = {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
        return torch.ops.aten._flash_attention_forward(
            q.contiguous(), k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, max(meta.seq_lens), meta.max_context_len,
            0.0, True, False, scale=scale, **windowed)[0]
    if window is not None:
        return prefill_attention_with_prefix(q, k_cache, v_cache, meta, scale, window)
    k = cache_rows(k_cache, meta.context_slots)
    v = cache_rows(v_cache, meta.context_slots)
    return padded_packed_attention(q, k, v, meta.seq_lens, meta.context_lengths, scale)


@cache
def flash_prefix_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``packed_prefix_attention`` runs the flash kernel on ``device`` in ``dtype`` and agrees with the
    reference there (probed once: two sequences, one with a cached prefix, random values)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        block_size, kv_heads, heads, dim = 4, 2, 4, 64
        caches = torch.randn(2, 8, block_size, kv_heads, dim, device=device, dtype=dtype, generator=generator)
        q = torch.randn(5, heads, dim, device=device, dtype=dtype, generator=generator)
        # sequence 0: 3 new tokens after 6 cached (blocks 2, 5, 1); sequence 1: 2 tokens, nothing cached (block 7)
        meta = AttentionMetadata(
            slot_mapping=torch.empty(0, device=device), is_prefill=True, seq_lens=[3, 2],
            batch_index=torch.tensor([0, 0, 0, 1, 1], device=device),
            token_index=torch.tensor([0, 1, 2, 0, 1], device=device),
            block_tables=torch.tensor([[2, 5, 1], [7, 0, 0]], device=device),
            context_lens=torch.tensor([9, 2], dtype=torch.int32, device=device),
            prefix_lens=torch.tensor([6, 0], device=device), max_context_len=9,
            context_slots=torch.tensor([8, 9, 10, 11, 20, 21, 22, 23, 4, 28, 29], device=device),
            context_lengths=[9, 2],
            cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32, device=device),
            cu_seqlens_k=torch.tensor([0, 9, 11], dtype=torch.int32, device=device))
        expected = prefill_attention_with_prefix(q.float(), caches[0].float(), caches[1].float(), meta, dim ** -0.5)
        got = packed_prefix_attention(q, caches[0], caches[1], meta, dim ** -0.5)
        agrees = bool(torch.allclose(got.float(), expected, atol=3e-2, rtol=3e-2))
    except (RuntimeError, NotImplementedError, AttributeError) as error:  # no flash kernel for this device or build
        import warnings

        warnings.warn(f"the flash prefix prefill is unavailable ({error}); using the padded reference", stacklevel=2)
        return False
    if not agrees:
        import warnings

        warnings.warn("the flash prefix prefill disagrees with the reference on this device; using the reference",
                      stacklevel=2)
    return agrees


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float,
                     window: int | None = None, softcap: float | None = None) -> Tensor:
    """One query per sequence against its cached tokens (the last ``window`` of them when the layer slides).
    q: (batch, heads, dim). Gathers blocks; not graph-safe."""
    assert meta.block_tables is not None and meta.context_lens is not None
    batch, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[2]
    max_context = int(meta.context_lens.max())
    block_tables = meta.block_tables[:, : -(-max_context // k_cache.shape[1])].long()

    def gather(cache: Tensor) -> Tensor:
        tokens = cache[block_tables].flatten(1, 2)[:, :max_context]  # (batch, context, kv_heads, dim)
        return tokens.transpose(1, 2).repeat_interleave(group, dim=1)

    query_positions = (meta.context_lens.long() - 1)[:, None]
    visible = visible_keys(query_positions, torch.arange(max_context, device=q.device), window)
    out = attend(q[:, :, None, :], gather(k_cache), gather(v_cache), visible[:, None, None, :], scale, softcap)
    return out[:, :, 0, :]
