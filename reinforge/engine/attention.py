"""Varlen attention for packed rows: sequences side by side in one row, never attending across.

We register one attention implementation with transformers, ``reinforge_varlen``. Called with
``packed_cu_seqlens`` (the engine's packed forwards pass it through the model's kwargs, which
activation checkpointing replays), it runs causal attention inside each sequence: on CUDA in
bf16/fp16 with PyTorch's flash varlen kernel (no padding, no mask), elsewhere with one masked
SDPA call over the sequences unpacked into a padded batch. Without it (``generate`` with padding masks, a KV cache) it is plain SDPA,
with SDPA's masks, so the same model serves rollout and training.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NAME = "reinforge_varlen"


def use_varlen_attention(model: nn.Module) -> None:
    """Switch ``model`` (an HF PreTrainedModel) and its sub-models to the varlen implementation."""
    _register()
    model.set_attn_implementation(NAME)


@cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def varlen_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs) -> tuple[Tensor, None]:
    """query (1, heads, tokens, dim), key/value (1, kv_heads, tokens, dim) -> (1, tokens, heads, dim)."""
    cu_seqlens = kwargs.get("packed_cu_seqlens")
    if cu_seqlens is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one row of packed sequences, got {query.shape[0]} rows")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # (tokens, heads, dim)
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _varlen_kernel() is not None:
        out = _flash_varlen(q, k, v, cu_seqlens, int(kwargs["packed_max_length"]), scale)
    else:
        out = _padded_sdpa(q, k, v, kwargs["packed_lengths"], scale)
    return out.unsqueeze(0), None


@cache
def _varlen_kernel():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@cache
def _varlen_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(_varlen_kernel()).parameters)


def _flash_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_length: int, scale: float) -> Tensor:
    parameters = _varlen_parameters()
    options = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "window_size" in parameters:
        options["window_size"] = (-1, 0)
    else:
        options["is_causal"] = True
    if "scale" in parameters:
        options["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        q = q * (scale * q.shape[-1] ** 0.5)
    cu_seqlens = cu_seqlens.to(torch.int32)
    return _varlen_kernel()(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, **options)


def _padded_sdpa(q: Tensor, k: Tensor, v: Tensor, lengths: list[int], scale: float) -> Tensor:
    """Unpack into a (sequences, longest) batch, one masked SDPA call, pack again.

    Padding costs FLOPs here, but one call beats a Python loop of one call per sequence by far
    on the CPU, where rollout batches hold hundreds of short sequences.
    """
    groups = q.shape[1] // k.shape[1]
    sizes = torch.tensor(lengths, device=q.device)
    longest = int(sizes.max())
    positions = torch.arange(longest, device=q.device)
    valid = positions[None, :] < sizes[:, None]  # (sequences, longest); row-major order is the packed order

    def padded(tensor: Tensor) -> Tensor:
        out = tensor.new_zeros(len(lengths), longest, *tensor.shape[1:])
        out[valid] = tensor
        return out.transpose(1, 2)  # (sequences, heads, longest, dim)

    qp, kp, vp = padded(q), padded(k), padded(v)
    if groups > 1:
        kp, vp = kp.repeat_interleave(groups, dim=1), vp.repeat_interleave(groups, dim=1)
    causal = torch.ones(longest, longest, dtype=torch.bool, device=q.device).tril()
    mask = causal[None, None] & valid[:, None, None, :]
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)[valid]
