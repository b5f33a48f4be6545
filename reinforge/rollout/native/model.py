"""The decoder forward of the native engine, run with the transformers model's own modules.

Qwen2, Qwen2.5, Qwen3 and Llama share one layout (RMSNorm, rotary attention with grouped
KV heads, gated SiLU MLP); this module runs that layout over packed tokens with a paged KV
cache. It reads the trainer's parameters in place, with one exception: each layer's q, k and
v projections, and its gate and up projections, run as one matrix product each over weights
concatenated into buffers of the decoder's own (``FusedProjections``; about a third of the
model's weights). Those copies exist while the engine is awake and are refreshed with
``copy_`` (their storage never moves, so captured CUDA graphs stay valid) when the engine
syncs weights; every other parameter, and so an in-place optimizer step to it, is read as is.
On the Triton path the norms, rotary embedding, cache write and SiLU-and-mul are fused
kernels that round as transformers does; the PyTorch path calls the HF norm and activation
modules themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reinforge.rollout.native.attention import (
    AttentionMetadata,
    apply_rotary,
    decode_attention,
    prefill_attention,
    write_kv_cache,
)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the native engine cannot run ``model``, or None when it can."""
    # a subclass of a supported class (a wrapper adding methods) has the same modules
    name = next((cls.__name__ for cls in type(model).__mro__ if cls.__name__ in SUPPORTED_ARCHITECTURES), None)
    if name is None:
        return f"architecture {type(model).__name__} is not one of {', '.join(SUPPORTED_ARCHITECTURES)}"
    config = model.config
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return f"{name} uses sliding-window attention (use_sliding_window=True)"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return f"{name} has layers other than full attention ({sorted(set(config.layer_types))})"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in _STATIC_ROPE_TYPES:
        return f"{name} uses rope_type={rope_type!r}, whose frequencies depend on the sequence length"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"{name} uses hidden_act={config.hidden_act!r}; the engine implements silu"
    return None


def supports_model(model: nn.Module) -> bool:
    """True when the native engine can generate with ``model`` (else use the hf backend)."""
    return unsupported_reason(model) is None


@dataclass
class FusedProjections:
    """One layer's projections that read the same input, concatenated along the output dim.

    qkv_weight: (heads * head_dim + 2 * kv_heads * head_dim, hidden), q then k then v rows;
    gate_up_weight: (2 * intermediate, hidden), gate then up rows. A bias is None when none
    of its projections has one (a projection without a bias contributes zeros).
    """

    qkv_weight: Tensor
    qkv_bias: Tensor | None
    gate_up_weight: Tensor
    gate_up_bias: Tensor | None

    @classmethod
    def concatenated(cls, layer: nn.Module) -> FusedProjections:
        return cls(*(None if parts is None else torch.cat(parts) for parts in _fused_parts(layer)))

    def copy_from(self, layer: nn.Module) -> None:
        """Overwrite the buffers in place with the layer's current weights."""
        for destination, parts in zip(self._fields(), _fused_parts(layer), strict=True):
            start = 0
            for part in parts or ():
                destination[start:start + part.shape[0]].copy_(part)
                start += part.shape[0]

    def tensors(self) -> list[Tensor]:
        return [tensor for tensor in self._fields() if tensor is not None]

    def _fields(self) -> tuple[Tensor | None, ...]:
        return self.qkv_weight, self.qkv_bias, self.gate_up_weight, self.gate_up_bias


def _fused_parts(layer: nn.Module) -> list[list[Tensor] | None]:
    """The pieces of qkv_weight, qkv_bias, gate_up_weight and gate_up_bias, in that order (None: no bias)."""
    attn, mlp = layer.self_attn, layer.mlp
    parts = []
    for linears in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        parts.append([linear.weight for linear in linears])
        if all(linear.bias is None for linear in linears):
            parts.append(None)
        else:
            parts.append([linear.weight.new_zeros(linear.out_features) if linear.bias is None else linear.bias
                          for linear in linears])
    return parts


class PagedDecoder:
    """Embedding, decoder layers and LM head of an HF causal LM over a paged KV cache.

    ``load_fused_projections`` must run before ``forward`` (the engine does it at wake-up).
    """

    def __init__(self, model: nn.Module, max_model_len: int, use_triton: bool):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the native rollout engine cannot run this model: {reason}; "
                             "use the hf rollout backend for it")
        self.model = model
        self.max_model_len = max_model_len
        self.use_triton = use_triton
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_layers = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        self.scale = model.model.layers[0].self_attn.scaling
        self.dtype = model.model.embed_tokens.weight.dtype
        self.device = model.model.embed_tokens.weight.device
        self.has_qk_norm = hasattr(model.model.layers[0].self_attn, "q_norm")
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.cos, self.sin = self._rotary_tables()
        self.fused: list[FusedProjections] | None = None
        """Per layer, while loaded; see ``load_fused_projections``."""

    def _rotary_tables(self) -> tuple[Tensor, Tensor]:
        """cos, sin: (max_model_len, head_dim) in the model dtype, from the model's own rotary module."""
        positions = torch.arange(self.max_model_len, device=self.device)[None, :]
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            cos, sin = self.model.model.rotary_emb(probe, positions)
        return cos[0].contiguous(), sin[0].contiguous()

    @torch.no_grad()
    def load_fused_projections(self) -> None:
        """Copy each layer's q|k|v and gate|up weights into the fused buffers, allocating them if freed.

        Once allocated, the buffers are overwritten in place, so graphs that read them stay valid.
        """
        layers = self.model.model.layers
        if self.fused is None:
            self.fused = [FusedProjections.concatenated(layer) for layer in layers]
            return
        for fused, layer in zip(self.fused, layers, strict=True):
            fused.copy_from(layer)

    def free_fused_projections(self) -> None:
        self.fused = None

    def parameter_pointers(self) -> tuple[int, ...]:
        """Storage addresses of everything a forward reads in place (what a captured graph depends on)."""
        fused = [tensor for layer in self.fused or () for tensor in layer.tensors()]
        return tuple(tensor.data_ptr() for tensor in [*self.model.parameters(), *fused])

    def _norm(self, module: nn.Module, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """RMSNorm of x (or of x + residual, written back into residual) with the module's weight."""
        if self.use_triton:
            from reinforge.rollout.native import triton_kernels

            return triton_kernels.rms_norm(x, module.weight, module.variance_epsilon, residual)
        if residual is not None:
            residual.copy_(residual + x)
            x = residual
        return module(x)

    def _mlp(self, mlp: nn.Module, fused: FusedProjections, x: Tensor) -> Tensor:
        gate_up = F.linear(x, fused.gate_up_weight, fused.gate_up_bias)
        if self.use_triton:
            from reinforge.rollout.native import triton_kernels

            return mlp.down_proj(triton_kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def _attention(self, attn: nn.Module, fused: FusedProjections, x: Tensor, positions: Tensor, k_cache: Tensor,
                   v_cache: Tensor, meta: AttentionMetadata) -> Tensor:
        num_tokens = x.shape[0]
        qkv = F.linear(x, fused.qkv_weight, fused.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q = self._norm(attn.q_norm, q.contiguous())
            k = self._norm(attn.k_norm, k.contiguous())
        if self.use_triton:
            from reinforge.rollout.native import triton_kernels

            triton_kernels.rope_and_write_cache(q, k, v, self.cos, self.sin, positions, meta.slot_mapping,
                                                k_cache, v_cache)
        else:
            cos, sin = self.cos[positions], self.sin[positions]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill:
            out = prefill_attention(q, k, v, meta, self.scale)
        elif self.use_triton:
            from reinforge.rollout.native import triton_kernels

            out = triton_kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                        self.scale)
        else:
            out = decode_attention(q, k_cache, v_cache, meta, self.scale)
        return attn.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def forward(self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                logits_indices: Tensor | None = None) -> Tensor:
        """Logits (rows, vocab) in the model dtype at ``logits_indices`` (every token when None).

        input_ids, positions: (tokens,); kv_cache: (layers, 2, num_blocks, block_size, kv_heads, head_dim).
        """
        assert self.fused is not None, "load_fused_projections() runs before the first forward"
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids)
        residual = hidden
        for index, (layer, fused) in enumerate(zip(inner.layers, self.fused, strict=True)):
            if index == 0:
                residual = hidden.clone()
                normed = self._norm(layer.input_layernorm, hidden)
            else:
                normed = self._norm(layer.input_layernorm, hidden, residual)
            hidden = self._attention(layer.self_attn, fused, normed, positions, kv_cache[index, 0], kv_cache[index, 1],
                                     meta)
            normed = self._norm(layer.post_attention_layernorm, hidden, residual)
            hidden = self._mlp(layer.mlp, fused, normed)
        if logits_indices is not None:
            hidden, residual = hidden[logits_indices], residual[logits_indices]
        return self.model.lm_head(self._norm(inner.norm, hidden, residual))
