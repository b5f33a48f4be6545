"""Packed causal attention with a score soft-cap and a sliding window: Triton kernels, forward and backward.

The layers of Gemma 2 cap their scores, ``c * tanh(s / c)`` on the scaled scores before the mask,
which the flash varlen kernel cannot do. ``softcap_varlen_attention`` computes what
``reinforge.packed_attention.padded_packed_attention`` does for them, unpadded: q (tokens, heads,
dim) and k, v (key tokens, kv_heads, dim) hold segments side by side (``cu_seqlens``, and
``cu_seqlens_k`` where a segment has more keys than queries: its causal mask is then aligned to the
end of its keys), each query head reads key/value head ``head // (heads // kv_heads)``, and a
window W leaves W keys visible including the query.

The forward is flash-attention 2's: one program per (block of queries, segment, head) keeps an
online max and sum over the visible key blocks in float32 and saves each row's log-sum-exp. The
backward recomputes the probabilities from it: one kernel per (block of keys, segment, kv head)
sums dk and dv over the query heads of its group and the query blocks that see the keys, another
per (block of queries, segment, head) sums dq; the soft-cap's derivative ``1 - tanh^2`` multiplies
the score gradient. Only the visible key blocks are visited, so a window costs W keys per query.

The two passes are ``torch.library`` custom ops (``reinforge::softcap_attention`` and its backward)
with fake implementations, so a compiled decoder layer calls them without a graph break. They run
on CUDA, or on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``, as the tests do).
``softcap_kernel_runs_on`` probes the kernels once per device, dtype and head dim against the padded
path; the packed forwards pass the answer as ``packed_softcap_kernel``.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
except ImportError:  # CPU-only installs: the padded path serves soft-capped layers there
    triton = None


if triton is not None:

    @triton.jit
    def _tanh(x):
        """tanh in float32, accurate near 0 too: sign(x) (1 - e) / (1 + e) with e = exp(-2|x|)."""
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def _segment(cu_q_ptr, cu_k_ptr, seg):
        q_start = tl.load(cu_q_ptr + seg)
        q_len = tl.load(cu_q_ptr + seg + 1) - q_start
        k_start = tl.load(cu_k_ptr + seg)
        k_len = tl.load(cu_k_ptr + seg + 1) - k_start
        return q_start, q_len, k_start, k_len

    @triton.jit
    def _capped_scores(q, k, scale, softcap, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
        """(scores, tanh) of q @ k^T: scaled, then soft-capped if the layer caps (tanh is 0 where it does not)."""
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        if HAS_SOFTCAP:
            capped = _tanh(scores / softcap)
            scores = softcap * capped
        else:
            capped = scores * 0.0
        return scores, capped

    @triton.jit
    def _key_range(first_row, q_len, k_len, window, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
        """[lo, hi): the keys a block of BLOCK_M queries from ``first_row`` sees, from the first one's window (at a
        key-block start) to the last one's position."""
        hi = tl.minimum(k_len, first_row + BLOCK_M + k_len - q_len)
        if HAS_WINDOW:
            lo = (tl.maximum(first_row + k_len - q_len - window + 1, 0) // BLOCK_N) * BLOCK_N
        else:
            lo = hi * 0
        return lo, hi

    @triton.jit
    def _visible(positions, cols, k_len, window, start, lo, hi, HAS_WINDOW: tl.constexpr, STATIC: tl.constexpr):
        """Keys ``cols`` (N,) each query at key position ``positions`` (M,) sees: (M, N).

        In the interpreter (STATIC) every block is visited; those outside the compiled loop's [lo, hi) are
        masked whole, so the tests check the loop's bounds too."""
        seen = (cols[None, :] <= positions[:, None]) & (cols[None, :] < k_len)
        if HAS_WINDOW:
            seen = seen & (cols[None, :] > positions[:, None] - window)
        if STATIC:
            seen = seen & (start >= lo) & (start < hi)
        return seen

    @triton.jit
    def _forward_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, scale, softcap, window,
                        total_q, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                        stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, STATIC_KEYS: tl.constexpr):
        block = tl.program_id(0)
        seg = tl.program_id(1)
        head = tl.program_id(2)
        kv_head = head // GROUP
        q_start, q_len, k_start, k_len = _segment(cu_q_ptr, cu_k_ptr, seg)
        first_row = block * BLOCK_M
        rows = first_row + tl.arange(0, BLOCK_M)
        row_valid = rows < q_len
        positions = rows + (k_len - q_len)  # causal, aligned to the end of the segment's keys
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_valid = dims < HEAD_DIM
        tokens = (q_start + rows).to(tl.int64)
        q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
                    mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        lo, hi = _key_range(first_row, q_len, k_len, window, HAS_WINDOW, BLOCK_M, BLOCK_N)
        # STATIC_KEYS is 0 when compiled; Triton's interpreter loops only between Python ints, so there every
        # program visits every key block of the longest segment (the mask drops what it must not see)
        for start in range(0 if STATIC_KEYS else lo, STATIC_KEYS if STATIC_KEYS else hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            key_tokens = (k_start + cols).to(tl.int64)
            key_mask = (cols < k_len)[:, None] & dim_valid[None, :]
            k = tl.load(k_ptr + key_tokens[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
                        mask=key_mask, other=0.0)
            scores, _ = _capped_scores(q, k, scale, softcap, HAS_SOFTCAP, IEEE)
            seen = _visible(positions, cols, k_len, window, start, lo, hi, HAS_WINDOW, STATIC_KEYS > 0)
            scores = tl.where(seen, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            finite_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            probs = tl.exp(scores - finite_max[:, None])
            correction = tl.exp(running_max - finite_max)
            running_sum = running_sum * correction + tl.sum(probs, axis=1)
            v = tl.load(v_ptr + key_tokens[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                        mask=key_mask, other=0.0)
            if IEEE:
                acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v)
            running_max = new_max
        seen = running_sum > 0  # a padding row sees nothing
        out = acc / tl.where(seen, running_sum, 1.0)[:, None]
        tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
        lse = tl.where(seen, running_max + tl.log(tl.where(seen, running_sum, 1.0)), 0.0)
        tl.store(lse_ptr + head * total_q + tokens, lse, mask=row_valid)

    @triton.jit
    def _backward_kv_kernel(q_ptr, k_ptr, v_ptr, grad_out_ptr, lse_ptr, delta_ptr, grad_k_ptr, grad_v_ptr,
                            cu_q_ptr, cu_k_ptr, scale, softcap, window, total_q, stride_qt, stride_qh,
                            stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_gt, stride_gh,
                            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                            HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, STATIC_QUERIES: tl.constexpr):
        block = tl.program_id(0)
        seg = tl.program_id(1)
        kv_head = tl.program_id(2)
        q_start, q_len, k_start, k_len = _segment(cu_q_ptr, cu_k_ptr, seg)
        offset = k_len - q_len
        first_col = block * BLOCK_N
        cols = first_col + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_valid = dims < HEAD_DIM
        key_tokens = (k_start + cols).to(tl.int64)
        key_mask = (cols < k_len)[:, None] & dim_valid[None, :]
        k = tl.load(k_ptr + key_tokens[:, None] * stride_kt + kv_head * stride_kh + dims[None, :], mask=key_mask,
                    other=0.0)
        v = tl.load(v_ptr + key_tokens[:, None] * stride_vt + kv_head * stride_vh + dims[None, :], mask=key_mask,
                    other=0.0)
        grad_k = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)
        grad_v = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)
        # the queries that see these keys: from the first key's position to the last key's window
        lo = (tl.maximum(first_col - offset, 0) // BLOCK_M) * BLOCK_M
        if HAS_WINDOW:
            hi = tl.minimum(q_len, first_col + BLOCK_N + window - 1 - offset)
        else:
            hi = q_len
        for member in range(GROUP):
            head = kv_head * GROUP + member
            for start in range(0 if STATIC_QUERIES else lo, STATIC_QUERIES if STATIC_QUERIES else hi, BLOCK_M):
                rows = start + tl.arange(0, BLOCK_M)
                row_valid = rows < q_len
                tokens = (q_start + rows).to(tl.int64)
                row_mask = row_valid[:, None] & dim_valid[None, :]
                q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=row_mask,
                            other=0.0)
                grad_out = tl.load(grad_out_ptr + tokens[:, None] * stride_dot + head * stride_doh + dims[None, :],
                                   mask=row_mask, other=0.0)
                lse = tl.load(lse_ptr + head * total_q + tokens, mask=row_valid, other=0.0)
                delta = tl.load(delta_ptr + head * total_q + tokens, mask=row_valid, other=0.0)
                scores, capped = _capped_scores(q, k, scale, softcap, HAS_SOFTCAP, IEEE)  # (M, N)
                seen = _visible(rows + offset, cols, k_len, window, start, lo, hi, HAS_WINDOW, STATIC_QUERIES > 0)
                seen = seen & row_valid[:, None]
                probs = tl.where(seen, tl.exp(scores - lse[:, None]), 0.0)
                if IEEE:
                    grad_v += tl.dot(tl.trans(probs.to(grad_out.dtype)), grad_out, input_precision="ieee")
                    grad_probs = tl.dot(grad_out, tl.trans(v), input_precision="ieee")
                else:
                    grad_v += tl.dot(tl.trans(probs.to(grad_out.dtype)), grad_out)
                    grad_probs = tl.dot(grad_out, tl.trans(v))
                grad_scores = probs * (grad_probs - delta[:, None])
                if HAS_SOFTCAP:
                    grad_scores = grad_scores * (1.0 - capped * capped)
                if IEEE:
                    grad_k += tl.dot(tl.trans(grad_scores.to(q.dtype)), q, input_precision="ieee")
                else:
                    grad_k += tl.dot(tl.trans(grad_scores.to(q.dtype)), q)
        out_offsets = key_tokens[:, None] * stride_gt + kv_head * stride_gh + dims[None, :]
        tl.store(grad_k_ptr + out_offsets, (grad_k * scale).to(grad_k_ptr.dtype.element_ty), mask=key_mask)
        tl.store(grad_v_ptr + out_offsets, grad_v.to(grad_v_ptr.dtype.element_ty), mask=key_mask)

    @triton.jit
    def _backward_q_kernel(q_ptr, k_ptr, v_ptr, grad_out_ptr, lse_ptr, delta_ptr, grad_q_ptr, cu_q_ptr, cu_k_ptr,
                           scale, softcap, window, total_q, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                           stride_vh, stride_dot, stride_doh, stride_gt, stride_gh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                           HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, STATIC_KEYS: tl.constexpr):
        block = tl.program_id(0)
        seg = tl.program_id(1)
        head = tl.program_id(2)
        kv_head = head // GROUP
        q_start, q_len, k_start, k_len = _segment(cu_q_ptr, cu_k_ptr, seg)
        first_row = block * BLOCK_M
        rows = first_row + tl.arange(0, BLOCK_M)
        row_valid = rows < q_len
        positions = rows + (k_len - q_len)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_valid = dims < HEAD_DIM
        tokens = (q_start + rows).to(tl.int64)
        row_mask = row_valid[:, None] & dim_valid[None, :]
        q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=row_mask, other=0.0)
        grad_out = tl.load(grad_out_ptr + tokens[:, None] * stride_dot + head * stride_doh + dims[None, :],
                           mask=row_mask, other=0.0)
        lse = tl.load(lse_ptr + head * total_q + tokens, mask=row_valid, other=0.0)
        delta = tl.load(delta_ptr + head * total_q + tokens, mask=row_valid, other=0.0)
        grad_q = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        lo, hi = _key_range(first_row, q_len, k_len, window, HAS_WINDOW, BLOCK_M, BLOCK_N)
        for start in range(0 if STATIC_KEYS else lo, STATIC_KEYS if STATIC_KEYS else hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            key_tokens = (k_start + cols).to(tl.int64)
            key_mask = (cols < k_len)[:, None] & dim_valid[None, :]
            k = tl.load(k_ptr + key_tokens[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
                        mask=key_mask, other=0.0)
            v = tl.load(v_ptr + key_tokens[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                        mask=key_mask, other=0.0)
            scores, capped = _capped_scores(q, k, scale, softcap, HAS_SOFTCAP, IEEE)
            seen = _visible(positions, cols, k_len, window, start, lo, hi, HAS_WINDOW, STATIC_KEYS > 0)
            seen = seen & row_valid[:, None]
            probs = tl.where(seen, tl.exp(scores - lse[:, None]), 0.0)
            if IEEE:
                grad_probs = tl.dot(grad_out, tl.trans(v), input_precision="ieee")
            else:
                grad_probs = tl.dot(grad_out, tl.trans(v))
            grad_scores = probs * (grad_probs - delta[:, None])
            if HAS_SOFTCAP:
                grad_scores = grad_scores * (1.0 - capped * capped)
            if IEEE:
                grad_q += tl.dot(grad_scores.to(k.dtype), k, input_precision="ieee")
            else:
                grad_q += tl.dot(grad_scores.to(k.dtype), k)
        tl.store(grad_q_ptr + tokens[:, None] * stride_gt + head * stride_gh + dims[None, :],
                 (grad_q * scale).to(grad_q_ptr.dtype.element_ty), mask=row_mask)


def _is_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_forward_kernel, InterpretedFunction)


Tiling = tuple[int, int, int, int]
"""BLOCK_M, BLOCK_N, warps, stages."""

FORWARD_BLOCKS: dict[int, tuple[Tiling, ...]] = {
    64: ((64, 64, 4, 3),), 128: ((64, 64, 4, 3),), 256: ((64, 32, 4, 2),), 512: ((32, 32, 4, 2),)}
"""Row bytes of q (head dim padded to a power of two, times 2 for bf16/fp16, 4 for float32) over 2, at most -> the
forward's tilings, fastest first; where a device lacks the shared memory for one, the next is taken (``_launch``).
A (64, 32) tile at bf16 head dim 256 keeps q and two stages of k and v in 48 KiB (float32 at 256 takes the 512 row).
The 256 row is the fastest of 60 tilings at Gemma 2's training shape on an H200
(``reinforge bench kernels softcap-attention``)."""
BACKWARD_KV_BLOCKS: dict[int, tuple[Tiling, ...]] = {
    64: ((32, 64, 4, 2),), 128: ((32, 64, 8, 2),), 256: ((64, 32, 4, 2), (32, 32, 8, 1)), 512: ((16, 32, 8, 1),)}
"""The same for the backward's dk and dv kernel: dk and dv (BLOCK_N x head dim each, float32) stay in registers.
The 256 row: the fastest of 40 tilings, as above (161 KiB of shared memory, an H100's or an A100's), then one in
66 KiB for devices with less (sm_86, sm_89: 99 KiB)."""
BACKWARD_Q_BLOCKS: dict[int, tuple[Tiling, ...]] = {
    64: ((32, 64, 4, 2),), 128: ((32, 64, 8, 2),), 256: ((64, 32, 4, 1), (32, 32, 8, 1)), 512: ((16, 32, 8, 1),)}
"""The same for the backward's dq kernel: dq (BLOCK_M x head dim, float32) stays in registers. The 256 row: the
fastest of 40 tilings, as above (96 KiB), then one in 64 KiB."""

_FITTING: dict[tuple, int] = {}
"""(kernel, device index, tilings) -> the first of the tilings that launched on that device."""


def _blocks(table: dict[int, tuple[Tiling, ...]], head_dim_pad: int, dtype: torch.dtype) -> tuple[Tiling, ...]:
    width = head_dim_pad * dtype.itemsize // 2
    for limit, tilings in sorted(table.items()):
        if width <= limit:
            return tilings
    raise ValueError(f"soft-capped attention: head dim {head_dim_pad} in {dtype} is over the kernels' largest "
                     f"tiles; those layers need the padded path")


def _launch(kernel, tilings: tuple[Tiling, ...], grid, device: torch.device, *args, **constants) -> None:
    """``kernel`` on the first of ``tilings`` whose shared memory the device has (``grid(BLOCK_M, BLOCK_N)`` its
    grid); the one that launched is remembered per device. The last tiling's failure is raised."""
    key = (kernel, device.index, tilings)
    for index in range(_FITTING.get(key, 0), len(tilings)):
        block_m, block_n, warps, stages = tilings[index]
        try:
            kernel[grid(block_m, block_n)](*args, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                                           num_stages=stages, **constants)
        except OutOfResources:  # raised as the kernel loads, before it runs: nothing was written
            if index + 1 == len(tilings):
                raise
            continue
        _FITTING[key] = index
        return


def _check(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, cu_seqlens_k: Tensor) -> None:
    if triton is None:
        raise RuntimeError("soft-capped varlen attention needs Triton; install it or use the padded path")
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"soft-capped attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must "
                         "be (tokens, heads, dim) and (key tokens, kv_heads, dim), one head dim, heads a multiple "
                         "of kv_heads")
    if cu_seqlens.shape != cu_seqlens_k.shape:
        raise ValueError(f"soft-capped attention: cu_seqlens {tuple(cu_seqlens.shape)} and cu_seqlens_k "
                         f"{tuple(cu_seqlens_k.shape)} must list the same segments")


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, cu_seqlens_k: Tensor, max_length: int,
             max_key_length: int, scale: float, softcap: float, window: int,
             blocks: Tiling | None = None) -> tuple[Tensor, Tensor]:
    _check(q, k, v, cu_seqlens, cu_seqlens_k)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    total_q, heads, head_dim = q.shape
    out = q.new_zeros(q.shape)  # zeros: tokens outside every segment (none in a packed row) see nothing
    lse = torch.zeros(heads, total_q, device=q.device, dtype=torch.float32)
    num_segments = cu_seqlens.shape[0] - 1
    if total_q == 0 or num_segments == 0:
        return out, lse
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    tilings = (blocks,) if blocks else _blocks(FORWARD_BLOCKS, head_dim_pad, q.dtype)
    _launch(_forward_kernel, tilings, lambda block_m, _: (triton.cdiv(max_length, block_m), num_segments, heads),
            q.device, q, k, v, out, lse, cu_seqlens, cu_seqlens_k, scale, softcap or 1.0, window, total_q,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            GROUP=heads // k.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, HAS_SOFTCAP=bool(softcap),
            HAS_WINDOW=window > 0, IEEE=q.dtype == torch.float32,
            STATIC_KEYS=max_key_length if _is_interpreted() else 0)
    return out, lse


def _backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
              cu_seqlens_k: Tensor, max_length: int, max_key_length: int, scale: float, softcap: float,
              window: int, kv_blocks: Tiling | None = None,
              q_blocks: Tiling | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv; ``kv_blocks`` and ``q_blocks`` (BLOCK_M, BLOCK_N, warps, stages) replace each kernel's tiling
    from the tables (``reinforge bench kernels softcap-attention`` times them)."""
    q, k, v, grad_out = (_last_dim_contiguous(x) for x in (q, k, v, grad_out.to(q.dtype)))
    total_q, heads, head_dim = q.shape
    # zeros: tokens outside every segment (none in a packed row) get no gradient
    grad_q, grad_k, grad_v = q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    num_segments = cu_seqlens.shape[0] - 1
    if total_q == 0 or num_segments == 0:
        return grad_q, grad_k, grad_v
    # delta_i = sum_d dO_i O_i: the softmax's backward term of each row, (heads, tokens) like lse
    delta = (grad_out.float() * out.float()).sum(-1).transpose(0, 1).contiguous()
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    kv_tilings = (kv_blocks,) if kv_blocks else _blocks(BACKWARD_KV_BLOCKS, head_dim_pad, q.dtype)
    q_tilings = (q_blocks,) if q_blocks else _blocks(BACKWARD_Q_BLOCKS, head_dim_pad, q.dtype)
    common = dict(GROUP=heads // k.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, HAS_SOFTCAP=bool(softcap),
                  HAS_WINDOW=window > 0, IEEE=q.dtype == torch.float32)
    interpreted = _is_interpreted()
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), grad_out.stride(0),
               grad_out.stride(1))
    _launch(_backward_kv_kernel, kv_tilings,
            lambda _, block_n: (triton.cdiv(max_key_length, block_n), num_segments, k.shape[1]), q.device,
            q, k, v, grad_out, lse, delta, grad_k, grad_v, cu_seqlens, cu_seqlens_k, scale, softcap or 1.0, window,
            total_q, *strides, grad_k.stride(0), grad_k.stride(1), STATIC_QUERIES=max_length if interpreted else 0,
            **common)
    _launch(_backward_q_kernel, q_tilings, lambda block_m, _: (triton.cdiv(max_length, block_m), num_segments, heads),
            q.device, q, k, v, grad_out, lse, delta, grad_q, cu_seqlens, cu_seqlens_k, scale, softcap or 1.0, window,
            total_q, *strides, grad_q.stride(0), grad_q.stride(1), STATIC_KEYS=max_key_length if interpreted else 0,
            **common)
    return grad_q, grad_k, grad_v


@torch.library.custom_op("reinforge::softcap_attention", mutates_args=())
def softcap_attention_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, cu_seqlens_k: Tensor,
                         max_length: int, max_key_length: int, scale: float, softcap: float,
                         window: int) -> tuple[Tensor, Tensor]:
    return _forward(q, k, v, cu_seqlens, cu_seqlens_k, max_length, max_key_length, scale, softcap, window)


@torch.library.custom_op("reinforge::softcap_attention_backward", mutates_args=())
def softcap_attention_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                  cu_seqlens: Tensor, cu_seqlens_k: Tensor, max_length: int, max_key_length: int,
                                  scale: float, softcap: float, window: int) -> tuple[Tensor, Tensor, Tensor]:
    return _backward(grad_out, q, k, v, out, lse, cu_seqlens, cu_seqlens_k, max_length, max_key_length, scale,
                     softcap, window)


@softcap_attention_op.register_fake
def _(q, k, v, cu_seqlens, cu_seqlens_k, max_length, max_key_length, scale, softcap, window):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@softcap_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens, cu_seqlens_k, max_length, max_key_length, scale, softcap, window):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_for_backward(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, cu_seqlens, cu_seqlens_k, max_length, max_key_length, scale, softcap, window = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens, cu_seqlens_k)
    ctx.options = (max_length, max_key_length, scale, softcap, window)


def _softcap_attention_grad(ctx, grad_out: Tensor, grad_lse: Tensor | None):
    q, k, v, out, lse, cu_seqlens, cu_seqlens_k = ctx.saved_tensors
    grad_q, grad_k, grad_v = torch.ops.reinforge.softcap_attention_backward(
        grad_out, q, k, v, out, lse, cu_seqlens, cu_seqlens_k, *ctx.options)
    return grad_q, grad_k, grad_v, None, None, None, None, None, None, None


softcap_attention_op.register_autograd(_softcap_attention_grad, setup_context=_save_for_backward)


def softcap_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, cu_seqlens_k: Tensor,
                             max_length: int, max_key_length: int, scale: float, softcap: float | None = None,
                             window: int | None = None) -> Tensor:
    """Causal attention inside each packed segment, scores soft-capped: q (tokens, heads, dim), k/v (key tokens,
    kv_heads, dim) -> (tokens, heads, dim) in q's dtype; differentiable in q, k and v.

    cu_seqlens, cu_seqlens_k (segments + 1,) int32 offsets of the queries and keys; max_length and max_key_length
    the longest segment of each; softcap c: scores c * tanh(s / c) after ``scale``; window W: W keys visible.
    """
    out, _ = torch.ops.reinforge.softcap_attention(
        q, k, v, cu_seqlens.to(torch.int32), cu_seqlens_k.to(torch.int32), max_length, max_key_length, scale,
        float(softcap or 0.0), int(window or 0))
    return out


@cache
def softcap_kernel_runs_on(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernels run on ``device`` at ``head_dim`` in ``dtype`` and agree with the padded path both ways.

    Probed once, outside any compiled region: two segments (one with more keys than queries), a window, GQA.
    Where they do not (no Triton, no shared memory for the tiles), soft-capped layers keep flex or the padded
    path and a warning says why.
    """
    if device.type != "cuda" or triton is None:
        return False
    from reinforge.packed_attention import padded_packed_attention

    generator = torch.Generator().manual_seed(0)
    query_lengths, key_lengths = [37, 70], [37, 90]
    q = torch.randn(sum(query_lengths), 4, head_dim, generator=generator)
    k, v = (torch.randn(sum(key_lengths), 2, head_dim, generator=generator) for _ in range(2))
    grad_out = torch.randn(q.shape, generator=generator)
    scale = head_dim ** -0.5
    with torch.inference_mode(False), torch.enable_grad():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        expected = padded_packed_attention(*leaves, query_lengths, key_lengths, scale, window=50, softcap=2.0)
        expected.backward(grad_out)
    cu_q = torch.tensor([0, 37, 107], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 37, 127], dtype=torch.int32, device=device)
    try:
        with torch.inference_mode(False), torch.enable_grad():  # the rollout engine asks from inside its no_grad
            inputs = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
            out = softcap_varlen_attention(*inputs, cu_q, cu_k, 70, 90, scale, softcap=2.0, window=50)
            out.backward(grad_out.to(device, dtype))
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # relative to each tensor's norm
        works = all(float((got.detach().float().cpu() - reference).norm()) <= tolerance * float(reference.norm())
                    for got, reference in zip((out, *(x.grad for x in inputs)),
                                              (expected.detach(), *(x.grad for x in leaves)), strict=True))
        reason = "its output or gradients differ from the padded path"
    except Exception as error:  # any failure of Triton's compiler or launch: the other paths are exact
        works, reason = False, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if not works:
        import warnings

        warnings.warn(f"the soft-capped attention kernels do not run on {device} at head dim {head_dim} in {dtype} "
                      f"({reason}); soft-capped layers take flex attention or the padded path", stacklevel=2)
    return works

