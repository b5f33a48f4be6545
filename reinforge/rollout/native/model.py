"""The decoder forward of the native engine for transformers' Qwen2/Qwen3/Llama models.

Qwen2, Qwen2.5, Qwen3 and Llama share one layout (RMSNorm, rotary attention with grouped
KV heads, gated SiLU MLP); this module runs that layout over packed tokens with a paged KV
cache. It reads its own copy of the weights (``ModelWeights``), made from the model's
parameters at wake-up and refreshed in place with ``copy_`` at each weight sync, so the
storage a captured CUDA graph reads never moves: graphs outlive the trainer's parameters
being resharded, freed or moved, and the trainer may free its gathered parameters as soon as
the copy is made. Each layer's q, k and v projections, and its gate and up projections, are
concatenated in the copy so that each group runs as one matrix product. On the Triton path
the norms, rotary embedding, cache write and SiLU-and-mul are fused kernels that round as
transformers does; the PyTorch path writes transformers' own math.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from reinforge.rollout.native.attention import (
    AttentionMetadata,
    apply_rotary,
    decode_attention,
    flash_prefix_applies,
    packed_prefix_attention,
    prefill_attention,
    prefill_attention_with_prefix,
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
class LayerWeights:
    """The decoder's own copy of one layer's weights.

    qkv_weight: (heads * head_dim + 2 * kv_heads * head_dim, hidden), q then k then v rows;
    gate_up_weight: (2 * intermediate, hidden), gate then up rows: the projections that read the
    same input are concatenated, so each runs as one matrix product. A concatenated bias is None
    when none of its projections has one (a projection without a bias contributes zeros); the
    q/k norms are None for models without them (all but Qwen3).
    """

    input_norm: Tensor
    qkv_weight: Tensor
    qkv_bias: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    o_weight: Tensor
    o_bias: Tensor | None
    post_norm: Tensor
    gate_up_weight: Tensor
    gate_up_bias: Tensor | None
    down_weight: Tensor
    down_bias: Tensor | None


@dataclass
class ModelWeights:
    """The decoder's own copy of every weight its forward reads (``lm_head`` is ``embed`` when tied)."""

    embed: Tensor
    layers: list[LayerWeights]
    final_norm: Tensor
    lm_head: Tensor

    @classmethod
    def copied(cls, model: nn.Module, dtype: torch.dtype, device: torch.device) -> ModelWeights:
        def build(parts: list[Tensor] | None) -> Tensor | None:
            return None if parts is None else torch.cat([whole(part).detach().to(device, dtype) for part in parts])

        inner = model.model
        embed = build([inner.embed_tokens.weight])
        layers = [LayerWeights(*(build(parts) for parts in _layer_parts(layer))) for layer in inner.layers]
        lm_head = embed if _tied(model) else build([model.lm_head.weight])
        return cls(embed, layers, build([inner.norm.weight]), lm_head)

    @torch.no_grad()
    def copy_from(self, model: nn.Module) -> None:
        """Overwrite every copy in place with the model's current weights."""
        inner = model.model
        pairs = [(self.embed, [inner.embed_tokens.weight]), (self.final_norm, [inner.norm.weight])]
        if self.lm_head is not self.embed:
            pairs.append((self.lm_head, [model.lm_head.weight]))
        for weights, layer in zip(self.layers, inner.layers, strict=True):
            pairs.extend(zip(_fields(weights), _layer_parts(layer), strict=True))
        destinations, sources = [], []
        for destination, parts in pairs:
            start = 0
            for part in parts or ():
                destinations.append(destination[start:start + part.shape[0]])
                sources.append(whole(part))
                start += part.shape[0]
        if sources and sources[0].device != destinations[0].device:  # parameters offloaded to the CPU
            for destination, source in zip(destinations, sources, strict=True):
                destination.copy_(source)
        else:
            torch._foreach_copy_(destinations, sources)  # a few launches instead of one per tensor

    def linear_slices(self, model: nn.Module) -> dict[int, Tensor]:
        """id(linear layer of ``model``) -> the rows of this copy that hold its weight (q, k, v share qkv_weight)."""
        slices: dict[int, Tensor] = {}
        for weights, layer in zip(self.layers, model.model.layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            for destination, linears in ((weights.qkv_weight, (attn.q_proj, attn.k_proj, attn.v_proj)),
                                         (weights.o_weight, (attn.o_proj,)),
                                         (weights.gate_up_weight, (mlp.gate_proj, mlp.up_proj)),
                                         (weights.down_weight, (mlp.down_proj,))):
                start = 0
                for linear in linears:
                    slices[id(linear)] = destination[start:start + linear.out_features]
                    start += linear.out_features
        return slices

    def tensors(self) -> list[Tensor]:
        layer_tensors = [tensor for layer in self.layers for tensor in _fields(layer) if tensor is not None]
        return [self.embed, self.final_norm, self.lm_head, *layer_tensors]


def whole(tensor: Tensor) -> Tensor:
    """The full tensor behind a parameter: itself, or the local tensor of a DTensor on a mesh of one.

    On one device an FSDP-sharded parameter's local shard is the whole parameter, so the copy reads
    it without gathering (no second full set of weights on the device while the copy is made). On
    more devices the caller gathers first (``engine.fsdp.unsharded``), which makes parameters plain.
    """
    if isinstance(tensor, DTensor):
        if tensor.device_mesh.size() != 1:
            raise RuntimeError("the rollout engine reads whole weights; gather the FSDP-sharded parameters first")
        return tensor.to_local()
    return tensor


def _fields(weights: LayerWeights) -> list[Tensor | None]:
    return [getattr(weights, field.name) for field in dataclasses.fields(weights)]


def _tied(model: nn.Module) -> bool:
    embed, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    return lm_head is embed or whole(lm_head).data_ptr() == whole(embed).data_ptr()


def _layer_parts(layer: nn.Module) -> list[list[Tensor] | None]:
    """The source tensors of each ``LayerWeights`` field, in field order (None: the field is None)."""
    attn, mlp = layer.self_attn, layer.mlp

    def concatenated(linears: tuple[nn.Linear, ...]) -> list[list[Tensor] | None]:
        weights = [linear.weight for linear in linears]
        if all(linear.bias is None for linear in linears):
            return [weights, None]
        return [weights, [linear.weight.new_zeros(linear.out_features) if linear.bias is None else linear.bias
                          for linear in linears]]

    def single(linear: nn.Linear) -> list[list[Tensor] | None]:
        return [[linear.weight], None if linear.bias is None else [linear.bias]]

    q_norm = [attn.q_norm.weight] if hasattr(attn, "q_norm") else None
    k_norm = [attn.k_norm.weight] if hasattr(attn, "k_norm") else None
    return [[layer.input_layernorm.weight], *concatenated((attn.q_proj, attn.k_proj, attn.v_proj)), q_norm, k_norm,
            *single(attn.o_proj), [layer.post_attention_layernorm.weight],
            *concatenated((mlp.gate_proj, mlp.up_proj)), *single(mlp.down_proj)]


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm (Qwen2, Qwen3, Llama): float32 statistics, cast back, then the weight."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


class PagedDecoder:
    """Embedding, decoder layers and LM head of an HF causal LM over a paged KV cache.

    ``load_weights`` must run before ``forward`` (the engine does it at wake-up).
    """

    def __init__(self, model: nn.Module, max_model_len: int, use_triton: bool, device: torch.device | None = None):
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
        self.device = device or model.model.embed_tokens.weight.device  # the model's may be the CPU (param_offload)
        self.has_qk_norm = hasattr(model.model.layers[0].self_attn, "q_norm")
        self.flash_prefix = use_triton and flash_prefix_applies(self.device, self.dtype)
        """Prefills after a prefix-cache hit run the flash varlen kernel (see attention.py)."""
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.cos, self.sin = self._rotary_tables()
        self.weights: ModelWeights | None = None
        """The copies the forward reads, while loaded; see ``load_weights``."""

    def _rotary_tables(self) -> tuple[Tensor, Tensor]:
        """cos, sin: (max_model_len, head_dim) in the model dtype, from the model's own rotary module."""
        rotary = self.model.model.rotary_emb
        buffer = next(rotary.buffers(), None)  # the module computes where its frequencies are
        device = buffer.device if buffer is not None else self.device
        positions = torch.arange(self.max_model_len, device=device)[None, :]
        probe = torch.empty(0, dtype=self.dtype, device=device)
        with torch.no_grad():
            cos, sin = rotary(probe, positions)
        return cos[0].to(self.device).contiguous(), sin[0].to(self.device).contiguous()

    @torch.no_grad()
    def load_weights(self) -> None:
        """Copy the model's weights into the decoder's own buffers, allocating them if freed.

        Once allocated, the buffers are overwritten in place, so graphs that read them stay valid
        and the model's storage may move or be freed (FSDP reshards it) after the copy.
        """
        if self.weights is None:
            self.weights = ModelWeights.copied(self.model, self.dtype, self.device)
        else:
            self.weights.copy_from(self.model)

    def free_weights(self) -> None:
        self.weights = None

    def parameter_pointers(self) -> tuple[int, ...]:
        """Storage addresses of everything a forward reads (what a captured graph depends on)."""
        return tuple(tensor.data_ptr() for tensor in (self.weights.tensors() if self.weights else ()))

    def _norm(self, weight: Tensor, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """RMSNorm of x (or of x + residual, written back into residual) with ``weight``."""
        if self.use_triton:
            from reinforge.rollout.native import triton_kernels

            return triton_kernels.rms_norm(x, weight, self.eps, residual)
        if residual is not None:
            residual.copy_(residual + x)
            x = residual
        return _rms_norm(x, weight, self.eps)

    def _mlp(self, weights: LayerWeights, x: Tensor) -> Tensor:
        gate_up = F.linear(x, weights.gate_up_weight, weights.gate_up_bias)
        if self.use_triton:
            from reinforge.rollout.native import triton_kernels

            activated = triton_kernels.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            activated = F.silu(gate) * up
        return F.linear(activated, weights.down_weight, weights.down_bias)

    def _attention(self, weights: LayerWeights, x: Tensor, positions: Tensor, k_cache: Tensor, v_cache: Tensor,
                   meta: AttentionMetadata) -> Tensor:
        num_tokens = x.shape[0]
        qkv = F.linear(x, weights.qkv_weight, weights.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q = self._norm(weights.q_norm, q.contiguous())
            k = self._norm(weights.k_norm, k.contiguous())
        if self.use_triton:
            from reinforge.rollout.native import triton_kernels

            triton_kernels.rope_and_write_cache(q, k, v, self.cos, self.sin, positions, meta.slot_mapping,
                                                k_cache, v_cache)
        else:
            cos, sin = self.cos[positions], self.sin[positions]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill and meta.prefix_lens is not None:
            attend = packed_prefix_attention if self.flash_prefix else prefill_attention_with_prefix
            out = attend(q, k_cache, v_cache, meta, self.scale)
        elif meta.is_prefill:
            out = prefill_attention(q, k, v, meta, self.scale)
        elif self.use_triton:
            from reinforge.rollout.native import triton_kernels

            out = triton_kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                        self.scale)
        else:
            out = decode_attention(q, k_cache, v_cache, meta, self.scale)
        return F.linear(out.reshape(num_tokens, self.num_heads * self.head_dim), weights.o_weight, weights.o_bias)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                logits_indices: Tensor | None = None) -> Tensor:
        """Logits (rows, vocab) in the model dtype at ``logits_indices`` (every token when None).

        input_ids, positions: (tokens,); kv_cache: (layers, 2, num_blocks, block_size, kv_heads, head_dim).
        """
        assert self.weights is not None, "load_weights() runs before the first forward"
        model_weights = self.weights
        hidden = F.embedding(input_ids, model_weights.embed)
        residual = hidden
        for index, weights in enumerate(model_weights.layers):
            if index == 0:
                residual = hidden.clone()
                normed = self._norm(weights.input_norm, hidden)
            else:
                normed = self._norm(weights.input_norm, hidden, residual)
            hidden = self._attention(weights, normed, positions, kv_cache[index, 0], kv_cache[index, 1], meta)
            normed = self._norm(weights.post_norm, hidden, residual)
            hidden = self._mlp(weights, normed)
        if logits_indices is not None:  # index_select: no host sync, so a prefill graph may capture it
            hidden, residual = hidden.index_select(0, logits_indices), residual.index_select(0, logits_indices)
        return F.linear(self._norm(model_weights.final_norm, hidden, residual), model_weights.lm_head)
