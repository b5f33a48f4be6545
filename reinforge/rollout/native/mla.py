"""DeepSeek V2/V3 multi-head latent attention over a compressed paged cache.

Per token the cache holds one shared "head" of ``kv_lora_rank + qk_rope_head_dim`` values: the latent
``c`` (after ``kv_a_layernorm``) and the rotated ``k_rope``, instead of every head's keys and values
(576 values a token for V3 instead of 128 heads x 2 x 192). Attention runs in the latent space: each
head's ``k_nope = W_uk c`` is never formed; its query is absorbed instead (``q_nope W_uk``, one
(nope -> latent) product per head), so the score ``q_nope . k_nope + q_rope . k_rope`` becomes
``[q_nope W_uk | q_rope] . [c | k_rope]``, a multi-query attention with one key head whose values are
the keys themselves. The first ``kv_lora_rank`` dims of its output are the attention-weighted latent,
which ``W_uv`` turns into each head's value output. Prefill, prefill after a prefix-cache hit and
decode all read this one formulation (the existing packed and paged attention functions, with
``v_cache`` = ``k_cache``), so the cache written by a prefill is the one a decode reads.

Rotary embedding: DeepSeek rotates interleaved pairs ``(x0, x1), (x2, x3), ...`` (V2 as a complex
product in float32, V3 in the model dtype; V3 with ``rope_interleave=False`` rotates halves as Llama
does). Both rotated queries and keys are written with the real parts first, then the imaginary parts;
a score is a sum over pairs, so the layout is free as long as the query's and the key's agree. The
attention scale is transformers' (``(nope + rope) ** -0.5``, times yarn's mscale squared).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reinforge.models.architectures import MLASpec
from reinforge.rollout.native.attention import (
    AttentionMetadata,
    apply_rotary,
    prefill_attention,
    prefill_attention_with_prefix,
)


@dataclass
class MLAWeights:
    """The decoder's own copy of one MLA layer's weights.

    in_weight: (q_in + kv_lora_rank + qk_rope_head_dim, hidden), the two projections that read the hidden
    state (``q_a_proj``, or ``q_proj`` without a q low rank, then ``kv_a_proj_with_mqa``) as one product;
    in_bias likewise or None; q_a_norm: (q_lora_rank,) and q_b: (heads * qk_head_dim, q_lora_rank), or None
    without a q low rank; kv_a_norm: (kv_lora_rank,); kv_b: (heads, qk_nope_head_dim + v_head_dim,
    kv_lora_rank), each head's k_nope rows then its v rows; o_weight: (hidden, heads * v_head_dim).
    """

    in_weight: Tensor
    in_bias: Tensor | None
    q_a_norm: Tensor | None
    q_b: Tensor | None
    kv_a_norm: Tensor
    kv_b: Tensor
    o_weight: Tensor
    o_bias: Tensor | None

    @classmethod
    def copied(cls, attn: nn.Module, dtype: torch.dtype, device: torch.device) -> MLAWeights:
        copies = [None if parts is None else torch.cat([part.detach().to(device, dtype) for part in parts])
                  for parts in mla_parts(attn)]
        copies[5] = copies[5].view(attn.num_heads, -1, attn.kv_lora_rank)
        return cls(*copies)

    def destinations(self) -> list[Tensor | None]:
        """The copies in field order (``mla_parts`` gives their sources; kv_b flattened to its source's rows)."""
        return [self.kv_b.flatten(0, 1) if field.name == "kv_b" else getattr(self, field.name)
                for field in fields(self)]

    def tensors(self) -> list[Tensor]:
        return [getattr(self, field.name) for field in fields(self) if getattr(self, field.name) is not None]


def mla_parts(attn: nn.Module) -> list[list[Tensor] | None]:
    """The source tensors of each ``MLAWeights`` field, in field order (None: the field is None)."""
    from reinforge.rollout.native.model import whole

    q_in = attn.q_proj if attn.q_lora_rank is None else attn.q_a_proj
    kv_a = attn.kv_a_proj_with_mqa
    if q_in.bias is None and kv_a.bias is None:
        in_bias = None
    else:
        in_bias = [whole(linear.bias) if linear.bias is not None else whole(linear.weight).new_zeros(linear.out_features)
                   for linear in (q_in, kv_a)]
    low_rank = attn.q_lora_rank is not None
    return [[whole(q_in.weight), whole(kv_a.weight)], in_bias,
            [whole(attn.q_a_layernorm.weight)] if low_rank else None,
            [whole(attn.q_b_proj.weight)] if low_rank else None,
            [whole(attn.kv_a_layernorm.weight)], [whole(attn.kv_b_proj.weight)],
            [whole(attn.o_proj.weight)], None if attn.o_proj.bias is None else [whole(attn.o_proj.bias)]]


def mla_rotary_tables(rotary: nn.Module, max_model_len: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin: (max_model_len, qk_rope_head_dim // 2), one angle per rotated pair, from the model's own rotary
    module (V2's returns complex ``freqs_cis``, V3's cos and sin of ``cat(freqs, freqs)``); float32 for V2's
    complex product, ``dtype`` for V3's rotation in the model dtype."""
    buffer = next(rotary.buffers(), None)
    where = buffer.device if buffer is not None else device
    positions = torch.arange(max_model_len, device=where)[None, :]
    probe = torch.empty(0, dtype=dtype, device=where)
    with torch.no_grad():
        out = rotary(probe, positions)
    if isinstance(out, tuple):
        cos, sin = out
        half = cos.shape[-1] // 2
        return cos[0, :, :half].to(device).contiguous(), sin[0, :, :half].to(device).contiguous()
    return out[0].real.float().to(device).contiguous(), out[0].imag.float().to(device).contiguous()


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding of x: (tokens, heads, rope_dim) by per-token cos, sin: (tokens, rope_dim // 2).

    Interleaved pairs come out real parts first, then imaginary parts (transformers' V3 layout; V2's complex
    product gives the same values interleaved). Computed in cos's dtype, returned in x's."""
    if not interleaved:
        return apply_rotary(x.to(cos.dtype), torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)).to(x.dtype)
    cos, sin = cos[:, None, :], sin[:, None, :]
    real, imaginary = x[..., 0::2].to(cos.dtype), x[..., 1::2].to(cos.dtype)
    return torch.cat([real * cos - imaginary * sin, imaginary * cos + real * sin], dim=-1).to(x.dtype)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def latent_decode_attention(q: Tensor, cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                            scale: float) -> Tensor:
    """One query per sequence over its cached latents, reading every block of its table and masking the unused.

    q: (batch, heads, dim); cache: (num_blocks, block_size, 1, dim); block_tables: (batch, max_blocks);
    context_lens: (batch,). Shapes depend only on the tables' width and nothing waits for the host, so a
    decode CUDA graph captures it. Returns (batch, heads, dim): the keys are the values.
    """
    batch, num_heads, dim = q.shape
    keys = cache[block_tables.long()].reshape(batch, -1, dim)  # (batch, max_blocks * block_size, dim)
    scores = torch.einsum("bhd,bsd->bhs", q.float(), keys.float()) * scale
    visible = torch.arange(keys.shape[1], device=q.device)[None, :] < context_lens[:, None]
    probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("bhs,bsd->bhd", probs.to(keys.dtype), keys)


class MLAAttention:
    """One MLA layer's attention over packed tokens, reading and writing a compressed paged cache."""

    def __init__(self, spec: MLASpec, num_heads: int, scale: float, eps: tuple[float, float], model_type: str):
        self.spec = spec
        self.num_heads = num_heads
        self.scale = scale
        self.q_a_eps, self.kv_a_eps = eps
        self.rotate_in_float32 = model_type == "deepseek_v2"
        self.qk_head_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        self.latent_dim = spec.kv_lora_rank + spec.qk_rope_head_dim
        """Values per token in the cache (kv_lora_rank + qk_rope_head_dim)."""
        self.q_in = num_heads * self.qk_head_dim if spec.q_lora_rank is None else spec.q_lora_rank

    @classmethod
    def of(cls, model: nn.Module, spec: MLASpec) -> MLAAttention:
        attn = model.model.layers[0].self_attn
        q_a_eps = attn.q_a_layernorm.variance_epsilon if attn.q_a_layernorm is not None else 0.0
        return cls(spec, model.config.num_attention_heads, attn.scaling,
                   (q_a_eps, attn.kv_a_layernorm.variance_epsilon), model.config.model_type)

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer's cache: a single head of latent and rotated key per token."""
        return (num_blocks, block_size, 1, self.latent_dim)

    def rotary_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.rotate_in_float32 else dtype

    def project(self, weights: MLAWeights, hidden: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """The absorbed queries (tokens, heads, latent_dim) and the cache entries (tokens, 1, latent_dim).

        cos, sin: (tokens, qk_rope_head_dim // 2), this step's tokens' angles."""
        spec = self.spec
        num_tokens = hidden.shape[0]
        q_in, latent, k_rope = F.linear(hidden, weights.in_weight, weights.in_bias).split(
            [self.q_in, spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
        if weights.q_b is not None:
            q_in = F.linear(_rms_norm(q_in, weights.q_a_norm, self.q_a_eps), weights.q_b)
        q_nope, q_rope = q_in.reshape(num_tokens, self.num_heads, self.qk_head_dim).split(
            [spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
        latent = _rms_norm(latent, weights.kv_a_norm, self.kv_a_eps)
        q_rope = rotate_pairs(q_rope, cos, sin, spec.rope_interleave)
        k_rope = rotate_pairs(k_rope[:, None, :], cos, sin, spec.rope_interleave)
        q_latent = torch.einsum("thn,hnl->thl", q_nope, weights.kv_b[:, : spec.qk_nope_head_dim])
        query = torch.cat([q_latent, q_rope], dim=-1)
        entry = torch.cat([latent[:, None, :], k_rope], dim=-1)
        return query, entry

    def forward(self, weights: MLAWeights, hidden: Tensor, cos: Tensor, sin: Tensor, cache: Tensor,
                meta: AttentionMetadata) -> Tensor:
        """hidden: (tokens, hidden) -> the attention's output projection (tokens, hidden).

        cache: (num_blocks, block_size, 1, latent_dim) (``cache_shape``); cos, sin as in ``project``."""
        query, entry = self.project(weights, hidden, cos, sin)
        cache.view(-1, 1, self.latent_dim)[meta.slot_mapping] = entry
        if meta.is_prefill and meta.prefix_lens is not None:
            out = prefill_attention_with_prefix(query, cache, cache, meta, self.scale)
        elif meta.is_prefill:
            out = prefill_attention(query, entry, entry, meta, self.scale)
        else:
            out = latent_decode_attention(query, cache, meta.block_tables, meta.context_lens, self.scale)
        values = torch.einsum("thl,hvl->thv", out[..., : self.spec.kv_lora_rank],
                              weights.kv_b[:, self.spec.qk_nope_head_dim:])
        return F.linear(values.reshape(hidden.shape[0], -1), weights.o_weight, weights.o_bias)
