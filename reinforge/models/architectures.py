"""The table of differences between the decoder families reinforge runs fast, read from an HF config.

Training's fast path (``engine.fused``) and the native rollout engine (``rollout.native``) both
read an ``ArchitectureSpec`` instead of knowing each model class: a family is described once,
here, by what sets it apart from Llama (norm kind and placement, soft-caps, per-layer windows
and rotary, qk-norm, fused projections, MoE routing, MLA). Every value is the one transformers
itself derives from the config (its per-layer ``sliding_window``, its attention ``scaling``), so
a model the table describes computes what transformers computes. A ``model_type`` the table does
not know gets ``None``: it trains through transformers' own modules.

Imports nothing of reinforge (the layer ``models/``), and nothing of transformers: it reads
configs by attribute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerSpec:
    sliding_window: int | None
    """W keys visible including the query (key j visible to query i iff i - W < j <= i); None: full causal."""
    rope: str
    """"global" | "local" (Gemma 3's local theta) | "none" (SmolLM3 NoPE layers)."""
    moe: bool
    """This layer's MLP is a mixture of experts (False: a dense MLP)."""


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    scoring: str
    """"softmax" | "sigmoid"."""
    norm_topk_prob: bool
    weights_dtype: str
    """"logits": top-k weights cast to the router-logit dtype (Qwen3-MoE, OLMoE) | "float32" (Mixtral, DeepSeek)."""
    routed_scaling_factor: float
    n_group: int | None
    topk_group: int | None
    group_score: str | None
    """"max" (DeepSeek V2 group_limited_greedy) | "top2_sum" (V3) | None: no group-limited routing."""
    correction_bias: bool
    """DeepSeek V3's e_score_correction_bias, used to select experts only."""
    shared_experts: int
    """DeepSeek's n_shared_experts (0: none): one MLP of width intermediate_size * shared_experts."""
    intermediate_size: int


@dataclass(frozen=True)
class MLASpec:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool


@dataclass(frozen=True)
class ArchitectureSpec:
    model_type: str
    norm: str
    """"llama" (cast to the dtype, then * w) | "gemma" (* (1 + w) in float32, cast after) | "olmo" (* w in float32, cast after)."""
    norm_placement: str
    """"pre" | "sandwich" (Gemma: pre and post around attention and MLP) | "post" (OLMo 2: on the sublayer output only)."""
    embedding_scale: float | None
    """Gemma: sqrt(hidden), multiplied as a tensor in the model dtype; None: no scaling."""
    attn_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    qk_norm: str | None
    """None | "head" (RMSNorm over head_dim, Qwen3/Gemma 3) | "projection" (OLMo 2/OLMoE, over nq*d and nkv*d)."""
    activation: str
    """"silu" | "gelu_tanh" (any other HF activation name is kept as it is)."""
    fused_qkv: bool
    fused_gate_up: bool
    partial_rotary_factor: float
    head_dim: int
    """The query/key head dim (DeepSeek MLA: qk_nope + qk_rope; the value head dim is MLASpec.v_head_dim)."""
    layers: tuple[LayerSpec, ...]
    moe: MoESpec | None
    mla: MLASpec | None
    clip_qkv: float | None = None
    """OLMoE's clip_qkv: q (after its norm), k (after its norm) and v clamped to [-clip_qkv, clip_qkv]; None: no clamp."""

    @property
    def windowed(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return any(layer.sliding_window is not None for layer in self.layers)


LLAMA_NORM = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "qwen3_moe", "mixtral", "olmoe",
              "deepseek_v2", "deepseek_v3")
GEMMA = ("gemma2", "gemma3_text", "gemma3")
FAMILIES = (*LLAMA_NORM, "gemma2", "gemma3_text", "gemma3", "olmo2")
"""Every model_type ``architecture_spec`` describes (``gemma3`` through its text config)."""


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _layer_windows(config, model_type: str) -> list[int | None]:
    """Each layer's window, as the family's attention module sets its ``sliding_window``."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if model_type in ("mistral", "phi3", "mixtral", "qwen3_moe"):  # one window for all layers, if any
        return [window] * num_layers
    if model_type in ("qwen2", "qwen3", "smollm3", *GEMMA):
        # SmolLM3 hands a sliding_attention layer's attention function no window unless use_sliding_window is set,
        # but builds its mask from sliding_window all the same: eager and SDPA attention slide it (flash attention,
        # which reads no mask, would not)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    # llama, olmo2, deepseek, olmoe: their models build only causal masks, so eager and SDPA attend to every earlier
    # token whatever sliding_window says (OLMoE hands it to its attention function, which only flash attention reads)
    return [None] * num_layers


def _layer_ropes(config, model_type: str) -> list[str]:
    num_layers = config.num_hidden_layers
    if model_type in ("gemma3_text", "gemma3"):
        return ["local" if kind == "sliding_attention" else "global" for kind in config.layer_types]
    if model_type == "smollm3":  # transformers reads layer i's entry: entries past the last layer go unread
        return ["global" if uses_rope else "none" for uses_rope in config.no_rope_layers[:num_layers]]
    return ["global"] * num_layers


def _moe_layers(config, model_type: str) -> list[bool]:
    num_layers = config.num_hidden_layers
    if model_type == "qwen3_moe":
        sparse_step = config.decoder_sparse_step
        return [i not in (config.mlp_only_layers or []) and config.num_experts > 0 and (i + 1) % sparse_step == 0
                for i in range(num_layers)]
    if model_type in ("mixtral", "olmoe"):
        return [True] * num_layers
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return [i >= config.first_k_dense_replace for i in range(num_layers)]
    return [False] * num_layers


DEEPSEEK_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
"""The expert selections transformers' DeepseekV2 router runs."""


def _moe_spec(config, model_type: str) -> MoESpec | None:
    if model_type in ("qwen3_moe", "olmoe"):
        return MoESpec(num_experts=config.num_experts, top_k=config.num_experts_per_tok, scoring="softmax",
                       norm_topk_prob=bool(config.norm_topk_prob), weights_dtype="logits",
                       routed_scaling_factor=1.0, n_group=None, topk_group=None, group_score=None,
                       correction_bias=False, shared_experts=0,
                       intermediate_size=getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
    if model_type == "mixtral":
        return MoESpec(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok, scoring="softmax",
                       norm_topk_prob=True, weights_dtype="float32", routed_scaling_factor=1.0, n_group=None,
                       topk_group=None, group_score=None, correction_bias=False, shared_experts=0,
                       intermediate_size=config.intermediate_size)
    if model_type == "deepseek_v2":
        grouped = config.topk_method == "group_limited_greedy"
        return MoESpec(num_experts=_num_routed_experts(config), top_k=config.num_experts_per_tok, scoring="softmax",
                       norm_topk_prob=False,  # transformers' V2 router never renormalises
                       weights_dtype="float32", routed_scaling_factor=float(config.routed_scaling_factor),
                       n_group=config.n_group if grouped else None, topk_group=config.topk_group if grouped else None,
                       group_score="max" if grouped else None, correction_bias=False,
                       shared_experts=config.n_shared_experts or 0, intermediate_size=config.moe_intermediate_size)
    if model_type == "deepseek_v3":
        return MoESpec(num_experts=_num_routed_experts(config), top_k=config.num_experts_per_tok, scoring="sigmoid",
                       norm_topk_prob=bool(config.norm_topk_prob), weights_dtype="float32",
                       routed_scaling_factor=float(config.routed_scaling_factor), n_group=config.n_group,
                       topk_group=config.topk_group, group_score="top2_sum", correction_bias=True,
                       shared_experts=config.n_shared_experts or 0, intermediate_size=config.moe_intermediate_size)
    return None


def _num_routed_experts(config) -> int:
    for name in ("n_routed_experts", "num_local_experts", "num_experts"):
        value = getattr(config, name, None)
        if value is not None:
            return value
    raise ValueError(f"{config.model_type} config has no n_routed_experts; cannot describe its MoE layers")


def _rope_parameters(config) -> dict:
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return parameters if isinstance(parameters, dict) else {}


def _mla_spec(config, model_type: str) -> MLASpec | None:
    if model_type not in ("deepseek_v2", "deepseek_v3"):
        return None
    return MLASpec(q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                   qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
                   v_head_dim=config.v_head_dim,
                   rope_interleave=model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", True)))


def _attn_scale(config, model_type: str, head_dim: int) -> float:
    if model_type in GEMMA:
        return config.query_pre_attn_scalar ** -0.5
    if model_type in ("deepseek_v2", "deepseek_v3"):
        scale = head_dim ** -0.5
        rope = _rope_parameters(config)
        # transformers' yarn mscale is 1 for a factor of 1 or less (a factor it warns about, but runs)
        if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim") and rope["factor"] > 1:
            mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
            scale *= mscale * mscale
        return scale
    return head_dim ** -0.5


ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
"""HF activation names -> the table's; another name is kept as it is (the fast path then keeps the MLP's own forward)."""


def _activation(config) -> str:
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    return ACTIVATIONS.get(name, name)


def text_config(config):
    """The decoder's config: Gemma 3's ``text_config``, else the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def config_and_text_config(config) -> list:
    """``config`` and its text config, once each (a vision-language model has both; another config is its own)."""
    text = text_config(config)
    return list({id(config): config, id(text): text}.values())


MASKS_FROM_LAYER_TYPES = ("qwen2", "qwen3", "smollm3", "gemma2", "gemma3_text")
"""Families whose model builds a sliding-window mask (from ``config.sliding_window``) for each ``sliding_attention``
entry of ``layer_types``."""


def check_transformers_runs(config) -> None:
    """Refuse, in one line naming the value, the file and the fix, a config of a family in ``FAMILIES`` that
    transformers loads but whose own forward fails: a deepseek_v2 ``topk_method`` its router does not run, a
    DeepSeek MLA config whose ``num_key_value_heads`` divides ``num_attention_heads`` into groups (transformers expands
    the latent into one key and value head per query head, then its eager and SDPA attention repeat them once more
    per group), ``sliding_attention`` layers with no window (Qwen's ``use_sliding_window=false`` drops it) and a SmolLM3
    ``no_rope_layers`` with fewer entries than layers."""
    model_type = getattr(config, "model_type", None)
    if model_type == "gemma3":
        config, model_type = text_config(config), "gemma3_text"
    source = f"{model_type} config (model.path's config.json)"
    if model_type == "deepseek_v2" and config.topk_method not in DEEPSEEK_V2_TOPK_METHODS:
        raise ValueError(f"{source} has topk_method={config.topk_method!r}, which transformers' DeepseekV2 router does "
                         "not run (its forward fails); set topk_method to one of "
                         f"{', '.join(DEEPSEEK_V2_TOPK_METHODS)}")
    if model_type in ("deepseek_v2", "deepseek_v3"):
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if kv_heads and heads // kv_heads > 1:
            name = "DeepseekV2" if model_type == "deepseek_v2" else "DeepseekV3"
            raise ValueError(f"{source} has num_key_value_heads={kv_heads} with num_attention_heads={heads}: "
                             f"transformers' {name} attention expands its latent into {heads} key and value heads, "
                             f"then repeats them {heads // kv_heads} times (num_attention_heads // "
                             "num_key_value_heads), so its forward fails on mismatched head counts; set "
                             f"num_key_value_heads to {heads}")
    if model_type in MOE_FAMILIES and any(_moe_layers(config, model_type)):
        _check_routing_runs(config, model_type, source)
    no_rope_layers = getattr(config, "no_rope_layers", None) if model_type == "smollm3" else None
    if no_rope_layers is not None and len(no_rope_layers) < config.num_hidden_layers:
        raise ValueError(f"{source} lists {len(no_rope_layers)} entries in no_rope_layers for num_hidden_layers="
                         f"{config.num_hidden_layers}: transformers' SmolLM3 reads one a layer, so it fails building "
                         "the layers past them; give one entry a layer (1: rotary positions, 0: none), or drop "
                         "no_rope_layers to derive them from no_rope_layer_interval")
    layer_types = getattr(config, "layer_types", None) or ()
    if (model_type in MASKS_FROM_LAYER_TYPES and "sliding_attention" in layer_types
            and getattr(config, "sliding_window", None) is None):
        if getattr(config, "use_sliding_window", None) is False and model_type in ("qwen2", "qwen3"):
            raise ValueError(f"{source} lists sliding_attention layers in layer_types with use_sliding_window=false, "
                             "which transformers reads as no window (sliding_window=None), so its forward fails "
                             "building their mask; set use_sliding_window=true (with sliding_window) to slide them, "
                             "or list them as full_attention")
        raise ValueError(f"{source} lists sliding_attention layers in layer_types with sliding_window=null, so "
                         "transformers' forward fails building their mask; set sliding_window to the model's window "
                         "in tokens, or list them as full_attention")


MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3")
ROUTER_NAMES = {"qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral", "olmoe": "Olmoe", "deepseek_v2": "DeepseekV2",
                "deepseek_v3": "DeepseekV3"}


def _check_routing_runs(config, model_type: str, source: str) -> None:
    """Refuse a routing transformers' router of a table MoE family cannot run: a top-k past the experts, and for
    DeepSeek's group-limited routing groups that do not split the experts evenly (its router reshapes the scores into
    n_group equal groups: an error, or for some token counts scores of different tokens grouped together), a
    topk_group past n_group, and V3 groups of one expert (it scores a group by its best two)."""
    router = f"transformers' {ROUTER_NAMES[model_type]} router"
    experts = _num_routed_experts(config)
    top_k = config.num_experts_per_tok
    if isinstance(top_k, int) and isinstance(experts, int) and top_k > experts:
        raise ValueError(f"{source} has num_experts_per_tok={top_k} with {experts} experts: {router} takes the top "
                         f"{top_k} of {experts} scores, so its forward fails; set num_experts_per_tok to 1 to {experts}")
    grouped = model_type == "deepseek_v3" or (model_type == "deepseek_v2"
                                              and config.topk_method == "group_limited_greedy")
    if not grouped:
        return
    groups, kept = config.n_group, config.topk_group
    if not isinstance(groups, int) or groups < 1 or experts % groups:
        raise ValueError(f"{source} has n_group={groups} for {experts} routed experts: {router} splits the experts into "
                         f"n_group groups of equal size, so its forward fails or groups the scores of different "
                         f"tokens together; set n_group to a divisor of {experts}")
    if model_type == "deepseek_v3" and experts // groups < 2:
        raise ValueError(f"{source} has n_group={groups} for {experts} routed experts, one expert a group: {router} "
                         "scores a group by its best two experts, so its forward fails; set n_group to a divisor of "
                         f"{experts} of at most {experts // 2}")
    if not isinstance(kept, int) or not 1 <= kept <= groups:
        raise ValueError(f"{source} has topk_group={kept} with n_group={groups}: {router} keeps the best topk_group "
                         f"of the n_group groups, so its forward fails; set topk_group to 1 to {groups}")


def runs_code_it_ships(model) -> bool:
    """Whether ``model`` (or the base model under its adapters) runs modelling code its folder ships (loaded with
    ``trust_remote_code``: classes of transformers' dynamic ``transformers_modules``) rather than transformers' own
    modules, which the table describes whatever ``model_type`` the config names."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return any(cls.__module__.startswith("transformers_modules") for cls in type(base).__mro__)


def architecture_spec(config) -> ArchitectureSpec | None:
    """The table for a family in ``FAMILIES``; None for any other model_type (the transformers-module path).
    A config transformers cannot run is refused (``check_transformers_runs``)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return None
    check_transformers_runs(config)
    if model_type == "gemma3":
        config = text_config(config)
        model_type = "gemma3_text"
    if model_type == "gemma3_text" and getattr(config, "use_bidirectional_attention", False):
        # transformers' Gemma 3 then attends both ways (EmbeddingGemma); the table's layers are causal. Outside the
        # table the start-up probe refuses it in one line: it reads the tokens after each position
        return None
    mla = _mla_spec(config, model_type)
    head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla is not None else _head_dim(config)
    windows, ropes, moe_layers = (_layer_windows(config, model_type), _layer_ropes(config, model_type),
                                  _moe_layers(config, model_type))
    layers = tuple(LayerSpec(sliding_window=window, rope=rope, moe=moe)
                   for window, rope, moe in zip(windows, ropes, moe_layers, strict=True))
    gemma = model_type in GEMMA
    if model_type in ("olmo2", "olmoe"):
        qk_norm = "projection"
    elif model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
        qk_norm = "head"
    else:
        qk_norm = None
    rope = _rope_parameters(config)
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    return ArchitectureSpec(
        model_type=model_type,
        norm="gemma" if gemma else "olmo" if model_type == "olmo2" else "llama",
        norm_placement="sandwich" if gemma else "post" if model_type == "olmo2" else "pre",
        embedding_scale=config.hidden_size ** 0.5 if gemma else None,
        attn_scale=_attn_scale(config, model_type, head_dim),
        # transformers' Gemma 3 attention keeps attn_logit_softcapping but never applies it
        attn_softcap=getattr(config, "attn_logit_softcapping", None) if model_type == "gemma2" else None,
        final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        qk_norm=qk_norm,
        activation=_activation(config),
        fused_qkv=model_type == "phi3",
        fused_gate_up=model_type == "phi3",
        partial_rotary_factor=float(partial),
        head_dim=head_dim,
        layers=layers,
        moe=_moe_spec(config, model_type),
        mla=mla,
        clip_qkv=getattr(config, "clip_qkv", None) if model_type == "olmoe" else None,
    )
