"""The decoder forward of the native engine, run with the transformers model's own modules.

Qwen2, Qwen2.5, Qwen3 and Llama share one layout (RMSNorm, rotary attention with grouped
KV heads, gated SiLU MLP); this module runs that layout over packed tokens with a paged KV
cache, calling the HF model's projection and norm modules directly, so the engine reads
the trainer's parameters in place: nothing is copied and an optimizer step is seen at once.
On the Triton path the norms, rotary embedding, cache write and SiLU-and-mul are fused
kernels that round as transformers does; the PyTorch path calls the HF modules themselves.
"""

from __future__ import annotations

import torch
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
    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        return f"architecture {name} is not one of {', '.join(SUPPORTED_ARCHITECTURES)}"
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


class PagedDecoder:
    """Embedding, decoder layers and LM head of an HF causal LM over a paged KV cache."""

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
        self.cos, self.sin = self._rotary_tables()

    def _rotary_tables(self) -> tuple[Tensor, Tensor]:
        """cos, sin: (max_model_len, head_dim) in the model dtype, from the model's own rotary module."""
        positions = torch.arange(self.max_model_len, device=self.device)[None, :]
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            cos, sin = self.model.model.rotary_emb(probe, positions)
        return cos[0].contiguous(), sin[0].contiguous()

    def parameter_pointers(self) -> tuple[int, ...]:
        return tuple(parameter.data_ptr() for parameter in self.model.parameters())

    def _norm(self, module: nn.Module, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """RMSNorm of x (or of x + residual, written back into residual) with the module's weight."""
        if self.use_triton:
            from reinforge.rollout.native import triton_kernels

            return triton_kernels.rms_norm(x, module.weight, module.variance_epsilon, residual)
        if residual is not None:
            residual.copy_(residual + x)
            x = residual
        return module(x)

    def _mlp(self, mlp: nn.Module, x: Tensor) -> Tensor:
        if self.use_triton:
            from reinforge.rollout.native import triton_kernels

            return mlp.down_proj(triton_kernels.silu_and_mul(mlp.gate_proj(x), mlp.up_proj(x)))
        return mlp(x)

    def _attention(self, attn: nn.Module, x: Tensor, positions: Tensor, k_cache: Tensor, v_cache: Tensor,
                   meta: AttentionMetadata) -> Tensor:
        num_tokens = x.shape[0]
        q = attn.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = attn.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
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
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids)
        residual = hidden
        for index, layer in enumerate(inner.layers):
            if index == 0:
                residual = hidden.clone()
                normed = self._norm(layer.input_layernorm, hidden)
            else:
                normed = self._norm(layer.input_layernorm, hidden, residual)
            hidden = self._attention(layer.self_attn, normed, positions, kv_cache[index, 0], kv_cache[index, 1], meta)
            normed = self._norm(layer.post_attention_layernorm, hidden, residual)
            hidden = self._mlp(layer.mlp, normed)
        if logits_indices is not None:
            hidden, residual = hidden[logits_indices], residual[logits_indices]
        return self.model.lm_head(self._norm(inner.norm, hidden, residual))
