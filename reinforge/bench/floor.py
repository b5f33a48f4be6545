"""The rollout's memory-bandwidth floor: the least time its decode steps can take on a device.

A decode step of a batch is bound by what it reads from device memory: the KV cache of every live
sequence and the weights. The floor adds, over the decode steps, the bytes a step must read and
divides by the rate a device copy reaches (``COPY_BYTES_PER_S``); no kernel reads faster than a copy
moves the same bytes. What a step reads:

- KV: each live sequence's cached tokens (its prompt and the tokens generated before the step), the
  bytes the engine's cache holds per token (``kv_token_bytes``: K and V of every layer, or DeepSeek's
  latent and rotary key; with ``kv_cache_dtype="fp8"`` a byte a value plus a float32 scale per token and
  KV head, ``models/kv_layout.py``), a sliding-window layer at most its window of them;
- weights: every parameter once, except the input embeddings of an untied model (a step reads only
  its batch's rows); of a mixture-of-experts layer only the experts the step's tokens choose, on
  average ``E (1 - (1 - k/E)^B)`` of E experts for B live sequences choosing k each.

Sequence i with prompt P_i and R_i generated tokens takes its first token from the prefill, so it is live for
R_i - 1 decode steps and reads P_i + t cached tokens at step t (the token it feeds included); a step runs while
any sequence is live. The prefill (compute-bound) and the sampler are left out, so a rollout's time over its
floor says how far its decode is from the device's limit. Qwen2.5-1.5B with 128 sequences of 128 + 8,192
tokens: 28,672 bytes of KV per token, 3.1 GB of weights, 8,191 steps, 36.3 s; with an fp8 cache 14,784 bytes
per token, 21.7 s.

With many live sequences a step's weight products stop being bound by reading the weights: at 512
sequences Gemma-2-2B's products are 2.7 TFLOP a step, 3.3 ms at the 799 TFLOP/s a bf16 product reached on
the same H200 (``MATMUL_FLOPS_PER_S``), against 1.3 ms to read their 5.2 GB. ``RolloutFloor.roofline_seconds``
counts each step's products at the longer of the two (2 FLOPs per weight a token reads, a mixture of experts'
layers at their top-k experts a token) beside the KV read, which stays bound by bytes (a query head does 2
FLOPs per bf16 value of K and V it reads, 1 a byte, and g a byte for a KV head that g query heads share: 8 for
Qwen3-30B-A3B, far below the device's ratio of about 190).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from reinforge.engine.memory_plan import ModelShape
from reinforge.engine.perf import MEASURED_BF16_FLOPS, capped_sum

COPY_BYTES_PER_S = 4.19e12
"""Bytes per second a device-to-device copy reached on this project's H200 (2026-12-02, the decode-step
profile of docs/performance.md): the most its memory gave; ``--bandwidth-tbps`` of the benches sets another device's."""

MATMUL_FLOPS_PER_S = MEASURED_BF16_FLOPS["H200"]
"""FLOP/s a bf16 matrix product reached on the same H200 (``engine.perf``): the roofline's compute side."""


@dataclass(frozen=True)
class RolloutFloor:
    seconds: float
    decode_steps: int
    kv_bytes: float
    """Read from the KV cache over all steps."""
    weight_bytes: float
    """Read from the weights over all steps."""
    roofline_seconds: float = 0.0
    """The floor with each step's weight products at the longer of reading their weights and computing them at
    the matrix-product rate (``MATMUL_FLOPS_PER_S``); the KV read stays at the copy rate. At least ``seconds``."""
    product_flops: float = 0.0
    """The weight products' FLOPs over all steps."""
    shared_prompt_seconds: float | None = None
    """The floor when each group of samples of one prompt reads its prompt's whole blocks once a step (on the
    full-attention layers and the sliding ones that never slide past the prompt; ``rollout.shared_prefix_decode``);
    None without groups."""

    def as_dict(self) -> dict[str, float]:
        shared = {} if self.shared_prompt_seconds is None else {"rollout_floor_shared_prompts_s":
                                                                 self.shared_prompt_seconds}
        return {"rollout_floor_s": self.seconds, "rollout_floor_decode_steps": float(self.decode_steps),
                "rollout_floor_kv_gb": self.kv_bytes / 1e9, "rollout_floor_weight_gb": self.weight_bytes / 1e9,
                "rollout_floor_roofline_s": self.roofline_seconds, "rollout_floor_product_tflop": self.product_flops / 1e12,
                **shared}


def decode_weight_bytes(shape: ModelShape, num_live: np.ndarray, value_bytes: float = 2.0) -> np.ndarray:
    """Weight bytes one decode step reads with ``num_live`` sequences (an array of steps' batch sizes)."""
    params = shape.num_params - (0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size)
    num_live = np.asarray(num_live, dtype=np.float64)
    if not shape.num_experts:
        return np.full(num_live.shape, params * value_bytes)
    experts, top_k = shape.num_experts, shape.experts_per_token
    per_expert = 3 * shape.hidden_size * shape.expert_intermediate_size
    dense = params - shape.num_sparse_layers * experts * per_expert
    touched = experts * (1.0 - (1.0 - top_k / experts) ** num_live)
    return (dense + shape.num_sparse_layers * touched * per_expert) * value_bytes


def decode_product_flops(shape: ModelShape, num_live: np.ndarray) -> np.ndarray:
    """FLOPs of one decode step's weight products with ``num_live`` sequences (an array of steps' batch sizes): 2 a
    weight a token multiplies, every weight but the input embeddings of an untied model, of a mixture-of-experts
    layer only the ``experts_per_token`` experts a token runs through."""
    params = shape.num_active_params - (0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size)
    return 2.0 * params * np.asarray(num_live, dtype=np.float64)


def kv_token_bytes(shape: ModelShape, kv_cache_dtype: str = "auto", value_bytes: float = 2.0) -> float:
    """Bytes the rollout's KV cache holds per token over every layer: the model dtype's ``value_bytes`` a value
    (``kv_cache_dtype="auto"``), or fp8's byte a value plus a float32 scale per KV head (132 bytes for each
    128-dim head's K or V, against bf16's 256)."""
    return shape.kv_block_bytes(1, kv_cache_dtype, value_bytes)


def shared_prompt_tokens(prompt_lengths: np.ndarray, decodes: np.ndarray, groups: Sequence[int], page: int
                         ) -> float:
    """Cached tokens a layer's decode steps read fewer when each group of sequences (``groups``: one id per
    sequence, samples of one prompt) reads its prompt's whole blocks once a step: the group's whole-block prompt
    tokens S, read by each of its L live members before, once while any lives, sum D - max D over its members'
    decode steps D."""
    saved = 0.0
    ids = np.asarray(groups)
    for group in np.unique(ids):
        members = ids == group
        if members.sum() < 2:
            continue
        shared = float(prompt_lengths[members].min()) // page * page
        saved += shared * float(decodes[members].sum() - decodes[members].max())
    return saved


def rollout_floor(shape: ModelShape, prompt_lengths: Sequence[int], response_lengths: Sequence[int],
                  kv_cache_dtype: str = "auto", value_bytes: float = 2.0,
                  bytes_per_s: float = COPY_BYTES_PER_S, flops_per_s: float = MATMUL_FLOPS_PER_S,
                  groups: Sequence[int] | None = None, page: int = 16) -> RolloutFloor:
    """The floor of decoding ``response_lengths`` tokens after ``prompt_lengths`` (one entry per sequence, all
    sequences decoding together), with weights of ``value_bytes`` a value (2: bf16) and the KV cache of
    ``kv_cache_dtype`` (auto: the weights' dtype; fp8); its roofline with products at ``flops_per_s``. With
    ``groups`` (a prompt id per sequence) also the floor when a group's prompt blocks of ``page`` tokens are read
    once a step (``shared_prompt_tokens``; on the full-attention layers, and on sliding-window layers whose window
    holds every sequence's whole context, where the prompt never leaves it)."""
    if len(prompt_lengths) != len(response_lengths):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(response_lengths)} responses; "
                         "give one of each per sequence")
    prompts = np.asarray(prompt_lengths, dtype=np.float64)
    decodes = np.maximum(np.asarray(response_lengths, dtype=np.int64) - 1, 0)  # the first token is the prefill's
    steps = int(decodes.max()) if len(decodes) else 0
    per_layer = kv_token_bytes(shape, kv_cache_dtype, value_bytes) / shape.num_layers
    windows = shape.attention_windows or (0,) * shape.num_layers
    kv_tokens = sum(float(capped_sum(prompts + 1, decodes, window).sum()) for window in windows)
    live = len(decodes) - np.searchsorted(np.sort(decodes), np.arange(1, steps + 1), side="left")
    step_weights = decode_weight_bytes(shape, live, value_bytes)
    step_flops = decode_product_flops(shape, live)
    weights, flops = float(step_weights.sum()), float(step_flops.sum())
    kv_bytes = kv_tokens * per_layer
    products = float(np.maximum(step_weights / bytes_per_s, step_flops / flops_per_s).sum())
    shared = None
    if groups is not None:
        longest = float((prompts + decodes).max()) if len(decodes) else 0.0
        sharing_layers = sum(1 for window in windows if not window or longest <= window)
        kv_shared = kv_bytes - sharing_layers * per_layer * shared_prompt_tokens(prompts, decodes, groups, page)
        shared = (kv_shared + weights) / bytes_per_s
    return RolloutFloor((kv_bytes + weights) / bytes_per_s, steps, kv_bytes, weights,
                        kv_bytes / bytes_per_s + products, flops, shared)


def context_floor_ms(shape: ModelShape, num_sequences: int, context: int, kv_cache_dtype: str = "auto",
                     value_bytes: float = 2.0, bytes_per_s: float = COPY_BYTES_PER_S) -> float:
    """Milliseconds of one decode step of ``num_sequences`` sequences that each hold ``context`` cached tokens."""
    per_layer = kv_token_bytes(shape, kv_cache_dtype, value_bytes) / shape.num_layers
    windows = shape.attention_windows or (0,) * shape.num_layers
    kv_bytes = num_sequences * per_layer * sum(min(context, window) if window else context for window in windows)
    weights = float(decode_weight_bytes(shape, np.array([num_sequences]), value_bytes)[0])
    return 1e3 * (kv_bytes + weights) / bytes_per_s
