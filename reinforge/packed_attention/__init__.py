"""Causal attention of packed sequences in one batched call: the path where no flash kernel runs.

Queries q (tokens, heads, dim) and keys and values k, v (tokens, kv_heads, dim; v may have a head
dim of its own, as in DeepSeek's MLA) hold sequences side by side; a sequence may have more keys
than queries (a shared prompt in training, a cached prefix in the rollout), and its causal mask
is then aligned to the end of its keys, as the flash varlen kernel aligns it. Every difference a
transformers attention function is handed applies here exactly as in its eager path:

- ``window``: W keys visible including the query (key j visible to query i iff i - W < j <= i, in
  the positions of the segment's keys);
- ``softcap``: scores ``c * tanh(s / c)`` after the scale, before the mask (Gemma 2);
- ``sinks``: one learned logit per head joins each softmax as an extra column, then is dropped
  (GPT-OSS).

Without soft-cap and sinks it is one masked SDPA call; with either, the same mask over an
explicit matmul-softmax (SDPA cannot bend scores). The trainer's packed attention
(``engine/attention.py``) and the rollout engine's prefix prefill (``rollout/native/attention.py``)
both fall back to it, so it imports nothing of reinforge. On CUDA both run soft-capped layers
unpadded in the Triton kernels of ``softcap_kernels.py`` (forward and backward), which compute
what ``padded_packed_attention`` computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def padded_packed_attention(q: Tensor, k: Tensor, v: Tensor, query_lengths: list[int], key_lengths: list[int],
                            scale: float, window: int | None = None, softcap: float | None = None,
                            sinks: Tensor | None = None) -> Tensor:
    """Unpack into a (segments, longest) batch, one masked attention call, pack again: -> (tokens, heads, v dim).

    Padding costs FLOPs here, but one call beats a Python loop of one call per sequence by far
    on the CPU, where rollout batches hold hundreds of short sequences.
    """
    groups = q.shape[1] // k.shape[1]
    segments, longest_query, longest_key = len(query_lengths), max(query_lengths), max(key_lengths)
    q_sizes = torch.tensor(query_lengths, device=q.device)
    k_sizes = torch.tensor(key_lengths, device=q.device)
    q_valid = torch.arange(longest_query, device=q.device)[None, :] < q_sizes[:, None]
    k_valid = torch.arange(longest_key, device=q.device)[None, :] < k_sizes[:, None]
    q_index = _padded_index(q_sizes, longest_query, q.shape[0])
    k_index = _padded_index(k_sizes, longest_key, k.shape[0])

    def padded(tensor: Tensor, index: Tensor, longest: int) -> Tensor:
        out = tensor.new_zeros(segments * longest, *tensor.shape[1:]).index_copy(0, index, tensor)
        return out.view(segments, longest, *tensor.shape[1:]).transpose(1, 2)  # (segments, heads, longest, dim)

    qp, kp, vp = padded(q, q_index, longest_query), padded(k, k_index, longest_key), padded(v, k_index, longest_key)
    if groups > 1:
        kp, vp = kp.repeat_interleave(groups, dim=1), vp.repeat_interleave(groups, dim=1)
    # query i sees key j <= i + (keys - queries): causal, aligned to the end of the segment's keys
    offsets = (k_sizes - q_sizes)[:, None, None]
    rows = torch.arange(q_valid.shape[1], device=q.device)[None, :, None]
    columns = torch.arange(k_valid.shape[1], device=q.device)[None, None, :]
    visible = columns <= rows + offsets
    if window is not None:
        visible = visible & (columns > rows + offsets - window)
    # padding rows see every real key: no row is empty, so no NaN reaches the gradients of the real ones
    mask = torch.where(q_valid[:, :, None], visible, True) & k_valid[:, None, :]
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask[:, None], scale=scale)
    else:
        out = explicit_attention(qp, kp, vp, mask[:, None], scale, softcap, sinks)
    return out.transpose(1, 2).reshape(segments * longest_query, out.shape[1], out.shape[-1])[q_index]


def _padded_index(sizes: Tensor, longest: int, tokens: int) -> Tensor:
    """Where each of the ``tokens`` packed tokens (segments of ``sizes`` side by side) sits in the row-major
    (segments, longest) padded layout.

    Computed from the sizes, not by boolean-mask indexing: the mask's indices depend on its data, which
    splits a ``torch.compile`` graph in two (a compiled decoder layer on a path without flash attention).
    """
    ends = torch.cumsum(sizes, 0)
    token = torch.arange(tokens, device=sizes.device)
    segment = torch.searchsorted(ends, token, right=True)
    return token + segment * longest - (ends - sizes)[segment]


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: float | None = None,
                       sinks: Tensor | None = None) -> Tensor:
    """softmax(cap(q k^T * scale) masked [+ sink column]) v, the softmax in float32 as transformers' eager path.

    q (batch, heads, queries, dim), k and v (batch, heads, keys, dim or v dim) with as many heads as q;
    mask broadcastable to (batch, heads, queries, keys), True where a key is visible; sinks (heads,).
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)  # as eager: no NaN in an empty row
    if sinks is not None:
        sink_column = sinks.reshape(1, -1, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, v)
