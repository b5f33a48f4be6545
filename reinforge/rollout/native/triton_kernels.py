"""Triton kernels of the native engine's GPU path, each with its launcher.

Fused residual-add + RMSNorm (the llama, gemma and olmo kinds), rotary embedding (whole or
partial, or none) fused with the KV-cache write, SiLU- or tanh-GELU-and-mul (of one gate|up
tensor), paged decode attention (``decode_kernels.py``, re-exported here) and the sampler (temperature and a per-row threshold,
Gumbel-max with noise from an integer hash of (row key, column), log-prob of the sampled
token). The sampler splits each row's vocabulary across programs that read their slice once,
keeping an online max and sum-exp and the best score with its first column; a small kernel
merges each row's slices. The elementwise kernels round intermediates to the model dtype where
transformers does, so greedy decoding stays close to ``generate`` in bf16. Importing this
module needs Triton; the engine imports it only on CUDA (tests also run it under
``TRITON_INTERPRET=1`` on the CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import libdevice

from reinforge.rollout.native.decode_kernels import _INTERPRETED, _finite_or_zero, _softcapped, paged_decode_attention
from reinforge.rollout.native.kv_quant import QuantizedCache, kernel_cache_args

__all__ = ["act_and_mul", "paged_decode_attention", "rms_norm", "rope_and_write_cache", "sample", "silu_and_mul"]

NORM_KINDS = {"llama": 0, "gemma": 1, "olmo": 2}
"""RMSNorm kinds (``ArchitectureSpec.norm``): llama rounds the normalised value to the model dtype before the weight;
gemma multiplies by (1 + w) in float32 and olmo by w in float32, each rounding only the product."""


@triton.jit
def _normalized(x, inverse, weight, NORM_KIND: tl.constexpr):
    """x (any shape, the model dtype) times its rows' 1 / RMS ``inverse`` and the float32 ``weight``, as
    ``NORM_KINDS`` says for ``NORM_KIND``; float32."""
    x32 = x.to(tl.float32)
    if NORM_KIND == 0:
        return (x32 * inverse).to(x.dtype).to(tl.float32) * weight
    if NORM_KIND == 1:
        return x32 * inverse * (1.0 + weight)
    return x32 * inverse * weight


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, num_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, NORM_KIND: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / num_cols
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = _normalized(x, tl.rsqrt(variance + eps), weight, NORM_KIND)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, kind: str = "llama") -> Tensor:
    """RMSNorm of ``x`` (or of ``x + residual``, stored back into ``residual``) over the last dim.

    x: (rows, dim) or (rows, heads, dim), the last dim contiguous; residual like x (updated in place);
    kind: one of ``NORM_KINDS``.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    residual2 = residual.view(-1, shape[-1]) if residual is not None else x2
    num_cols = shape[-1]
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, residual2, weight, out, x2.stride(0), residual2.stride(0), out.stride(0), num_cols, eps,
        HAS_RESIDUAL=residual is not None, NORM_KIND=NORM_KINDS[kind], BLOCK=triton.next_power_of_2(num_cols),
        num_warps=4)
    return out.view(shape)


@triton.jit
def _rotate_heads(x_ptr, stride_x, cos1, cos2, sin1, sin2, token, heads, head_mask, half_mask,
                  HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """The rotated first and second halves of the rotary dims of ``heads`` of one token (float32, rounded as
    transformers rounds: each product to the model dtype)."""
    half = tl.arange(0, HALF_PAD)
    mask = head_mask[:, None] & half_mask[None, :]
    base = x_ptr + token * stride_x + heads[:, None] * HEAD_DIM + half[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    out1 = (x1 * cos1[None, :]).to(dtype).to(tl.float32) + (-(x2 * sin1[None, :])).to(dtype).to(tl.float32)
    out2 = (x2 * cos2[None, :]).to(dtype).to(tl.float32) + (x1 * sin2[None, :]).to(dtype).to(tl.float32)
    return out1.to(dtype), out2.to(dtype), base, mask


@triton.jit
def _quantized(x, inverse_scale, cache_ptr, ROUND_FIRST: tl.constexpr):
    """x (rows, dims) times its row's 1 / scale, in the fp8 cache's dtype (rounded to nearest, ties to even).

    ROUND_FIRST (Triton's interpreter, whose cast to fp8 drops the carry when a mantissa rounds up into the next
    power of two): round to e4m3's 3 mantissa bits in float32 first, so the cast itself is exact."""
    scaled = x.to(tl.float32) * inverse_scale[:, None]
    if ROUND_FIRST:
        bits = scaled.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 of float32's 23 mantissa bits
        scaled = bits.to(tl.float32, bitcast=True)
    return scaled.to(cache_ptr.dtype.element_ty)


@triton.jit
def _norm_heads_in_place(x_ptr, stride_x, token, heads, head_mask, weight_ptr, eps, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_PAD: tl.constexpr, NORM_KIND: tl.constexpr):
    """RMSNorm of each of ``heads`` of one token over its dims, written back in place (``_normalized``)."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = head_mask[:, None] & (dims < HEAD_DIM)[None, :]
    pointers = x_ptr + token * stride_x + heads[:, None] * HEAD_DIM + dims[None, :]
    x = tl.load(pointers, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    inverse = tl.rsqrt(tl.sum(x32 * x32, axis=1) / HEAD_DIM + eps)[:, None]
    weight = tl.load(weight_ptr + dims, mask=dims < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
    tl.store(pointers, _normalized(x, inverse, weight, NORM_KIND).to(x.dtype), mask=mask)


@triton.jit
def _rope_and_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, k_cache_ptr, v_cache_ptr,
                           k_scales_ptr, v_scales_ptr, q_norm_ptr, k_norm_ptr, eps, stride_q, stride_k, stride_v,
                           stride_cos, stride_block, stride_token, stride_scale_block,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                           KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                           HALF: tl.constexpr, HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr, PAGE: tl.constexpr,
                           QUANTIZED: tl.constexpr, ROUND_FIRST: tl.constexpr, QK_NORM: tl.constexpr,
                           NORM_KIND: tl.constexpr):
    token = tl.program_id(0)
    kv_heads = tl.arange(0, KV_HEADS_PAD)
    kv_mask = kv_heads < NUM_KV_HEADS
    if QK_NORM:  # each head of q and k normalised in place first (Qwen3, Gemma 3), then rotated as below
        q_heads = tl.arange(0, HEADS_PAD)
        _norm_heads_in_place(q_ptr, stride_q, token, q_heads, q_heads < NUM_HEADS, q_norm_ptr, eps, HEAD_DIM,
                             HEAD_DIM_PAD, NORM_KIND)
        _norm_heads_in_place(k_ptr, stride_k, token, kv_heads, kv_mask, k_norm_ptr, eps, HEAD_DIM, HEAD_DIM_PAD,
                             NORM_KIND)
        tl.debug_barrier()  # the stores above are read back by other threads of the program
    slot = tl.load(slots_ptr + token).to(tl.int64)
    block, offset = slot // PAGE, slot % PAGE
    cache_row = block * stride_block + offset * stride_token + kv_heads[:, None] * HEAD_DIM
    scale_row = block * stride_scale_block + offset * NUM_KV_HEADS + kv_heads
    k_amax = tl.zeros([KV_HEADS_PAD], tl.float32)  # fp8: each head vector's largest magnitude
    if HALF > 0:  # the first 2 * HALF dims rotate (all of them unless the rotary factor is partial)
        position = tl.load(positions_ptr + token)
        half = tl.arange(0, HALF_PAD)
        half_mask = half < HALF
        cos1 = tl.load(cos_ptr + position * stride_cos + half, mask=half_mask, other=0.0)
        cos2 = tl.load(cos_ptr + position * stride_cos + HALF + half, mask=half_mask, other=0.0)
        sin1 = tl.load(sin_ptr + position * stride_cos + half, mask=half_mask, other=0.0)
        sin2 = tl.load(sin_ptr + position * stride_cos + HALF + half, mask=half_mask, other=0.0)
        heads = tl.arange(0, HEADS_PAD)
        q1, q2, q_base, q_mask = _rotate_heads(q_ptr, stride_q, cos1, cos2, sin1, sin2, token, heads,
                                               heads < NUM_HEADS, half_mask, HEAD_DIM, HALF, HALF_PAD)
        tl.store(q_base, q1, mask=q_mask)
        tl.store(q_base + HALF, q2, mask=q_mask)
        k1, k2, k_base, k_mask = _rotate_heads(k_ptr, stride_k, cos1, cos2, sin1, sin2, token, kv_heads, kv_mask,
                                               half_mask, HEAD_DIM, HALF, HALF_PAD)
        tl.store(k_base, k1, mask=k_mask)
        tl.store(k_base + HALF, k2, mask=k_mask)
        if QUANTIZED:
            k_amax = tl.maximum(k_amax, tl.max(tl.abs(k1.to(tl.float32)), axis=1))
            k_amax = tl.maximum(k_amax, tl.max(tl.abs(k2.to(tl.float32)), axis=1))
        else:
            tl.store(k_cache_ptr + cache_row + half[None, :], k1, mask=k_mask)
            tl.store(k_cache_ptr + cache_row + HALF + half[None, :], k2, mask=k_mask)
    if PASS_PAD > 0:  # dims past the rotary ones (every dim of a layer without rotary) go to the cache as they are
        dims = 2 * HALF + tl.arange(0, PASS_PAD)
        pass_mask = kv_mask[:, None] & (dims < HEAD_DIM)[None, :]
        k_pass = tl.load(k_ptr + token * stride_k + kv_heads[:, None] * HEAD_DIM + dims[None, :], mask=pass_mask,
                         other=0.0)
        if QUANTIZED:
            k_amax = tl.maximum(k_amax, tl.max(tl.abs(k_pass.to(tl.float32)), axis=1))
        else:
            tl.store(k_cache_ptr + cache_row + dims[None, :], k_pass, mask=pass_mask)
    if QUANTIZED:  # one scale per head vector, amax / 448 (see kv_quant.py); an all-zero vector stores zeros
        k_scale = k_amax / 448.0
        k_inverse = 1.0 / tl.where(k_amax > 0, k_scale, 1.0)
        if HALF > 0:
            tl.store(k_cache_ptr + cache_row + half[None, :], _quantized(k1, k_inverse, k_cache_ptr, ROUND_FIRST), mask=k_mask)
            tl.store(k_cache_ptr + cache_row + HALF + half[None, :], _quantized(k2, k_inverse, k_cache_ptr, ROUND_FIRST),
                     mask=k_mask)
        if PASS_PAD > 0:
            tl.store(k_cache_ptr + cache_row + dims[None, :], _quantized(k_pass, k_inverse, k_cache_ptr, ROUND_FIRST),
                     mask=pass_mask)
        tl.store(k_scales_ptr + scale_row, k_scale, mask=kv_mask)
    dims = tl.arange(0, HEAD_DIM_PAD)
    v_mask = kv_mask[:, None] & (dims < HEAD_DIM)[None, :]
    v = tl.load(v_ptr + token * stride_v + kv_heads[:, None] * HEAD_DIM + dims[None, :], mask=v_mask, other=0.0)
    if QUANTIZED:
        v_amax = tl.max(tl.abs(v.to(tl.float32)), axis=1)
        v_scale = v_amax / 448.0
        v_inverse = 1.0 / tl.where(v_amax > 0, v_scale, 1.0)
        tl.store(v_cache_ptr + cache_row + dims[None, :], _quantized(v, v_inverse, v_cache_ptr, ROUND_FIRST), mask=v_mask)
        tl.store(v_scales_ptr + scale_row, v_scale, mask=kv_mask)
    else:
        tl.store(v_cache_ptr + cache_row + dims[None, :], v, mask=v_mask)


def rope_and_write_cache(q: Tensor, k: Tensor, v: Tensor, cos: Tensor | None, sin: Tensor | None, positions: Tensor,
                         slot_mapping: Tensor, k_cache: Tensor | QuantizedCache, v_cache: Tensor | QuantizedCache,
                         qk_norm: tuple[Tensor, Tensor, float, str] | None = None) -> None:
    """Rotate q and k in place and write k, v into the paged cache at ``slot_mapping``; with ``qk_norm`` (q's norm
    weight, k's, eps and the ``NORM_KINDS`` kind) each head of q and k is first RMS-normalised in place.

    q: (tokens, heads, head_dim); k, v: (tokens, kv_heads, head_dim), last two dims contiguous;
    cos, sin: (max_positions, rotary_dim), rotary_dim <= head_dim (the first rotary_dim dims rotate, the
    rest pass), or None for a layer without rotary embedding (q and k stay, or are only normalised, and k and v
    are written);
    k_cache, v_cache: (num_blocks, block_size, kv_heads, head_dim), or fp8 ``QuantizedCache``s (each head vector
    quantised with its own scale, kv_quant.py).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = 0 if cos is None else cos.shape[-1] // 2
    if cos is None:
        cos = sin = q  # not read
    num_pass = head_dim - 2 * half
    quantized = isinstance(k_cache, QuantizedCache)
    k_values, v_values, k_scales, v_scales, stride_scale_block = kernel_cache_args(k_cache, v_cache, q)
    q_norm, k_norm, eps, kind = qk_norm if qk_norm is not None else (q, q, 0.0, "llama")  # unread placeholders
    _rope_and_cache_kernel[(num_tokens,)](
        q, k, v, cos, sin, positions, slot_mapping, k_values, v_values, k_scales, v_scales, q_norm, k_norm, eps,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0), k_values.stride(0), k_values.stride(1),
        stride_scale_block,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), HALF=half, HALF_PAD=triton.next_power_of_2(max(half, 1)),
        PASS_PAD=triton.next_power_of_2(num_pass) if num_pass else 0, PAGE=k_values.shape[1], QUANTIZED=quantized,
        ROUND_FIRST=quantized and _INTERPRETED, QK_NORM=qk_norm is not None, NORM_KIND=NORM_KINDS[kind], num_warps=4)


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
"""Gated MLP activations (``ArchitectureSpec.activation``)."""


@triton.jit
def gated_activation(gate, ACTIVATION: tl.constexpr):
    """act(gate) in float32 for a float32 gate, ``ACTIVATION`` a value of ``ACTIVATIONS``."""
    if ACTIVATION == 0:
        return gate / (1.0 + tl.exp(-gate))
    # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(u) = 1 - 2 / (exp(2u) + 1)
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    return 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))


@triton.jit
def _act_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, num_cols, ACTIVATION: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + num_cols + cols, mask=mask, other=0.0)
    activated = gated_activation(gate.to(tl.float32), ACTIVATION)
    out = activated.to(gate.dtype).to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(gate.dtype), mask=mask)


def act_and_mul(gate_up: Tensor, activation: str = "silu") -> Tensor:
    """act(gate) * up, each rounded to the input dtype as transformers does; ``activation`` one of ``ACTIVATIONS``.

    gate_up: (rows, 2 * dim), gate then up along the last dim (contiguous). Returns (rows, dim).
    """
    rows, num_cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, num_cols, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _act_and_mul_kernel[(rows, triton.cdiv(num_cols, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), num_cols, ACTIVATION=ACTIVATIONS[activation], BLOCK=block,
        num_warps=4)
    return out


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up (see ``act_and_mul``)."""
    return act_and_mul(gate_up, "silu")


@triton.jit
def _hash_uniform_key(key):
    key = key ^ (key >> 16)
    key = key * 0x7FEB352D
    key = key ^ (key >> 15)
    key = key * 0x846CA68B
    return key ^ (key >> 16)


@triton.jit
def _hash_uniform(cols, key):
    """Uniforms in (0, 1) from a 32-bit integer hash (lowbias32) of each column under the row's key: the top 23
    bits plus a half, exact in float32, so u is never 1 (rollout.noise.uniform_from_bits)."""
    h = cols.to(tl.uint32) * 0x9E3779B1 ^ key
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    h = h ^ (h >> 16)
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _gumbel(uniform, FAST_LOG: tl.constexpr):
    """-log(-log(uniform)). FAST_LOG (compiled for CUDA): the hardware's approximate log2 where it is accurate,
    without the accurate logarithm's instruction sequence, which made sampling compute-bound:
    - the outer log: its absolute error (about 1e-7) is below float32's spacing at a perturbed logit's size;
    - the inner one, -log(u), must be accurate relative to its value, which nears 0 as u nears 1 (the largest
      noise, the kind that wins): the approximate log2 for u <= 1/2 (|log u| >= 0.69), else
      -log(1 - w) = 2 atanh(w / (2 - w)) for w = 1 - u (exact), a series to z^13 (within 2.2e-7 of -log(u) in
      float32 over every uniform the hash gives, against 8e-8 for the accurate log)."""
    if FAST_LOG:
        w = 1.0 - uniform
        z = w / (2.0 - w)
        z2 = z * z
        series = 1.0 / 13.0
        series = series * z2 + 1.0 / 11.0
        series = series * z2 + 1.0 / 9.0
        series = series * z2 + 1.0 / 7.0
        series = series * z2 + 1.0 / 5.0
        series = series * z2 + 1.0 / 3.0
        series = series * z2 + 1.0
        exponential = tl.where(uniform > 0.5, 2.0 * z * series, -libdevice.fast_logf(uniform))
        return -libdevice.fast_logf(exponential)
    return -tl.log(-tl.log(uniform))


@triton.jit
def _sample_split_kernel(logits_ptr, stride_logits, vocab_size, inv_temperatures_ptr, greedy_ptr, thresholds_ptr,
                         sample_seeds_ptr, positions_ptr, split_max_ptr, split_sum_ptr, split_best_ptr, split_index_ptr,
                         softcap, BLOCK_V: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr, FAST_LOG: tl.constexpr,
                         HAS_SOFTCAP: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_logits
    inv_temperature = tl.load(inv_temperatures_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    threshold = tl.load(thresholds_ptr + row)
    # the noise of a row depends only on its sample's seed and the position being sampled
    mixed = tl.load(sample_seeds_ptr + row) + tl.load(positions_ptr + row) * 0x5851F42D4C957F2D
    key = (mixed ^ (mixed >> 32)).to(tl.uint32)
    key = _hash_uniform_key(key)
    lanes = tl.arange(0, BLOCK_V)
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    lane_best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_index = tl.zeros([BLOCK_V], tl.int32)
    for block in range(BLOCKS_PER_SPLIT):  # the last split's blocks past the vocabulary are all masked
        cols = (split * BLOCKS_PER_SPLIT + block) * BLOCK_V + lanes
        in_vocab = cols < vocab_size
        x = tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            x = _softcapped(x, softcap)
        # columns past the vocabulary are -inf after the temperature, whatever it is (times a negative or NaN one, a
        # masked -inf would become +inf or NaN, and the greedy branch below would pick the column)
        x = tl.where(in_vocab, x * inv_temperature, float("-inf"))
        # online softmax with one exp per logit: exp(smaller - larger) either scales the lane's sum
        # down to a new maximum or is the new term (zero while the lane has seen only -inf)
        new_max = tl.maximum(lane_max, x)
        ratio = tl.exp(tl.minimum(lane_max, x) - _finite_or_zero(new_max))
        lane_sum = tl.where(x > lane_max, lane_sum * ratio + 1.0, lane_sum + ratio)
        lane_max = new_max
        # Gumbel-max; columns only grow, so a strict comparison keeps each lane's first maximum
        gumbel = _gumbel(_hash_uniform(cols, key), FAST_LOG)
        sampled = tl.where((x >= threshold) & in_vocab, x + gumbel, float("-inf"))
        score = tl.where(greedy, x, sampled)
        better = score > lane_best
        lane_best = tl.where(better, score, lane_best)
        lane_index = tl.where(better, cols, lane_index)
    split_max = tl.max(lane_max, axis=0)
    split_sum = tl.sum(lane_sum * tl.exp(lane_max - _finite_or_zero(split_max)), axis=0)
    best = tl.max(lane_best, axis=0)
    best_index = tl.min(tl.where(lane_best == best, lane_index, vocab_size), axis=0)
    out = row * tl.num_programs(1) + split
    tl.store(split_max_ptr + out, split_max)
    tl.store(split_sum_ptr + out, split_sum)
    tl.store(split_best_ptr + out, best)
    tl.store(split_index_ptr + out, best_index)


@triton.jit
def _sample_combine_kernel(logits_ptr, stride_logits, vocab_size, num_splits, inv_temperatures_ptr, split_max_ptr,
                           split_sum_ptr, split_best_ptr, split_index_ptr, tokens_ptr, log_probs_ptr, softcap,
                           SPLITS_PAD: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    row = tl.program_id(0)
    splits = tl.arange(0, SPLITS_PAD)
    valid = splits < num_splits
    offsets = row * num_splits + splits
    split_max = tl.load(split_max_ptr + offsets, mask=valid, other=float("-inf"))
    split_sum = tl.load(split_sum_ptr + offsets, mask=valid, other=0.0)
    split_best = tl.load(split_best_ptr + offsets, mask=valid, other=float("-inf"))
    split_index = tl.load(split_index_ptr + offsets, mask=valid, other=vocab_size)
    row_max = tl.max(split_max, axis=0)
    total = tl.sum(split_sum * tl.exp(split_max - _finite_or_zero(row_max)), axis=0)
    # splits cover increasing columns, so the smallest index among the best keeps the first maximum
    best = tl.max(split_best, axis=0)
    token = tl.min(tl.where(split_best == best, split_index, vocab_size), axis=0)
    token = tl.minimum(token, vocab_size - 1)  # an id the embedding has, whatever the scores were
    chosen = tl.load(logits_ptr + row.to(tl.int64) * stride_logits + token).to(tl.float32)
    if HAS_SOFTCAP:
        chosen = _softcapped(chosen, softcap)
    chosen = chosen * tl.load(inv_temperatures_ptr + row)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(log_probs_ptr + row, chosen - (row_max + tl.log(total)))


def sample(logits: Tensor, inv_temperatures: Tensor, greedy: Tensor, thresholds: Tensor, sample_seeds: Tensor,
           positions: Tensor, block_v: int = 1024, blocks_per_split: int = 8,
           num_warps: int = 4, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """Gumbel-max sample of each row of ``logits * inv_temperature`` at or above its threshold.

    logits: (batch, vocab) any float dtype, rows contiguous; the other inputs (batch,); positions
    are those of the tokens being sampled. Each row's vocabulary is cut into splits of
    ``block_v * blocks_per_split`` columns, read once by one program each; a second kernel merges
    a row's splits. Returns token ids (batch,) int64 and their log-probs (batch,) float32 under
    the untruncated tempered distribution. ``softcap``: each logit is first capped in float32,
    softcap * tanh(logit / softcap), as it is read (the thresholds are of capped logits).
    """
    batch, vocab_size = logits.shape
    block_v = min(block_v, max(64, triton.next_power_of_2(vocab_size)))
    num_splits = triton.cdiv(vocab_size, block_v * blocks_per_split)
    partials = torch.empty(3, batch, num_splits, dtype=torch.float32, device=logits.device)
    split_max, split_sum, split_best = partials
    split_index = torch.empty(batch, num_splits, dtype=torch.int32, device=logits.device)
    _sample_split_kernel[(batch, num_splits)](
        logits, logits.stride(0), vocab_size, inv_temperatures, greedy, thresholds, sample_seeds, positions,
        split_max, split_sum, split_best, split_index, float(softcap or 1.0), BLOCK_V=block_v,
        BLOCKS_PER_SPLIT=blocks_per_split, FAST_LOG=not _INTERPRETED, HAS_SOFTCAP=softcap is not None,
        num_warps=num_warps)
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    log_probs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    _sample_combine_kernel[(batch,)](
        logits, logits.stride(0), vocab_size, num_splits, inv_temperatures, split_max, split_sum, split_best,
        split_index, tokens, log_probs, float(softcap or 1.0), SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        HAS_SOFTCAP=softcap is not None, num_warps=1)
    return tokens, log_probs
