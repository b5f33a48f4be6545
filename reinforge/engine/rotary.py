"""The rotary position embedding of q and k as one opaque op, read and written once each way.

Inside a compiled decoder layer, inductor lowers transformers' ``x * cos + rotate_half(x) * sin``
to kernels about seven times slower than memory bandwidth allows (0.14 s of a GRPO step of
Qwen2.5-0.5B on an H200, forward and backward). ``apply_rotary`` is a
``torch.library`` custom op (``reinforge::rotary_embedding``, its backward
``reinforge::rotary_embedding_backward``) that the compiler keeps as one call: on CUDA one
Triton launch reads q, k, cos and sin once and writes the rotated q and k once; elsewhere (or
without Triton) the same math runs in PyTorch. Both compute in float32 and round once, so in
bf16 they are slightly more accurate than the transformers expression, which rounds after
each product. With x1, x2 the halves of the last dim (and of cos, sin):

    out1 = x1 cos1 - x2 sin1        grad_x1 = g1 cos1 + g2 sin2
    out2 = x2 cos2 + x1 sin2        grad_x2 = g2 cos2 - g1 sin1

cos and sin are constants (no gradient). Tests run the kernel under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch path alone
    triton = None

TILE_ELEMENTS = 4096
"""Elements of one half of q's tile (tokens x heads x half the head dim, heads and dim padded to
powers of two) per program, which sets the token block (8 tokens for 14 heads of dim 64): each
float32 half then takes about 32 registers a thread with 4 warps."""


def _rotary_torch(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> tuple[Tensor, Tensor]:
    """The op (or its backward, with q, k the gradients of the outputs) in PyTorch, at least float32."""
    compute = torch.promote_types(q.dtype, torch.float32)
    cos1, cos2 = cos.to(compute).unsqueeze(1).chunk(2, dim=-1)
    sin1, sin2 = sin.to(compute).unsqueeze(1).chunk(2, dim=-1)
    # the backward is the forward with the transposed rotation: sin1 and sin2 swap places and signs
    across1, across2 = (sin2, -sin1) if backward else (-sin1, sin2)

    def rotate(x: Tensor) -> Tensor:
        x1, x2 = x.to(compute).chunk(2, dim=-1)
        return torch.cat((x1 * cos1 + x2 * across1, x2 * cos2 + x1 * across2), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


if triton is not None:

    @triton.jit
    def _rotate_heads(src_ptr, stride_t, stride_h, dst_ptr, tokens, in_range, cos1, across1, cos2, across2,
                      HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
        heads = tl.arange(0, HEADS_PAD)
        cols = tl.arange(0, HALF_PAD)
        mask = in_range[:, None, None] & (heads < HEADS)[None, :, None] & (cols < HALF)[None, None, :]
        src = src_ptr + tokens[:, None, None] * stride_t + heads[None, :, None] * stride_h + cols[None, None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        out1 = x1 * cos1[:, None, :] + x2 * across1[:, None, :]
        out2 = x2 * cos2[:, None, :] + x1 * across2[:, None, :]
        # the outputs are contiguous (tokens, heads, 2 * HALF)
        dst = dst_ptr + tokens[:, None, None] * (HEADS * 2 * HALF) + heads[None, :, None] * (2 * HALF) \
            + cols[None, None, :]
        tl.store(dst, out1.to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, out2.to(dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(q_ptr, q_stride_t, q_stride_h, k_ptr, k_stride_t, k_stride_h, cos_ptr, cos_stride,
                       sin_ptr, sin_stride, q_out_ptr, k_out_ptr, num_tokens,
                       Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS: tl.constexpr,
                       K_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                       BLOCK_T: tl.constexpr, BACKWARD: tl.constexpr):
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        in_range = tokens < num_tokens
        tokens = tokens.to(tl.int64)
        cols = tl.arange(0, HALF_PAD)
        table_mask = in_range[:, None] & (cols < HALF)[None, :]
        cos_at = cos_ptr + tokens[:, None] * cos_stride + cols[None, :]
        sin_at = sin_ptr + tokens[:, None] * sin_stride + cols[None, :]
        # cos and sin are read once per token and serve every head of q and k
        cos1 = tl.load(cos_at, mask=table_mask, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_at + HALF, mask=table_mask, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_at, mask=table_mask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_at + HALF, mask=table_mask, other=0.0).to(tl.float32)
        if BACKWARD:  # the transposed rotation
            across1 = sin2
            across2 = -sin1
        else:
            across1 = -sin1
            across2 = sin2
        _rotate_heads(q_ptr, q_stride_t, q_stride_h, q_out_ptr, tokens, in_range, cos1, across1, cos2, across2,
                      Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
        _rotate_heads(k_ptr, k_stride_t, k_stride_h, k_out_ptr, tokens, in_range, cos1, across1, cos2, across2,
                      K_HEADS, K_HEADS_PAD, HALF, HALF_PAD)


def _unit_last_stride(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rotary_triton(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> tuple[Tensor, Tensor]:
    """The op (or its backward, with q, k the gradients of the outputs) with the Triton kernel.

    One program per block of tokens rotates all heads of q and of k; the token and head
    strides of q and k are free (views of a projection), the head dim must be even.
    """
    q, k, cos, sin = (_unit_last_stride(x) for x in (q, k, cos, sin))
    num_tokens, q_heads, dim = q.shape
    k_heads = k.shape[1]
    if dim % 2 or k.shape != (num_tokens, k_heads, dim) or cos.shape != (num_tokens, dim) or sin.shape != cos.shape:
        raise ValueError(f"rotary embedding: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} and "
                         f"sin {tuple(sin.shape)} must be (tokens, heads, dim) and (tokens, dim) with an even dim")
    q_out = q.new_empty(q.shape)
    k_out = k.new_empty(k.shape)
    if num_tokens == 0:
        return q_out, k_out
    half = dim // 2
    half_pad = triton.next_power_of_2(half)
    q_heads_pad = triton.next_power_of_2(q_heads)
    block_t = max(1, min(64, TILE_ELEMENTS // (q_heads_pad * half_pad)))  # powers of two, so is this
    grid = (triton.cdiv(num_tokens, block_t),)
    _rotary_kernel[grid](q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), cos, cos.stride(0),
                         sin, sin.stride(0), q_out, k_out, num_tokens,
                         Q_HEADS=q_heads, Q_HEADS_PAD=q_heads_pad, K_HEADS=k_heads,
                         K_HEADS_PAD=triton.next_power_of_2(k_heads), HALF=half, HALF_PAD=half_pad,
                         BLOCK_T=block_t, BACKWARD=backward, num_warps=4)
    return q_out, k_out


def _rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> tuple[Tensor, Tensor]:
    if q.is_cuda and triton is not None:
        return _rotary_triton(q, k, cos, sin, backward)
    return _rotary_torch(q, k, cos, sin, backward)


@torch.library.custom_op("reinforge::rotary_embedding", mutates_args=())
def rotary_embedding(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return _rotary(q, k, cos, sin, backward=False)


@torch.library.custom_op("reinforge::rotary_embedding_backward", mutates_args=())
def rotary_embedding_backward(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return _rotary(grad_q, grad_k, cos, sin, backward=True)


@rotary_embedding.register_fake
def _(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


@rotary_embedding_backward.register_fake
def _(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return grad_q.new_empty(grad_q.shape), grad_k.new_empty(grad_k.shape)


def _save_tables(ctx, inputs: tuple, output) -> None:
    ctx.save_for_backward(inputs[2], inputs[3])


def _rotary_embedding_grad(ctx, grad_q: Tensor, grad_k: Tensor):
    cos, sin = ctx.saved_tensors
    grad_q, grad_k = torch.ops.reinforge.rotary_embedding_backward(grad_q, grad_k, cos, sin)
    return grad_q, grad_k, None, None


def _rotary_embedding_backward_grad(ctx, grad_q: Tensor, grad_k: Tensor):
    # the backward is linear in the gradients and its transpose is the forward (double backward)
    cos, sin = ctx.saved_tensors
    grad_q, grad_k = torch.ops.reinforge.rotary_embedding(grad_q, grad_k, cos, sin)
    return grad_q, grad_k, None, None


rotary_embedding.register_autograd(_rotary_embedding_grad, setup_context=_save_tables)
rotary_embedding_backward.register_autograd(_rotary_embedding_backward_grad, setup_context=_save_tables)


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """transformers' rotary embedding ``x * cos + rotate_half(x) * sin`` of q and k; new contiguous tensors.

    q: (tokens, q_heads, dim) and k: (tokens, kv_heads, dim), any token and head strides; cos,
    sin: (tokens, dim) in any float dtype, constants. The outputs have the dtype of q and k.
    """
    return torch.ops.reinforge.rotary_embedding(q, k, cos, sin)
