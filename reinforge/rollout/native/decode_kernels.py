"""Paged decode attention on the GPU: one query token per sequence against its paged keys and values.

Two layouts of one online softmax (an optional sliding window and score soft-cap in both; grouped query heads
share their KV head's loads):

- Unsplit: one program per (sequence, KV head) loops over the sequence's visible blocks and writes the output.
- Split (flash-decoding): each (sequence, KV head) cuts its visible context into up to ``num_splits`` chunks,
  one program each. A program writes its chunk's running max, sum of exps and unnormalised output (float32);
  a second kernel merges a sequence's chunks in log-sum-exp form. Few, long sequences then still keep every
  SM busy: 8 sequences x 2 KV heads is 16 programs on an H200's 132 SMs, each reading thousands of tokens.

``decode_tiling`` picks the launch (split count, tokens a block, warps, stages) from the batch, the KV heads, the
head size, the SM count and whether the longest context has reached ``SPLIT_MIN_CONTEXT``, nothing else, so a
batch size needs at most two decode graphs however its contexts grow. Short contexts keep the unsplit kernel; long
ones stay unsplit where the batch fills the SMs' waves, else are split (``decode_num_splits``). Each sequence cuts
its own context into chunks of at least ``MIN_CHUNK_TOKENS``: a short sequence in a long batch uses fewer
programs, the ones past its chunks store nothing, and the merge reads only its chunks.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from reinforge.rollout.native.attention import DecodeTiling, SharedPrefix
from reinforge.rollout.native.kv_quant import QuantizedCache, kernel_cache_args

SPLIT_MIN_CONTEXT = 1024
"""The longest context (tokens) from which a decode step splits the context across programs."""
MIN_CHUNK_TOKENS = 256
"""The fewest tokens one split program reads (fewer only for a sequence's last chunk)."""
MAX_SPLITS = 64
"""The most chunks one (sequence, KV head) is cut into."""
PROGRAMS_PER_SM = 8
"""Split programs aimed for per SM: enough loads in flight to keep the memory system busy."""


@triton.jit
def _softcapped(scores, softcap):
    """softcap * tanh(scores / softcap), as transformers caps attention scores (tanh(u) = 1 - 2 / (exp(2u) + 1))."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))


@triton.jit
def _finite_or_zero(maximum):
    """A maximum to subtract before exp: 0 where it is -inf (nothing seen yet; every sum there is 0)."""
    return tl.where(maximum == float("-inf"), 0.0, maximum)


@triton.jit
def _first_visible(context_len, window, HAS_WINDOW: tl.constexpr):
    """The first key position the query (at context_len - 1) sees: context_len - window on for a sliding layer."""
    if HAS_WINDOW:
        first = tl.maximum(context_len - window, 0)
    else:
        first = context_len * 0
    return first


@triton.jit
def _attend_blocks(q, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, table_row_ptr, kv_head, loop_start,
                   loop_end, first_visible, visible_end, scale, softcap, running_max, running_sum, acc, stride_block,
                   stride_token, stride_scale_block, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HEAD_DIM_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, QUANTIZED: tl.constexpr, row_first_visible,
                   PER_ROW: tl.constexpr, ELEMENTWISE: tl.constexpr):
    """The online softmax over positions loop_start..loop_end (a multiple of BLOCK_N apart), of which those in
    first_visible..visible_end count; blocks outside them are never read. PER_ROW: each query row sees only the
    positions from its own ``row_first_visible`` on (at or after first_visible; the rows of several sequences
    reading one shared block table, each with its window). QUANTIZED: the cache holds fp8 vectors,
    each with a float32 scale (kv_quant.py): a key's scale multiplies its scores, a value's its probability.

    Off the IEEE (float32) path the fp8 products run in float16: e4m3 widens to float16 in one instruction per
    pair of values (to bfloat16 it takes another per value, which made the kernel bound by converting), every
    e4m3 value is exact in float16, and the query's bfloat16 values are too above float16's smallest normal.
    The values' weights (probability x scale) are taken times 448, so that they stay in float16's normal range
    (a value's weight is then its probability times its vector's largest magnitude), and the sum divided back.

    ELEMENTWISE: the scores and the weighted values as float32 products and sums on the CUDA cores, not as matrix
    products: a KV head read by one query head (Phi-3, OLMo 2) needs no rows padded to the MMA's 16."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = (dims < HEAD_DIM)[None, :]
    if QUANTIZED and not IEEE:
        q = q.to(tl.float16)
    for start in range(loop_start, loop_end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        valid = (positions < visible_end) & (positions >= first_visible)
        block_ids = tl.load(table_row_ptr + positions // PAGE, mask=valid, other=0).to(tl.int64)
        offsets = (block_ids * stride_block + (positions % PAGE) * stride_token)[:, None] + kv_head * HEAD_DIM \
            + dims[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=valid[:, None] & dim_mask, other=0.0)
        if QUANTIZED:
            scale_offsets = block_ids * stride_scale_block + (positions % PAGE) * NUM_KV_HEADS + kv_head
            k = k.to(q.dtype)  # float16 off the IEEE path (q was widened above)
        if ELEMENTWISE:
            scores = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        elif IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        if QUANTIZED:
            scores = scores * tl.load(k_scales_ptr + scale_offsets, mask=valid, other=0.0)[None, :]
        scores = scores * scale
        if HAS_SOFTCAP:
            scores = _softcapped(scores, softcap)
        if PER_ROW:
            scores = tl.where(valid[None, :] & (positions[None, :] >= row_first_visible[:, None]), scores,
                              float("-inf"))
        else:
            scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # a block with no visible key (only the interpreter visits one) leaves the maximum at -inf
        finite_max = _finite_or_zero(new_max)
        probs = tl.exp(scores - finite_max[:, None])
        correction = tl.exp(running_max - finite_max)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        v = tl.load(v_cache_ptr + offsets, mask=valid[:, None] & dim_mask, other=0.0)
        weights = probs
        if QUANTIZED:
            weights = probs * tl.load(v_scales_ptr + scale_offsets, mask=valid, other=0.0)[None, :]
            if not IEEE:
                weights = weights * 448.0
            v = v.to(q.dtype)
        if ELEMENTWISE:
            acc = acc * correction[:, None] + tl.sum(weights[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:
            acc = acc * correction[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * correction[:, None] + tl.dot(weights.to(v.dtype), v)
        running_max = new_max
    if QUANTIZED and not IEEE:
        acc = acc * (1.0 / 448.0)
    return running_max, running_sum, acc


@triton.jit
def _paged_decode_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr,
                                   context_lens_ptr, out_ptr, scale, softcap, window, stride_q, stride_o, stride_table,
                                   stride_block, stride_token, stride_scale_block, prefix_lens_ptr, state_max_ptr,
                                   state_sum_ptr, state_acc_ptr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                                   HEAD_DIM_PAD: tl.constexpr, PAGE: tl.constexpr,
                                   BLOCK_N: tl.constexpr, IEEE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                                   HAS_WINDOW: tl.constexpr, QUANTIZED: tl.constexpr, STATIC_LOOP_END: tl.constexpr,
                                   HAS_PREFIX: tl.constexpr, HEADS_FIRST: tl.constexpr, ELEMENTWISE: tl.constexpr):
    """HAS_PREFIX: a sequence whose ``prefix_lens`` entry is p > 0 starts from the online softmax's state over its
    first p positions (``_shared_prefix_kernel``'s, in the state buffers) and reads only the positions after them.
    HEADS_FIRST: the grid is (KV heads, sequences), so programs launched together read one token's heads."""
    seq, kv_head = _sequence_and_head(HEADS_FIRST)
    context_len = tl.load(context_lens_ptr + seq)
    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    group_mask = group < GROUP
    mask = group_mask[:, None] & (dims < HEAD_DIM)[None, :]
    heads = kv_head * GROUP + group
    q = tl.load(q_ptr + seq * stride_q + heads[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    first_visible = _first_visible(context_len, window, HAS_WINDOW)
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    if HAS_PREFIX:
        prefix_len = tl.load(prefix_lens_ptr + seq)
        shared = group_mask & (prefix_len > 0)
        rows = seq * NUM_HEADS + heads
        running_max = tl.load(state_max_ptr + rows, mask=shared, other=float("-inf"))
        running_sum = tl.load(state_sum_ptr + rows, mask=shared, other=0.0)
        acc = tl.load(state_acc_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=mask & shared[:, None],
                      other=0.0)
        first_visible = tl.maximum(first_visible, prefix_len)
    # STATIC_LOOP_END is 0 when compiled; Triton's interpreter loops only from and to Python ints (see the launcher)
    running_max, running_sum, acc = _attend_blocks(
        q, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr + seq * stride_table, kv_head,
        0 if STATIC_LOOP_END else (first_visible // BLOCK_N) * BLOCK_N,
        STATIC_LOOP_END if STATIC_LOOP_END else context_len, first_visible, context_len, scale, softcap,
        running_max, running_sum, acc, stride_block, stride_token, stride_scale_block,
        NUM_KV_HEADS, HEAD_DIM, HEAD_DIM_PAD, PAGE, BLOCK_N, IEEE, HAS_SOFTCAP, QUANTIZED, first_visible, False,
        ELEMENTWISE)
    out = acc / running_sum[:, None]
    tl.store(out_ptr + seq * stride_o + heads[:, None] * HEAD_DIM + dims[None, :], out.to(q.dtype), mask=mask)


@triton.jit
def _sequence_and_head(HEADS_FIRST: tl.constexpr):
    """A decode program's (sequence, KV head): the grid's first two axes, in the order HEADS_FIRST says. Programs
    are launched with the first axis varying fastest, so with HEADS_FIRST those launched together read the heads
    of one sequence's tokens, which lie side by side in its cache blocks (a token's K or V is one row of every KV
    head's slice: 6 KB at Phi-3-mini's 32 heads of 96 dims); otherwise one head's slice of many sequences'
    blocks, a few hundred bytes of each row."""
    if HEADS_FIRST:
        seq = tl.program_id(1)
        kv_head = tl.program_id(0)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    return seq, kv_head


@triton.jit
def _shared_prefix_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr,
                          context_lens_ptr, members_ptr, group_prefix_lens_ptr, state_max_ptr, state_sum_ptr,
                          state_acc_ptr, num_rows, scale, softcap, window, stride_q, stride_table, stride_block, stride_token,
                          stride_scale_block, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                          GROUP_PAD: tl.constexpr, MEMBERS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                          HEAD_DIM_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                          HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, QUANTIZED: tl.constexpr,
                          STATIC_LOOP_END: tl.constexpr):
    """One program per (group of sequences sharing their first blocks, KV head): the query rows of every member
    (its heads of this KV head) read the shared blocks once, as one product per block, and each member's state of
    the online softmax over them (max, sum, unnormalised output, float32) goes to the state buffers, from which the
    unsplit kernel goes on over the member's own blocks. ``members`` (groups, MEMBERS_PAD) names each group's
    sequences (-1 pads); the first one's block table is read. A group naming a row outside the batch's
    ``num_rows`` reads and writes nothing."""
    group_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, MEMBERS_PAD * GROUP_PAD)
    member = rows // GROUP_PAD
    in_group = rows % GROUP_PAD
    seq = tl.load(members_ptr + group_id * MEMBERS_PAD + member)
    leader = tl.load(members_ptr + group_id * MEMBERS_PAD)
    whole_group = tl.max(tl.where(seq >= num_rows, 1, 0), axis=0) == 0
    used = (seq >= 0) & (in_group < GROUP) & whole_group
    seq = tl.where(used, seq, 0)
    leader = tl.where(whole_group & (leader >= 0), leader, 0)
    prefix_len = tl.where(whole_group, tl.load(group_prefix_lens_ptr + group_id), 0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = used[:, None] & (dims < HEAD_DIM)[None, :]
    heads = kv_head * GROUP + in_group
    q = tl.load(q_ptr + seq[:, None] * stride_q + heads[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    row_first = _first_visible(tl.load(context_lens_ptr + seq, mask=used, other=0), window, HAS_WINDOW)
    first_read = tl.min(tl.where(used, row_first, prefix_len), axis=0)
    running_max, running_sum, acc = _attend_blocks(
        q, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr + leader * stride_table, kv_head,
        0 if STATIC_LOOP_END else (first_read // BLOCK_N) * BLOCK_N, STATIC_LOOP_END if STATIC_LOOP_END else prefix_len,
        first_read, prefix_len, scale, softcap, tl.full([MEMBERS_PAD * GROUP_PAD], float("-inf"), tl.float32),
        tl.zeros([MEMBERS_PAD * GROUP_PAD], tl.float32), tl.zeros([MEMBERS_PAD * GROUP_PAD, HEAD_DIM_PAD], tl.float32),
        stride_block, stride_token, stride_scale_block, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM_PAD, PAGE, BLOCK_N, IEEE,
        HAS_SOFTCAP, QUANTIZED, row_first, True, False)
    state_rows = seq * NUM_HEADS + heads
    tl.store(state_max_ptr + state_rows, running_max, mask=used)
    tl.store(state_sum_ptr + state_rows, running_sum, mask=used)
    tl.store(state_acc_ptr + state_rows[:, None] * HEAD_DIM + dims[None, :], acc, mask=mask)


@triton.jit
def _chunks(context_len, window, HAS_WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
            MIN_CHUNK_BLOCKS: tl.constexpr):
    """How a sequence's visible context is cut: its first visible position, the block-aligned position its first
    chunk starts at, the BLOCK_N-blocks per chunk, and the number of chunks (at most NUM_SPLITS)."""
    first_visible = _first_visible(context_len, window, HAS_WINDOW)
    base = (first_visible // BLOCK_N) * BLOCK_N
    num_blocks = tl.cdiv(context_len - base, BLOCK_N)
    chunk_blocks = tl.maximum(tl.cdiv(num_blocks, NUM_SPLITS), MIN_CHUNK_BLOCKS)
    return first_visible, base, chunk_blocks, tl.cdiv(num_blocks, chunk_blocks)


@triton.jit
def _paged_decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr,
                               context_lens_ptr, partial_max_ptr, partial_sum_ptr, partial_acc_ptr, scale, softcap,
                               window, stride_q, stride_table, stride_block, stride_token, stride_scale_block,
                               NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                               GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                               PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                               HAS_WINDOW: tl.constexpr, QUANTIZED: tl.constexpr, NUM_SPLITS: tl.constexpr,
                               MIN_CHUNK_BLOCKS: tl.constexpr, STATIC_LOOP_END: tl.constexpr,
                               HEADS_FIRST: tl.constexpr, ELEMENTWISE: tl.constexpr):
    seq, kv_head = _sequence_and_head(HEADS_FIRST)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    first_visible, base, chunk_blocks, num_chunks = _chunks(context_len, window, HAS_WINDOW, NUM_SPLITS, BLOCK_N,
                                                            MIN_CHUNK_BLOCKS)
    # a program past its sequence's chunks loops over nothing and stores nothing
    chunk_start = base + split * chunk_blocks * BLOCK_N
    chunk_end = tl.minimum(chunk_start + chunk_blocks * BLOCK_N, context_len)
    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    group_mask = group < GROUP
    mask = group_mask[:, None] & (dims < HEAD_DIM)[None, :]
    heads = kv_head * GROUP + group
    q = tl.load(q_ptr + seq * stride_q + heads[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    running_max, running_sum, acc = _attend_blocks(
        q, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, block_tables_ptr + seq * stride_table, kv_head,
        0 if STATIC_LOOP_END else chunk_start, STATIC_LOOP_END if STATIC_LOOP_END else chunk_end,
        tl.maximum(first_visible, chunk_start), chunk_end, scale, softcap,
        tl.full([GROUP_PAD], float("-inf"), tl.float32), tl.zeros([GROUP_PAD], tl.float32),
        tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32), stride_block, stride_token, stride_scale_block,
        NUM_KV_HEADS, HEAD_DIM, HEAD_DIM_PAD, PAGE, BLOCK_N, IEEE, HAS_SOFTCAP, QUANTIZED, first_visible, False,
        ELEMENTWISE)
    rows = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
    stored = group_mask & (split < num_chunks)
    tl.store(partial_max_ptr + rows, running_max, mask=stored)
    tl.store(partial_sum_ptr + rows, running_sum, mask=stored)
    tl.store(partial_acc_ptr + rows[:, None] * HEAD_DIM + dims[None, :], acc, mask=mask & stored[:, None])


@triton.jit
def _merge_splits_kernel(partial_max_ptr, partial_sum_ptr, partial_acc_ptr, context_lens_ptr, out_ptr, window,
                         stride_o, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                         HAS_WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                         BLOCK_N: tl.constexpr, MIN_CHUNK_BLOCKS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    _, _, _, num_chunks = _chunks(context_len, window, HAS_WINDOW, NUM_SPLITS, BLOCK_N, MIN_CHUNK_BLOCKS)
    splits = tl.arange(0, SPLITS_PAD)
    used = splits < num_chunks
    rows = (seq * NUM_HEADS + head) * NUM_SPLITS + splits
    split_max = tl.load(partial_max_ptr + rows, mask=used, other=float("-inf"))
    split_sum = tl.load(partial_sum_ptr + rows, mask=used, other=0.0)
    # every chunk holds a visible key, so each used split's maximum and the overall one are finite
    overall_max = tl.max(split_max, axis=0)
    weights = tl.exp(split_max - overall_max)
    total = tl.sum(weights * split_sum, axis=0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    acc = tl.load(partial_acc_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=used[:, None] & dim_mask[None, :],
                  other=0.0)
    out = tl.sum(acc * weights[:, None], axis=0) / total
    tl.store(out_ptr + seq * stride_o + head * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


@cache
def shared_memory_per_program(device: torch.device) -> int | None:
    """The most shared memory (bytes) one program may take on a CUDA device, by opting in (None elsewhere: Triton's
    interpreter has no limit)."""
    if device.type != "cuda":
        return None
    value = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)
    if value:
        return int(value)
    from triton.runtime import driver

    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


@cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the CPU's cores elsewhere, for the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    import os

    return os.cpu_count() or 1


def decode_num_splits(batch: int, num_kv_heads: int, max_context_len: int, sm_count: int) -> int:
    """Programs each (sequence, KV head) of a decode step is split across: 1 while every context is shorter than
    ``SPLIT_MIN_CONTEXT``, else enough for ``PROGRAMS_PER_SM`` programs per SM (at most ``MAX_SPLITS``).

    Depends on the contexts only through that threshold, so a captured decode graph of a batch size stays valid
    as its contexts grow (each sequence still cuts its own context into chunks of ``MIN_CHUNK_TOKENS`` or more).
    """
    if max_context_len < SPLIT_MIN_CONTEXT or batch * num_kv_heads == 0:
        return 1
    return max(1, min(MAX_SPLITS, -(-PROGRAMS_PER_SM * sm_count // (batch * num_kv_heads))))


MANY_SPLITS = 32
"""From this many splits (a few sequences with long contexts) a split program runs 8 warps and 3 stages."""

WAVE_EFFICIENCY = 0.85
"""Past ``SPLIT_MIN_CONTEXT``, a batch whose (sequence, KV head) programs fill the SMs' waves at least this well
(programs / (waves x SMs), one program resident per SM) reads its contexts unsplit, in 128-token blocks."""


SHARED_MEMORY_MARGIN = 16 << 10
"""Shared memory (bytes) a decode attention program takes besides its pipelined K and V blocks (the query, the
layout conversions of its products) in ``fits_shared_memory``'s estimate."""


def fits_shared_memory(block_n: int, head_dim: int, num_stages: int, shared_memory: int | None) -> bool:
    """Whether a program reading ``block_n``-token blocks of K and V in ``num_stages`` stages fits in
    ``shared_memory`` bytes (None: no limit, as in Triton's interpreter). Counted at 2 bytes a value whatever the
    cache holds (an fp8 block is widened to float16 on the way to the products)."""
    if shared_memory is None:
        return True
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    return num_stages * block_n * head_dim_pad * 2 * 2 + SHARED_MEMORY_MARGIN <= shared_memory


def decode_tiling(batch: int, num_kv_heads: int, head_dim: int, max_context_len: int, sm_count: int,
                  quantized: bool, shared_memory: int | None = None, num_heads: int | None = None) -> DecodeTiling:
    """The tiling of a decode step's paged attention on a device of ``sm_count`` SMs whose programs may take
    ``shared_memory`` bytes each (None: no limit), for ``num_heads`` query heads (None: not known).

    Below ``SPLIT_MIN_CONTEXT`` the unsplit kernel in 64-token blocks. Past it, a model-dtype cache of heads of 128
    dims or fewer whose batch alone fills the SMs' waves (``WAVE_EFFICIENCY``) stays unsplit and reads 128-token
    blocks in 3 stages: measured on an H200 (``reinforge bench kernels decode-attention --shape 1.5b-long``; 128
    sequences of 12 query and 2 KV heads of 128 dims) it was the fastest tiling at every context from 1,024 to
    16,384 tokens, 16% faster than 5 splits of 64-token blocks at 1,024 and 2-6% from 4,096 on, with no merge
    kernel; inside the 1.5B decode graph at 128 sequences and 2,175 tokens the step's attention took 2.01 ms
    against 2.16 ms split and merged. At 0.5B's 64-dim heads it took 58 and 166 us at 2,048 and 8,192 tokens
    against 138 and 184 us split. Otherwise the context is split (``decode_num_splits``); an fp8 cache's split
    programs read 128-token blocks in 3 stages too, 20-23% faster than 64-token blocks in 2 stages from 4,096 to
    32,768 tokens (``--fp8``). Like the split count, the tiling depends on the contexts only through
    ``SPLIT_MIN_CONTEXT``, so a captured decode graph stays valid as they grow.

    A model-dtype cache read unsplit by one query head a KV head (every head kept: Phi-3, OLMo 2) launches its
    programs KV heads first (``DecodeTiling.heads_first``), so programs launched together read one token row's
    heads side by side: measured on an H200 (``reinforge bench kernels decode-attention --candidates``) at 512
    sequences of 256, 384 and 640 tokens it read Phi-3-mini's 32 heads of 96 dims 5-7% faster (0.430 against 0.459
    ms a layer at 256) and OLMo-2-1B's 16 of 128 2% faster.

    Stages past what the device's shared memory holds (``fits_shared_memory``: 3 stages of 128-token blocks of
    128-dim heads take 192 KiB, more than an A100's 163) drop to 2, the 128-token tilings to the 64-token ones
    where even 2 stages do not fit (GPUs of about 100 KiB a program), and 64-token blocks to 32-token ones where
    theirs do not (256-dim heads there).
    """
    programs = batch * num_kv_heads
    splits = decode_num_splits(batch, num_kv_heads, max_context_len, sm_count)
    stages = next((stages for stages in (3, 2) if fits_shared_memory(128, head_dim, stages, shared_memory)), None)
    if max_context_len >= SPLIT_MIN_CONTEXT and head_dim <= 128 and stages is not None:
        if quantized:
            return DecodeTiling(splits=splits, block_n=128, num_warps=4, num_stages=stages)
        waves = -(-programs // sm_count) if programs >= sm_count else 0
        if waves and programs / (waves * sm_count) >= WAVE_EFFICIENCY:
            return DecodeTiling(splits=1, block_n=128, num_warps=4, num_stages=stages)
    heads_first = splits == 1 and not quantized and num_heads == num_kv_heads
    if fits_shared_memory(64, head_dim, default_num_stages(splits), shared_memory):
        return DecodeTiling(splits=splits, heads_first=heads_first)
    if fits_shared_memory(64, head_dim, 2, shared_memory):
        return DecodeTiling(splits=splits, num_stages=2, heads_first=heads_first)
    return DecodeTiling(splits=splits, block_n=32, num_stages=2, heads_first=heads_first)


def default_num_warps(head_dim: int, num_splits: int, quantized: bool) -> int:
    """Warps of a decode attention program: 2 for the unsplit bf16 kernel on heads of 64 dims or fewer, 8 for the
    split kernel cut into ``MANY_SPLITS`` or more, else 4.

    Measured on an H200 (``reinforge bench kernels decode-attention``): 512 sequences of 14 query and 2 KV heads of
    64 dims at contexts of 256, 384 and 640 tokens run 9-16% faster on 2 warps than on 4 (``--shape 0.5b``), the
    fastest tiling at each context; 8 sequences of 12 query and 2 KV heads of 128 dims at 8,192 tokens, in 64
    splits, read their cache at 1.30 TB/s on 8 warps and 3 stages against 0.89 on 4 and 2, the fastest tiling there.
    """
    if num_splits >= MANY_SPLITS:
        return 8
    return 2 if head_dim <= 64 and num_splits <= 1 and not quantized else 4


def default_num_stages(num_splits: int) -> int:
    """Pipeline stages of a decode attention program: 3 with ``MANY_SPLITS`` or more splits, else 2."""
    return 3 if num_splits >= MANY_SPLITS else 2


SHARED_PREFIX_MEMBERS = 8
"""The most sequences one shared-prefix program reads for (a larger set sharing blocks is cut into groups of this
many): 8 members of 6 query heads a KV head (Qwen2.5-1.5B) are 64 query rows a product."""


def shared_prefix_arrays(block_tables: np.ndarray, context_lens: np.ndarray, page: int,
                         max_members: int = SHARED_PREFIX_MEMBERS, min_blocks: int = 1
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(members (groups, max_members) int32, -1 padded; each group's shared positions (groups,); each row's shared
    positions (batch,), 0 outside every group) of a decode batch's block tables (batch, max_blocks) and contexts.

    A group is rows whose tables start with the same block (at most ``max_members`` of them: a larger set is cut
    into several), sharing the whole blocks all of them start with, ``min_blocks`` or more, each below every
    member's context. A table entry below 0 (a block given back, outside a window) is never shared. Numpy over the
    whole batch at once: it runs on the host at every decode step."""
    batch = len(context_lens)
    no_groups = (np.full((0, max_members), -1, np.int32), np.zeros(0, np.int32), np.zeros(batch, np.int32))
    if batch < 2 or block_tables.shape[1] == 0:
        return no_groups
    first = block_tables[:, 0]
    rows = np.flatnonzero((first >= 0) & (context_lens > page))
    rows = rows[np.argsort(first[rows], kind="stable")]
    if len(rows) < 2:
        return no_groups
    starts = np.flatnonzero(np.r_[True, first[rows][1:] != first[rows][:-1]])  # runs of one first block
    run = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(rows)]))
    rank = np.arange(len(rows)) - starts[run]
    chunk_starts = np.flatnonzero(np.r_[True, (run[1:] != run[:-1]) | (rank[1:] % max_members == 0)])
    chunk = np.repeat(np.arange(len(chunk_starts)), np.diff(np.r_[chunk_starts, len(rows)]))
    leaders = rows[chunk_starts][chunk]
    tables = block_tables[rows]
    same = (tables == block_tables[leaders]) & (tables >= 0)
    leading = np.cumprod(same, axis=1).sum(axis=1)  # each row's leading blocks shared with its chunk's first
    whole = np.minimum(leading, context_lens[rows] // page)
    shared = np.minimum.reduceat(whole, chunk_starts)
    sizes = np.diff(np.r_[chunk_starts, len(rows)])
    kept = (sizes >= 2) & (shared >= min_blocks)
    if not kept.any():
        return no_groups
    index = np.full(len(chunk_starts), -1)
    index[kept] = np.arange(int(kept.sum()))
    members = np.full((int(kept.sum()), max_members), -1, np.int32)
    in_kept = kept[chunk]
    members[index[chunk][in_kept], (np.arange(len(rows)) - chunk_starts[chunk])[in_kept]] = rows[in_kept]
    group_lens = (shared[kept] * page).astype(np.int32)
    prefix_lens = np.zeros(batch, np.int32)
    prefix_lens[rows[in_kept]] = group_lens[index[chunk][in_kept]]
    return members, group_lens, prefix_lens


def shared_prefix(block_tables: list[list[int]] | np.ndarray, context_lens: list[int] | np.ndarray, page: int,
                  device: torch.device | str, max_members: int = SHARED_PREFIX_MEMBERS,
                  min_blocks: int = 1) -> SharedPrefix | None:
    """``shared_prefix_arrays`` as the kernels' tensors; None when no sequences share a block."""
    members, group_lens, prefix_lens = shared_prefix_arrays(np.asarray(block_tables), np.asarray(context_lens), page,
                                                            max_members, min_blocks)
    if not len(group_lens):
        return None
    return SharedPrefix(*(torch.from_numpy(array).to(device) for array in (members, group_lens, prefix_lens)))


def paged_decode_attention(q: Tensor, k_cache: Tensor | QuantizedCache, v_cache: Tensor | QuantizedCache,
                           block_tables: Tensor, context_lens: Tensor,
                           scale: float, softcap: float | None = None, window: int | None = None, block_n: int = 64,
                           num_warps: int | None = None, num_stages: int | None = None,
                           num_splits: int | None = None,
                           min_chunk_tokens: int | None = None, prefix: SharedPrefix | None = None,
                           heads_first: bool = False, elementwise: bool = False) -> Tensor:
    """One query token per sequence against its paged keys and values.

    q: (batch, heads, head_dim); k_cache, v_cache: (num_blocks, block_size, kv_heads, head_dim), or fp8
    ``QuantizedCache``s (kv_quant.py: each vector dequantised by its scale as it is read);
    block_tables: (batch, max_blocks) int32; context_lens: (batch,) int32. softcap: scores become
    softcap * tanh(scores / softcap); window: the query sees only the last ``window`` keys (itself included),
    and blocks before them are never read (their table entries may name blocks given back to the pool).
    num_splits: chunks of each context read by separate programs and merged (1: the unsplit kernel); None
    picks ``decode_num_splits`` from the longest context (a device read: the engine passes it from the host);
    min_chunk_tokens: the fewest tokens a split program reads, a sequence's last chunk aside (None:
    ``MIN_CHUNK_TOKENS``). num_warps, num_stages: None gives ``default_num_warps``, ``default_num_stages``.
    prefix: groups of sequences whose first blocks are the same blocks (``shared_prefix``), read once a group
    (the unsplit kernel only). heads_first: programs launched together read one sequence's KV heads, not one head
    of many sequences (``_sequence_and_head``). elementwise: scores and values as float32 products on the CUDA
    cores, the query heads of a KV head not padded to 16 rows (``_attend_blocks``). Returns (batch, heads, head_dim).
    """
    batch, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    quantized = isinstance(k_cache, QuantizedCache)
    k_values, v_values, k_scales, v_scales, stride_scale_block = kernel_cache_args(k_cache, v_cache, q)
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a view into the fused q|k|v output
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, int(context_lens.max()), num_sms(q.device))
    num_splits = min(num_splits, MAX_SPLITS)
    if num_warps is None:
        num_warps = default_num_warps(head_dim, num_splits, quantized)
    if num_stages is None:
        num_stages = default_num_stages(num_splits)
    block_n = max(block_n, page, 16)
    # compiled, each program loops over its own blocks; Triton's interpreter cannot loop from or to a loaded
    # value, so there every program loops over the longest context (blocks outside its range are masked)
    static_loop_end = int(context_lens.max()) if _INTERPRETED else 0
    group_pad = triton.next_power_of_2(group) if elementwise else max(16, triton.next_power_of_2(group))
    shared = dict(NUM_KV_HEADS=num_kv_heads, QUANTIZED=quantized, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
                  HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), PAGE=page, BLOCK_N=block_n,
                  IEEE=q.dtype == torch.float32, HAS_SOFTCAP=softcap is not None, HAS_WINDOW=window is not None,
                  STATIC_LOOP_END=static_loop_end, num_warps=num_warps, num_stages=num_stages)
    if num_splits <= 1:
        state: tuple[Tensor, ...] = (context_lens,) * 4  # not read without a prefix
        if prefix is not None:
            state = _shared_prefix_state(q, k_values, v_values, k_scales, v_scales, block_tables, context_lens,
                                         scale, softcap, window, stride_scale_block, prefix, shared)
        _paged_decode_attention_kernel[(num_kv_heads, batch) if heads_first else (batch, num_kv_heads)](
            q, k_values, v_values, k_scales, v_scales, block_tables, context_lens, out, scale, softcap or 1.0,
            window or 0, q.stride(0), out.stride(0), block_tables.stride(0), k_values.stride(0), k_values.stride(1),
            stride_scale_block, *state, NUM_HEADS=num_heads, HAS_PREFIX=prefix is not None, HEADS_FIRST=heads_first,
            ELEMENTWISE=elementwise, **shared)
        return out
    if prefix is not None:
        raise ValueError("a shared prefix is read by the unsplit kernel only (num_splits=1)")
    min_chunk_blocks = max(1, (min_chunk_tokens or MIN_CHUNK_TOKENS) // block_n)
    partial_max = torch.empty(2, batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    partial_acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    _paged_decode_split_kernel[(num_kv_heads, batch, num_splits) if heads_first else (batch, num_kv_heads, num_splits)](
        q, k_values, v_values, k_scales, v_scales, block_tables, context_lens, partial_max[0], partial_max[1],
        partial_acc, scale, softcap or 1.0, window or 0, q.stride(0), block_tables.stride(0), k_values.stride(0),
        k_values.stride(1), stride_scale_block, NUM_HEADS=num_heads, NUM_SPLITS=num_splits, MIN_CHUNK_BLOCKS=min_chunk_blocks,
        HEADS_FIRST=heads_first, ELEMENTWISE=elementwise, **shared)
    _merge_splits_kernel[(batch, num_heads)](
        partial_max[0], partial_max[1], partial_acc, context_lens, out, window or 0, out.stride(0),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=shared["HEAD_DIM_PAD"], HAS_WINDOW=window is not None,
        NUM_SPLITS=num_splits, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), BLOCK_N=block_n,
        MIN_CHUNK_BLOCKS=min_chunk_blocks, num_warps=4)
    return out


def _shared_prefix_state(q: Tensor, k_values: Tensor, v_values: Tensor, k_scales: Tensor, v_scales: Tensor,
                         block_tables: Tensor, context_lens: Tensor, scale: float, softcap: float | None,
                         window: int | None, stride_scale_block: int, prefix: SharedPrefix, shared: dict
                         ) -> tuple[Tensor, ...]:
    """(each sequence's shared positions, and the online softmax's max, sum and output over them) for the unsplit
    kernel: ``_shared_prefix_kernel`` over every group."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, group = shared["NUM_KV_HEADS"], shared["GROUP"]
    group_pad = triton.next_power_of_2(group)
    members_pad = max(triton.next_power_of_2(prefix.members.shape[1]), -(-16 // group_pad))
    members = prefix.members
    if members.shape[1] < members_pad:
        members = torch.nn.functional.pad(members, (0, members_pad - members.shape[1]), value=-1)
    state_max = torch.empty(2, batch, num_heads, dtype=torch.float32, device=q.device)
    state_acc = torch.empty(batch, num_heads, head_dim, dtype=torch.float32, device=q.device)
    static_loop_end = int(prefix.group_prefix_lens.max()) if _INTERPRETED else 0
    _shared_prefix_kernel[(members.shape[0], num_kv_heads)](
        q, k_values, v_values, k_scales, v_scales, block_tables, context_lens, members, prefix.group_prefix_lens,
        state_max[0], state_max[1], state_acc, batch, scale, softcap or 1.0, window or 0, q.stride(0),
        block_tables.stride(0), k_values.stride(0), k_values.stride(1), stride_scale_block, NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=group_pad, MEMBERS_PAD=members_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=shared["HEAD_DIM_PAD"], PAGE=shared["PAGE"], BLOCK_N=shared["BLOCK_N"],
        IEEE=shared["IEEE"], HAS_SOFTCAP=shared["HAS_SOFTCAP"], HAS_WINDOW=shared["HAS_WINDOW"],
        QUANTIZED=shared["QUANTIZED"], STATIC_LOOP_END=static_loop_end, num_warps=shared["num_warps"],
        num_stages=shared["num_stages"])
    return prefix.prefix_lens, state_max[0], state_max[1], state_acc


_INTERPRETED = isinstance(_paged_decode_attention_kernel, InterpretedFunction)
"""Triton runs the kernels in its interpreter (``TRITON_INTERPRET=1`` when this module was imported)."""
