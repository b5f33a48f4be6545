"""The blocks of a decoder layer the native engine runs, chosen per layer from the architecture table.

A decoder layer is a norm placement (``ArchitectureSpec.norm_placement``, run by ``PagedDecoder``) around two
blocks, an attention block and an MLP block, which ``PagedDecoder`` picks per layer (``attention_block``,
``mlp_block`` in model.py). Every block has the same three parts:

- ``sources(module)``: the weights it reads, as copy name -> the module's tensors concatenated along dim 0
  into that copy (None: the block has no such weight). The decoder makes and refreshes the copies and hands
  the layer's copies to ``forward`` as one dict, so names are unique within a layer.
- ``float32_copies``: copy names kept in float32 whatever the model dtype (a router kept in float32).
- ``forward(weights, x, ...)``: the block's output for packed tokens x (tokens, hidden); an MLP block's also
  takes ``decode``, whether x is a decode step's.

An attention block also says what one token's cache entry is (``cache_entry``: (entries, heads, dim); k and v
of the KV heads here, one latent head for MLA) and reads its layer's slice of the cache,
(entries, num_blocks, block_size, heads, dim). On the Triton path the norms, rotary embedding, cache write
and gated activation are fused kernels that round as transformers does; the PyTorch path writes
transformers' own math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reinforge.models.architectures import ArchitectureSpec, LayerSpec
from reinforge.rollout.native.attention import (
    AttentionMetadata,
    decode_attention,
    packed_prefix_attention,
    prefill_attention,
    prefill_attention_with_prefix,
    write_kv_cache,
)
from reinforge.rollout.native.kv_quant import layer_caches
from reinforge.rollout.native.rotary_tables import RotaryTables

if TYPE_CHECKING:
    from reinforge.rollout.native.dense_choice import DenseMLPChoice

Parts = list[Tensor] | None
"""Source tensors concatenated along dim 0 into one copy; None: no such weight."""
LayerWeights = dict[str, Tensor | None]
"""One layer's copies by name (its norms' and both blocks')."""

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
"""The gated MLP activations the engine runs (``ArchitectureSpec.activation``)."""


def rms_norm(x: Tensor, weight: Tensor, eps: float, kind: str) -> Tensor:
    """transformers' RMSNorm of each kind (``ArchitectureSpec.norm``): float32 statistics; llama casts the
    normalised value back before multiplying the weight, gemma multiplies (1 + w) and olmo w in float32."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "llama":
        return weight * hidden.to(x.dtype)
    if kind == "gemma":
        return (hidden * (1.0 + weight.float())).to(x.dtype)
    return (weight * hidden).to(x.dtype)


@dataclass
class BlockContext:
    """What every block of a decoder reads: the table, the text config, the path and the rotary tables."""

    spec: ArchitectureSpec
    config: Any
    dtype: torch.dtype
    use_triton: bool
    flash_prefix: bool
    rotary: RotaryTables
    timed_products: bool = False
    """A decode step's q|k|v, o and MLP products run by what ``dense_choice.DenseMLPChoice`` timed fastest
    (rollout.decode_products=timed); else cuBLAS's."""

    @property
    def eps(self) -> float:
        return self.config.rms_norm_eps

    def norm(self, weight: Tensor, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """RMSNorm of x (or of x + residual, written back into residual) with ``weight``, of the table's kind."""
        if self.use_triton:
            from reinforge.rollout.native import triton_kernels

            return triton_kernels.rms_norm(x, weight, self.eps, residual, self.spec.norm)
        if residual is not None:
            residual.copy_(residual + x)
            x = residual
        return rms_norm(x, weight, self.eps, self.spec.norm)


def concatenated(linears: tuple[nn.Linear, ...]) -> tuple[Parts, Parts]:
    """Weight and bias parts of linears reading the same input (a missing bias contributes zeros; None: no bias)."""
    weights = [linear.weight for linear in linears]
    if all(linear.bias is None for linear in linears):
        return weights, None
    return weights, [linear.weight.new_zeros(linear.out_features) if linear.bias is None else linear.bias
                     for linear in linears]


class DenseAttention:
    """Rotary attention with grouped KV heads: rotary of the layer's kind (global, local or none; whole or
    partial), q/k norms per head or over the projection, a sliding window and a score soft-cap per the table. On
    the Triton path with ``timed_products`` a decode step's q|k|v and o products run by what
    ``DenseMLPChoice.linear`` timed fastest."""

    float32_copies: frozenset[str] = frozenset()

    def __init__(self, context: BlockContext, layer: LayerSpec):
        spec, config = context.spec, context.config
        self.context = context
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = spec.attn_scale
        self.softcap = spec.attn_softcap
        self.window = layer.sliding_window
        self.rope = layer.rope
        self.cache_entry = (2, self.num_kv_heads, self.head_dim)
        self.products: DenseMLPChoice | None = None
        """With ``timed_products``, what runs a decode step's q|k|v and o products (``DenseMLPChoice.linear``)."""
        if context.timed_products:
            from reinforge.rollout.native.dense_choice import dense_mlp_choice

            self.products = dense_mlp_choice()

    def sources(self, attention: nn.Module) -> dict[str, Parts]:
        if self.context.spec.fused_qkv:
            qkv = ([attention.qkv_proj.weight], None if attention.qkv_proj.bias is None else [attention.qkv_proj.bias])
        else:
            qkv = concatenated((attention.q_proj, attention.k_proj, attention.v_proj))
        has_norms = self.context.spec.qk_norm is not None
        return {"qkv_weight": qkv[0], "qkv_bias": qkv[1],
                "q_norm": [attention.q_norm.weight] if has_norms else None,
                "k_norm": [attention.k_norm.weight] if has_norms else None,
                "o_weight": [attention.o_proj.weight],
                "o_bias": None if attention.o_proj.bias is None else [attention.o_proj.bias]}

    def forward(self, weights: LayerWeights, x: Tensor, positions: Tensor, cache: Tensor,
                meta: AttentionMetadata) -> Tensor:
        context = self.context
        num_tokens = x.shape[0]
        linear = self.products.linear if self.products is not None and not meta.is_prefill and x.is_cuda else F.linear
        qkv = linear(x, weights["qkv_weight"], weights["qkv_bias"])
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if context.spec.qk_norm == "projection":  # OLMo 2: over all heads of the projection, before the split
            q, k = context.norm(weights["q_norm"], q), context.norm(weights["k_norm"], k)
        if context.spec.clip_qkv is not None:  # OLMoE: q and k after their norms, and v
            clip = context.spec.clip_qkv
            q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        head_norms = context.spec.qk_norm == "head"
        if head_norms and not context.use_triton:  # the Triton path normalises the heads in its rotary kernel
            q = context.norm(weights["q_norm"], q)
            k = context.norm(weights["k_norm"], k)
        k_cache, v_cache = (cache[0], cache[1]) if cache.dtype != torch.uint8 else \
            layer_caches(cache, self.num_kv_heads, self.head_dim, q.dtype)  # fp8 (kv_quant.py)
        cos, sin = context.rotary.cos_sin(self.rope)
        if context.use_triton:
            from reinforge.rollout.native import triton_kernels

            triton_kernels.rope_and_write_cache(
                q, k, v, cos, sin, positions, meta.slot_mapping, k_cache, v_cache,
                (weights["q_norm"], weights["k_norm"], context.eps, context.spec.norm) if head_norms else None)
        else:
            if cos is not None:
                cos, sin = cos[positions], sin[positions]
                q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
            write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        window, softcap = self.window, self.softcap
        if meta.is_prefill and meta.prefix_lens is not None:
            if context.flash_prefix and softcap is None:
                out = packed_prefix_attention(q, k_cache, v_cache, meta, self.scale, window)
            else:
                out = prefill_attention_with_prefix(q, k_cache, v_cache, meta, self.scale, window, softcap)
        elif meta.is_prefill:
            out = prefill_attention(q, k, v, meta, self.scale, window, softcap)
        elif context.use_triton:
            from reinforge.rollout.native import triton_kernels

            out = triton_kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                        self.scale, softcap, window, prefix=meta.shared_prefix,
                                                        **meta.decode_tiling.options())
        else:
            out = decode_attention(q, k_cache, v_cache, meta, self.scale, window, softcap)
        return linear(out.reshape(num_tokens, self.q_size), weights["o_weight"], weights["o_bias"])


def apply_partial_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x*cos + rotate_half(x)*sin on the first cos.shape[-1] dims of each head, the rest passed through, as
    transformers computes it. x: (tokens, heads, dim); cos, sin: (tokens, rotary_dim). Tables in float32 under a
    lower-precision x (OLMo 2's rotary module keeps them so) rotate in float32, rounded to x's dtype after."""
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    turned = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1)
    out = (rotated * cos[:, None, :] + turned * sin[:, None, :]).to(x.dtype)
    return out if passed.shape[-1] == 0 else torch.cat((out, passed), dim=-1)


class DenseMLP:
    """down(act(gate(x)) * up(x)), gate and up as one product (Phi-3's gate_up_proj as it is stored). With
    ``timed_products`` a decode step's products run by the kernels ``dense_choice.DenseMLPChoice`` timed fastest for
    its rows (cuBLAS's, or the swapped ones of ``dense_kernels.py``)."""

    float32_copies: frozenset[str] = frozenset()

    def __init__(self, context: BlockContext, layer: LayerSpec):
        self.context = context
        self.activation = context.spec.activation
        self.kernels: DenseMLPChoice | None = None
        if context.timed_products:
            from reinforge.rollout.native.dense_choice import dense_mlp_choice

            self.kernels = dense_mlp_choice()

    def sources(self, mlp: nn.Module) -> dict[str, Parts]:
        if self.context.spec.fused_gate_up:
            gate_up = ([mlp.gate_up_proj.weight], None if mlp.gate_up_proj.bias is None else [mlp.gate_up_proj.bias])
        else:
            gate_up = concatenated((mlp.gate_proj, mlp.up_proj))
        return {"gate_up_weight": gate_up[0], "gate_up_bias": gate_up[1], "down_weight": [mlp.down_proj.weight],
                "down_bias": None if mlp.down_proj.bias is None else [mlp.down_proj.bias]}

    def forward(self, weights: LayerWeights, x: Tensor, decode: bool = False) -> Tensor:
        """x: (tokens, hidden) -> (tokens, hidden); ``decode``: x is a decode step's (one token a sequence)."""
        if decode and self.kernels is not None and x.is_cuda:
            from reinforge.rollout.native.dense_kernels import MLPWeights

            return self.kernels(x, MLPWeights(weights["gate_up_weight"], weights["gate_up_bias"],
                                              weights["down_weight"], weights["down_bias"]), self.activation)
        gate_up = F.linear(x, weights["gate_up_weight"], weights["gate_up_bias"])
        if self.context.use_triton:
            from reinforge.rollout.native import triton_kernels

            activated = triton_kernels.act_and_mul(gate_up, self.activation)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            activated = ACTIVATIONS[self.activation](gate) * up
        return F.linear(activated, weights["down_weight"], weights["down_bias"])
