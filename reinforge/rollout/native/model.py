"""The decoder forward of the native engine, for every family the architecture table describes.

One decoder runs every dense family of ``models.architectures`` (Llama, Mistral, Qwen2/Qwen3, Gemma 2 and 3,
Phi-3/Phi-4, OLMo 2, SmolLM3) from the table: the embedding scale, each layer's norm placement (pre, the
Gemma sandwich, OLMo 2's post norms) and norm kind, its attention and MLP blocks (``layers.py``, chosen per
layer by ``attention_block`` and ``mlp_block``: mixture-of-experts MLPs in ``moe.py`` for Qwen3-MoE, Mixtral,
OLMoE and DeepSeek, DeepSeek's latent attention in ``mla.py``), the final norm and the final logit soft-cap. It runs over
packed tokens with a paged KV cache whose per-token entry the attention blocks define (``kv_cache_shape``).

It reads its own copy of the weights (``ModelWeights``), made from the model's parameters at wake-up and
refreshed in place with ``copy_`` at each weight sync, so the storage a captured CUDA graph reads never moves:
graphs outlive the trainer's parameters being resharded, freed or moved, and the trainer may free its gathered
parameters as soon as the copy is made. Projections that read the same input are concatenated in the copy (q|k|v
and gate|up, as Phi-3 stores them), so each group runs as one matrix product.

Frozen weights are read in place instead (``weights_read_in_place``): a LoRA actor's base never changes, so the
engine shares the storage of every frozen parameter it would copy unchanged (experts, routers, norms,
embeddings, unadapted projections) and copies only what it must change or concatenate (the adapted layers, which
get W + s B A, and the q|k|v and gate|up groups). Qwen3-30B-A3B's 57 GiB of experts then exist once on the device.
A caller whose weights never change while the engine reads them (``weights_fixed``: serving, the rollout
benchmarks) has every parameter read so, trainable or not.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from reinforge.models.architectures import ArchitectureSpec, runs_code_it_ships, text_config
from reinforge.models.head_probe import final_softcap
from reinforge.rollout.native.attention import AttentionMetadata, flash_prefix_applies
from reinforge.rollout.native.layers import ACTIVATIONS, BlockContext, DenseAttention, DenseMLP, LayerWeights, Parts
from reinforge.rollout.native.mla import MLAAttention, mla_rotary_tables
from reinforge.rollout.native.moe import MoEMLP, moe_unsupported_reason
from reinforge.rollout.native.multimodal import (
    MropeLayout,
    PrefillImages,
    is_vision_language,
    language_model,
    multimodal_unsupported_reason,
    native_architecture_spec,
)
from reinforge.rollout.native.rotary_tables import RotaryTables

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
NORM_NAMES = {"pre": ("input_layernorm", "post_attention_layernorm"),
              "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                           "post_feedforward_layernorm"),
              "post": ("post_attention_layernorm", "post_feedforward_layernorm")}
"""The norms of a layer of each placement, as transformers names them (their copies keep the names)."""

DECODE_PRODUCTS = ("cublas", "timed")
"""What may run a decode step's products (``rollout.decode_products``): cuBLAS alone, or what ``dense_choice`` timed."""


def attention_block(context: BlockContext, index: int,
                    mla_tables: tuple[Tensor, Tensor] | None = None) -> DenseAttention | MLAAttention:
    """The attention block of layer ``index`` (MLA's reads ``mla_tables``, the model's ``mla_rotary_tables``)."""
    if context.spec.mla is not None:
        return MLAAttention(context, context.spec.layers[index], mla_tables)
    return DenseAttention(context, context.spec.layers[index])


def mlp_block(context: BlockContext, index: int) -> DenseMLP | MoEMLP:
    """The MLP block of layer ``index``: a mixture of experts where the table says so."""
    layer = context.spec.layers[index]
    return MoEMLP(context, layer) if layer.moe else DenseMLP(context, layer)


def decoder_module(model: nn.Module) -> nn.Module:
    """The module holding embed_tokens, layers, norm and rotary_emb (a vision-language model's language model)."""
    if is_vision_language(model.config):
        return language_model(model)
    inner = model.model
    # a multimodal wrapper run on text alone (Gemma 3's Gemma3ForConditionalGeneration): its language model
    return inner if hasattr(inner, "layers") else getattr(inner, "language_model", inner)


def _rope_dicts(config) -> list[dict]:
    """The model's rope parameters: one dict, or one per layer type (Gemma 3 nests them)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return []
    nested = [value for value in rope.values() if isinstance(value, dict)]
    return nested if nested and len(nested) == len(rope) else [rope]


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the native engine cannot run ``model``, or None when it can."""
    config = text_config(model.config)
    if runs_code_it_ships(model):
        return (f"{type(model).__name__} runs the code its model folder ships (model.trust_remote_code), not "
                f"transformers' {getattr(model.config, 'model_type', None)!r} modules the architecture table "
                "(reinforge/models/architectures.py) describes")
    spec = native_architecture_spec(model.config)
    if spec is None:
        return (f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', None)!r}) has no entry in "
                "the architecture table (reinforge/models/architectures.py)")
    if is_vision_language(model.config):
        reason = multimodal_unsupported_reason(model)
        if reason is not None:
            return reason
    elif not hasattr(model, "model") or not hasattr(decoder_module(model), "layers"):
        return (f"{type(model).__name__} keeps no decoder layers at model.layers or model.language_model.layers (the "
                "engine runs text-only models and the vision-language families of models/vision.py)")
    if spec.moe is not None:
        reason = moe_unsupported_reason(config, spec.moe, decoder_module(model).layers)
        if reason is not None:
            return f"{spec.model_type}: {reason}"
    for parameters in _rope_dicts(config):
        rope_type = parameters.get("rope_type", parameters.get("type", "default"))
        if rope_type not in _STATIC_ROPE_TYPES:
            return f"{spec.model_type} uses rope_type={rope_type!r}, whose frequencies change with the sequence length"
    if spec.activation not in ACTIVATIONS:
        return f"{spec.model_type} uses the activation {spec.activation!r}; the engine runs {', '.join(ACTIVATIONS)}"
    return None


HF_BACKEND_SLOWDOWN = 20
"""How many times longer transformers' ``generate`` (the hf backend) takes over a GRPO rollout than the native
engine, roughly, as measured with small models on the GPU."""


def hf_fallback_notice(reason: str, setting: str = "rollout.name=native") -> str:
    """The one line said at start when ``setting`` (the native engine) meets a model the engine cannot run."""
    return (f"{setting} cannot run this model: {reason}; rolling out with the hf backend "
            f"(transformers' generate) instead, roughly {HF_BACKEND_SLOWDOWN}x slower")


def supports_model(model: nn.Module) -> bool:
    """True when the native engine can generate with ``model`` (else use the hf backend)."""
    return unsupported_reason(model) is None


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


def weights_read_in_place(model: nn.Module, fixed: bool = False) -> dict[int, Tensor]:
    """id(parameter) -> parameter, for the parameters of ``model`` the engine reads in place instead of copying.

    Those are the frozen parameters of a model that trains others (a LoRA actor's base), except the base weights
    under an adapter (their copy gets W + s B A). A model with nothing to train (the rollout copy of the
    off-policy modes) is copied whole: its syncs overwrite it while the engine may still read the last version.
    Under FSDP only the sharded parameters qualify (DTensors on a mesh of one, whose local shard is the whole
    parameter and stays where it is): a gathered parameter's storage is freed when FSDP reshards it.
    ``fixed``: the caller says no parameter of ``model`` changes while the engine reads it (nothing trains:
    serving, benchmarks), so every parameter qualifies, trainable or not.
    """
    from torch.distributed.fsdp import FSDPModule

    parameters = list(model.parameters())
    if not fixed and not any(parameter.requires_grad for parameter in parameters):
        return {}
    adapted = {id(parameter) for module in model.modules() if isinstance(getattr(module, "base_layer", None), nn.Module)
               for parameter in module.base_layer.parameters()}
    sharded = any(isinstance(module, FSDPModule) for module in model.modules())
    return {id(parameter): parameter for parameter in parameters
            if (fixed or not parameter.requires_grad) and id(parameter) not in adapted
            and (isinstance(parameter, DTensor) and parameter.device_mesh.size() == 1
                 if sharded else not isinstance(parameter, DTensor))}


class ModelWeights:
    """The decoder's own copy of every weight its forward reads: ``embed``, ``final_norm``, ``lm_head`` (``embed``
    itself when tied) and each layer's copies by name (``layers[i]``, named as the blocks' ``sources`` name them).
    A refresh (``copy_from``) reads the same tensors of the model it is given through ``pairs``.

    A weight the model holds frozen, unchanged (same device, dtype and layout, one part) is not copied: the copy is
    the parameter's own storage (``shared``, see ``weights_read_in_place``), skipped by refreshes and never written.
    """

    def __init__(self, decoder: PagedDecoder):
        self.decoder = decoder
        model = decoder.model
        self.layers: list[LayerWeights] = []
        self._pairs: list[tuple[Tensor, Parts]] = []
        self._in_place = weights_read_in_place(model, decoder.weights_fixed)
        self.shared: dict[int, tuple[Tensor, Tensor]] = {}
        """id(weight the forward reads) -> (that weight, the frozen parameter whose storage it is)."""
        inner = decoder_module(model)
        self.embed = self._copy(inner.embed_tokens.weight)
        self.final_norm = self._copy(inner.norm.weight)
        self.lm_head = self.embed if _tied(model) else self._copy(model.lm_head.weight)
        for index, layer in enumerate(inner.layers):
            copies: LayerWeights = {}
            for name, parts in decoder.layer_sources(index, layer).items():
                keep_float32 = name in decoder.float32_copies[index]
                copies[name] = None if parts is None else self._copy(*parts, keep_float32=keep_float32)
            self.layers.append(copies)

    def _copy(self, *parts: Tensor, keep_float32: bool = False) -> Tensor:
        dtype = torch.float32 if keep_float32 else self.decoder.dtype
        if len(parts) == 1 and id(parts[0]) in self._in_place:
            tensor = whole(parts[0]).detach()
            placed = tensor.to(self.decoder.device, dtype)  # itself where it already is (cuda is cuda:0)
            if placed.data_ptr() != tensor.data_ptr():  # moved or cast: a copy of its own already
                return placed.contiguous()
            if placed.is_contiguous():
                self.shared[id(placed)] = (placed, parts[0])
                return placed
        return torch.cat([whole(part).detach().to(self.decoder.device, dtype) for part in parts])

    def is_shared(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` (a weight the forward reads) is a frozen parameter's own storage."""
        return id(tensor) in self.shared

    def shared_storage_moved(self) -> bool:
        """Whether a frozen parameter read in place no longer lives where the forward reads it."""
        return any(whole(parameter).data_ptr() != tensor.data_ptr() for tensor, parameter in self.shared.values())

    def shared_bytes(self) -> int:
        return sum(tensor.nbytes for tensor, _ in self.shared.values())

    @torch.no_grad()
    def copy_from(self, model: nn.Module) -> None:
        """Overwrite every copy in place with ``model``'s current weights (the shared ones are already current)."""
        destinations, sources = [], []
        for destination, parts in self.pairs(model):
            if self.is_shared(destination):
                continue
            start = 0
            for part in parts:
                destinations.append(destination[start:start + part.shape[0]])
                sources.append(whole(part))
                start += part.shape[0]
        if not sources:  # every weight is read in place (weights_fixed): nothing to copy
            return
        if sources[0].device != destinations[0].device:  # parameters offloaded to the CPU
            for destination, source in zip(destinations, sources, strict=True):
                destination.copy_(source)
        else:
            torch._foreach_copy_(destinations, sources)  # a few launches instead of one per tensor

    def pairs(self, model: nn.Module) -> list[tuple[Tensor, list[Tensor]]]:
        """(copy, the parts of ``model`` it is made of) for every copy."""
        inner = decoder_module(model)
        pairs = [(self.embed, [inner.embed_tokens.weight]), (self.final_norm, [inner.norm.weight])]
        if self.lm_head is not self.embed:
            pairs.append((self.lm_head, [model.lm_head.weight]))
        for index, (copies, layer) in enumerate(zip(self.layers, inner.layers, strict=True)):
            for name, parts in self.decoder.layer_sources(index, layer).items():
                if parts is not None:
                    pairs.append((copies[name], parts))
        return pairs

    def linear_slices(self, model: nn.Module) -> dict[int, Tensor]:
        """id(linear layer, or adapter wrapping one, of ``model``) -> the rows of this copy that hold its weight (q, k, v share one copy)."""
        rows: dict[int, Tensor] = {}
        for destination, parts in self.pairs(model):
            if self.is_shared(destination):  # the model's own weight: an adapter's delta never goes there
                continue
            start = 0
            for part in parts:
                rows[id(part)] = destination[start:start + part.shape[0]]
                start += part.shape[0]
        # an adapter's wrapper (PEFT's lora.Linear) names its base layer's weight as its own
        return {id(module): rows[id(weight)] for module in model.modules()
                if isinstance(weight := getattr(module, "weight", None), Tensor) and id(weight) in rows}

    def tensors(self) -> list[Tensor]:
        layer_tensors = [tensor for copies in self.layers for tensor in copies.values() if tensor is not None]
        return [self.embed, self.final_norm, self.lm_head, *layer_tensors]


def _tied(model: nn.Module) -> bool:
    embed, lm_head = decoder_module(model).embed_tokens.weight, model.lm_head.weight
    return lm_head is embed or whole(lm_head).data_ptr() == whole(embed).data_ptr()


class PagedDecoder:
    """Embedding, decoder layers and LM head of an HF causal LM over a paged KV cache, from its architecture table.

    ``load_weights`` must run before ``forward`` (the engine does it at wake-up).
    """

    def __init__(self, model: nn.Module, max_model_len: int, use_triton: bool, device: torch.device | None = None,
                 weights_fixed: bool = False, decode_products: str = "cublas"):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the native rollout engine cannot run this model: {reason}; "
                             "use the hf rollout backend for it")
        self.model = model
        self.max_model_len = max_model_len
        self.use_triton = use_triton
        if decode_products not in DECODE_PRODUCTS:
            raise ValueError(f"decode_products={decode_products!r} is not one of {', '.join(DECODE_PRODUCTS)} "
                             "(rollout.decode_products)")
        self.decode_products = decode_products
        self.weights_fixed = weights_fixed
        """The model's weights never change while this decoder reads them: all are read in place where they can be."""
        spec: ArchitectureSpec = native_architecture_spec(model.config)
        # a wrapper whose head leaves its text config's cap out (asked once per model: training asked it already)
        spec = replace(spec, final_softcap=final_softcap(model, spec.final_softcap))
        self.spec = spec
        config = text_config(model.config)
        inner = decoder_module(model)
        self.num_layers = len(spec.layers)
        self.dtype = inner.embed_tokens.weight.dtype
        self.device = device or inner.embed_tokens.weight.device  # the model's may be the CPU (param_offload)
        self.flash_prefix = use_triton and spec.attn_softcap is None and spec.mla is None \
            and flash_prefix_applies(self.device, self.dtype)
        """Prefills after a prefix-cache hit run the flash varlen kernel (see attention.py); soft-capped scores
        and MLA's latent heads (wider than the kernel's) run the reference."""
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope = dict(rope) if isinstance(rope, dict) and ("rope_type" in rope or "type" in rope) else {}
        rope.setdefault("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))
        kinds = {layer.rope for layer in spec.layers} if spec.mla is None else set()  # MLA rotates its own way
        multimodal = is_vision_language(model.config)  # M-RoPE: text positions read the plain table (multimodal.py)
        self.rotary = RotaryTables(inner, set() if multimodal else kinds, max_model_len, self.dtype, self.device, rope)
        if multimodal:
            self.rotary.tables["global"] = MropeLayout(model, self.dtype, self.device).text_table(max_model_len)
        self.context = BlockContext(spec, config, self.dtype, use_triton, self.flash_prefix, self.rotary,
                                    timed_products=use_triton and decode_products == "timed")
        mla_tables = None if spec.mla is None else \
            mla_rotary_tables(inner.rotary_emb, max_model_len, self.dtype, self.device)
        self.attention = [attention_block(self.context, index, mla_tables) for index in range(self.num_layers)]
        self.mlps = [mlp_block(self.context, index) for index in range(self.num_layers)]
        self.float32_copies = [block.float32_copies | mlp.float32_copies
                               for block, mlp in zip(self.attention, self.mlps, strict=True)]
        self.embedding_scale = None if spec.embedding_scale is None else \
            torch.tensor(spec.embedding_scale, dtype=self.dtype, device=self.device)
        self.cache_entry = self.attention[0].cache_entry
        if any(block.cache_entry != self.cache_entry for block in self.attention):
            raise ValueError(f"{spec.model_type}: layers with different KV cache entries share one cache")
        self.weights: ModelWeights | None = None
        """The copies the forward reads, while loaded; see ``load_weights``."""

    @property
    def sliding_window(self) -> int | None:
        """The widest window when every layer slides (no key older than it is ever read), else None."""
        windows = [layer.sliding_window for layer in self.spec.layers]
        return None if any(window is None for window in windows) else max(windows)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """(layers, entries, num_blocks, block_size, heads, dim): each layer's cache, ``cache_entry`` per token."""
        entries, heads, dim = self.cache_entry
        return (self.num_layers, entries, num_blocks, block_size, heads, dim)

    def kv_bytes_per_block(self, block_size: int) -> int:
        entries, heads, dim = self.cache_entry
        return self.num_layers * entries * block_size * heads * dim * self.dtype.itemsize

    def layer_sources(self, index: int, layer: nn.Module) -> dict[str, Parts]:
        """Layer ``index``'s copies by name -> the tensors of ``layer`` each is made of."""
        norms = {name: [getattr(layer, name).weight] for name in NORM_NAMES[self.spec.norm_placement]}
        return {**norms, **self.attention[index].sources(layer.self_attn), **self.mlps[index].sources(layer.mlp)}

    @torch.no_grad()
    def load_weights(self) -> None:
        """Copy the model's weights into the decoder's own buffers, allocating them if freed.

        Once allocated, the buffers are overwritten in place, so graphs that read them stay valid
        and the model's storage may move or be freed (FSDP reshards it) after the copy.
        """
        if self.weights is None or self.weights.shared_storage_moved():
            self.weights = ModelWeights(self)
        else:
            self.weights.copy_from(self.model)

    def free_weights(self) -> None:
        self.weights = None

    def parameter_pointers(self) -> tuple[int, ...]:
        """Storage addresses of everything a forward reads (what a captured graph depends on)."""
        return tuple(tensor.data_ptr() for tensor in (self.weights.tensors() if self.weights else ()))

    def forward(self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                logits_indices: Tensor | None = None, images: PrefillImages | None = None,
                final_softcap: bool = True) -> Tensor:
        """Logits (rows, vocab) in the model dtype at ``logits_indices`` (every token when None).

        input_ids, positions: (tokens,); kv_cache: ``kv_cache_shape``. images: a multimodal prefill's image
        embeddings, deepstack features and M-RoPE cos/sin (``multimodal.py``; positions are then ignored).
        final_softcap: cap the logits as the model does (Gemma 2's ``final_logit_softcapping``, in the model dtype
        like transformers); False leaves them to the engine's sampler, which caps them in float32 as it reads
        them (``Sampler``'s ``softcap``): one pass over the logits instead of three
        elementwise kernels, and the trainer's log-probs cap in float32 too.
        """
        if images is not None:
            with images.rotary(self.rotary) as rows:
                return self._forward(input_ids, rows, kv_cache, meta, logits_indices, images, final_softcap)
        return self._forward(input_ids, positions, kv_cache, meta, logits_indices, final_softcap=final_softcap)

    def _forward(self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                 logits_indices: Tensor | None, images: PrefillImages | None = None,
                 final_softcap: bool = True) -> Tensor:
        assert self.weights is not None, "load_weights() runs before the first forward"
        model_weights, norm, placement = self.weights, self.context.norm, self.spec.norm_placement
        hidden = F.embedding(input_ids, model_weights.embed)
        if self.embedding_scale is not None:
            hidden = hidden * self.embedding_scale
        if images is not None:
            hidden = images.place(hidden)
        residual: Tensor | None = None  # the residual stream is residual + hidden
        metas = meta.per_layer  # layer groups: each layer reads its group's slots and tables
        decode = not meta.is_prefill
        for index, weights in enumerate(model_weights.layers):
            attention, mlp, cache = self.attention[index], self.mlps[index], kv_cache[index]
            if metas is not None:
                meta = metas[index]
            if placement == "post":  # OLMo 2: the sublayers read the stream itself and normalise their output
                residual = hidden if residual is None else residual + hidden
                hidden = norm(weights["post_attention_layernorm"], attention.forward(weights, residual, positions,
                                                                                      cache, meta))
                residual = residual + hidden
                hidden = norm(weights["post_feedforward_layernorm"], mlp.forward(weights, residual, decode))
                continue
            if residual is None:
                residual = hidden.clone()
                normed = norm(weights["input_layernorm"], hidden)
            else:
                normed = norm(weights["input_layernorm"], hidden, residual)
            hidden = attention.forward(weights, normed, positions, cache, meta)
            if placement == "sandwich":
                hidden = norm(weights["post_attention_layernorm"], hidden)
                normed = norm(weights["pre_feedforward_layernorm"], hidden, residual)
                hidden = norm(weights["post_feedforward_layernorm"], mlp.forward(weights, normed, decode))
            else:
                normed = norm(weights["post_attention_layernorm"], hidden, residual)
                hidden = mlp.forward(weights, normed, decode)
            if images is not None:
                hidden, residual = images.add_deepstack(index, hidden, residual)
        if logits_indices is not None:  # index_select: no host sync, so a prefill graph may capture it
            hidden, residual = hidden.index_select(0, logits_indices), residual.index_select(0, logits_indices)
        logits = F.linear(norm(model_weights.final_norm, hidden, residual), model_weights.lm_head)
        if final_softcap and self.spec.final_softcap is not None:
            cap = self.spec.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
