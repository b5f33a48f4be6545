"""Triton kernels for ``engine.log_probs``: log-prob, entropy and their gradient, one pass per row.

``row_stats`` reads each row of logits once and keeps, per lane, a running maximum, the sum
of ``exp(z - max)`` and the sum of ``exp(z - max) * z`` (both rescaled when the maximum
grows), with ``z = logits / temperature`` in float32; the lanes are merged at the end into
the log-sum-exp, the entropy ``lse - E[z]`` and the target's log-prob. ``row_grads`` reads
each row once more and writes the gradient of the logits, possibly over the logits
themselves. Compared with the same math in separate PyTorch or compiled reductions, the
logits are read once forward and once backward. The vocabulary size is a compile-time
constant (one compilation per model). A model's ``logit_scale`` and final soft-cap
(``engine.log_probs.model_logits``) are applied to each element as it is read. Importing this module needs Triton; the
engine imports it only on CUDA (tests run it under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _model_logits(x, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    x = x * logit_scale
    if HAS_SOFTCAP:
        x = softcap * _tanh(x / softcap)
    return x


@triton.jit
def _row_stats_kernel(logits_ptr, stride, targets_ptr, inv_temperature, log_probs_ptr, entropy_ptr, lse_ptr,
                      logit_scale, softcap, vocab_size: tl.constexpr, BLOCK: tl.constexpr,
                      HAS_SOFTCAP: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    lanes = tl.arange(0, BLOCK)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    lane_zsum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab_size, BLOCK):
        cols = start + lanes
        in_vocab = cols < vocab_size
        z = _model_logits(tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32), logit_scale, softcap,
                          HAS_SOFTCAP) * inv_temperature
        z = tl.where(in_vocab, z, float("-inf"))
        new_max = tl.maximum(lane_max, z)
        seen = new_max > float("-inf")
        rescale = tl.where(seen, tl.exp(lane_max - new_max), 0.0)
        weight = tl.where(in_vocab, tl.exp(z - new_max), 0.0)
        lane_sum = lane_sum * rescale + weight
        lane_zsum = lane_zsum * rescale + weight * tl.where(in_vocab, z, 0.0)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    to_row = tl.where(lane_max > float("-inf"), tl.exp(lane_max - row_max), 0.0)
    total = tl.sum(lane_sum * to_row, axis=0)
    z_total = tl.sum(lane_zsum * to_row, axis=0)
    lse = row_max + tl.log(total)
    target = tl.load(targets_ptr + row)
    z_target = _model_logits(tl.load(row_ptr + target).to(tl.float32), logit_scale, softcap,
                             HAS_SOFTCAP) * inv_temperature
    tl.store(log_probs_ptr + row, z_target - lse)
    tl.store(entropy_ptr + row, lse - z_total / total)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _row_grads_kernel(logits_ptr, stride, grads_ptr, grad_stride, targets_ptr, lse_ptr, entropy_ptr,
                      grad_log_probs_ptr, grad_entropy_ptr, inv_temperature, logit_scale, softcap,
                      vocab_size: tl.constexpr, BLOCK: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    out_ptr = grads_ptr + row.to(tl.int64) * grad_stride
    lse = tl.load(lse_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    g_lp = tl.load(grad_log_probs_ptr + row)
    g_ent = tl.load(grad_entropy_ptr + row)
    target = tl.load(targets_ptr + row)
    lanes = tl.arange(0, BLOCK)
    for start in range(0, vocab_size, BLOCK):
        cols = start + lanes
        in_vocab = cols < vocab_size
        x = tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32) * logit_scale
        slope = logit_scale
        if HAS_SOFTCAP:
            capped = _tanh(x / softcap)
            x = softcap * capped
            slope = logit_scale * (1.0 - capped * capped)
        z = x * inv_temperature
        log_p = z - lse
        # d log p_y / dz = onehot(y) - p;  d H / dz = -p (log p + H)
        grad = -tl.exp(log_p) * (g_lp + (log_p + entropy) * g_ent) + tl.where(cols == target, g_lp, 0.0)
        tl.store(out_ptr + cols, (grad * inv_temperature * slope).to(out_ptr.dtype.element_ty), mask=in_vocab)


def _block(vocab_size: int) -> int:
    return min(4096, max(16, triton.next_power_of_2(vocab_size)))


def row_stats(logits: Tensor, targets: Tensor, inv_temperature: float, logit_scale: float = 1.0,
              softcap: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Log-prob of each row's target, entropy and log-sum-exp of ``model_logits(logits) * inv_temperature``;
    float32 (rows,)."""
    rows, vocab_size = logits.shape
    log_probs, entropy, lse = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    if rows:
        _row_stats_kernel[(rows,)](logits, logits.stride(0), targets, inv_temperature, log_probs, entropy, lse,
                                   float(logit_scale), float(softcap or 1.0), vocab_size=vocab_size,
                                   BLOCK=_block(vocab_size), HAS_SOFTCAP=softcap is not None, num_warps=8)
    return log_probs, entropy, lse


def row_grads(logits: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor, grad_log_probs: Tensor,
              grad_entropy: Tensor, inv_temperature: float, out: Tensor | None = None, logit_scale: float = 1.0,
              softcap: float | None = None) -> Tensor:
    """Gradient of the logits (in their dtype) given those of the log-probs and entropies; ``out`` may be ``logits``."""
    rows, vocab_size = logits.shape
    out = torch.empty_like(logits) if out is None else out
    if rows:
        _row_grads_kernel[(rows,)](logits, logits.stride(0), out, out.stride(0), targets, lse, entropy,
                                   grad_log_probs.float().contiguous(), grad_entropy.float().contiguous(),
                                   inv_temperature, float(logit_scale), float(softcap or 1.0), vocab_size=vocab_size,
                                   BLOCK=_block(vocab_size), HAS_SOFTCAP=softcap is not None, num_warps=8)
    return out
