"""Causal attention of packed sequences through one masked SDPA call: the path where no flash kernel runs.

Queries q (tokens, heads, dim) and keys and values k, v (tokens, kv_heads, dim) hold sequences side by
side; a sequence may have more keys than queries (a shared prompt in training, a cached prefix in the
rollout), and its causal mask is then aligned to the end of its keys, as the flash varlen kernel
aligns it. The trainer's packed attention (``engine/attention.py``) and the rollout engine's prefix
prefill (``rollout/native/attention.py``) both fall back to it, so it imports nothing of reinforge.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def padded_packed_attention(q: Tensor, k: Tensor, v: Tensor, query_lengths: list[int], key_lengths: list[int],
                            scale: float) -> Tensor:
    """Unpack into a (segments, longest) batch, one masked SDPA call, pack again.

    Padding costs FLOPs here, but one call beats a Python loop of one call per sequence by far
    on the CPU, where rollout batches hold hundreds of short sequences.
    """
    groups = q.shape[1] // k.shape[1]
    q_sizes = torch.tensor(query_lengths, device=q.device)
    k_sizes = torch.tensor(key_lengths, device=q.device)
    q_valid = torch.arange(max(query_lengths), device=q.device)[None, :] < q_sizes[:, None]
    k_valid = torch.arange(max(key_lengths), device=q.device)[None, :] < k_sizes[:, None]

    def padded(tensor: Tensor, valid: Tensor) -> Tensor:  # row-major order of ``valid`` is the packed order
        out = tensor.new_zeros(*valid.shape, *tensor.shape[1:])
        out[valid] = tensor
        return out.transpose(1, 2)  # (segments, heads, longest, dim)

    qp, kp, vp = padded(q, q_valid), padded(k, k_valid), padded(v, k_valid)
    if groups > 1:
        kp, vp = kp.repeat_interleave(groups, dim=1), vp.repeat_interleave(groups, dim=1)
    # query i sees key j <= i + (keys - queries): causal, aligned to the end of the segment's keys
    offsets = (k_sizes - q_sizes)[:, None, None]
    rows = torch.arange(q_valid.shape[1], device=q.device)[None, :, None]
    columns = torch.arange(k_valid.shape[1], device=q.device)[None, None, :]
    mask = (columns <= rows + offsets) & k_valid[:, None, :]
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)[q_valid]
