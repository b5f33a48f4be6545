"""The memory planner: every consumer of device and host memory, estimated before a weight loads.

From the model's ``config.json``, the run's shapes (prompts x n, prompt and response lengths,
devices) and the memory of the device and the host, ``plan_memory`` estimates what each phase
of a step holds (``estimate``) and picks, for every setting left at ``auto``, the fastest value
that fits (``SEARCH_ORDER``); settings a user gave are kept as given. The plan is a small table
(``MemoryPlan.table``); a plan that cannot fit raises ``MemoryPlanError`` with one line naming the
largest consumers and the settings that would make it fit.

Estimates are per device (FSDP shards master weights, gradients and optimizer state over the
devices of a role). Phases:

- ``rollout``: master weights and optimizer state, the engine's compute-dtype weight copy, the
  parameters gathered while that copy is made, the KV cache and the engine's activations;
- ``update``: master weights, gradients, optimizer state, the gathered parameters of the root
  and two decoder layers, the activations of one micro-batch (with checkpointed layers keeping
  only their input), the logits kept for the backward (or one chunk of them) and the output projection's
  weight gradient made beside them, plus the engine's memory when it stays allocated between rollouts;
- ``critic update`` (with a critic): what stays allocated, and the critic's gathered parameters and activations, of
  its own model's widths (``critic_phase``); ``reward`` and ``judge`` likewise for a reward model and a judge.

A vision-language model's tower is counted apart (``VisionShape``, ``add_vision_tower``): its weights, the
engine's copy, the activations of its patches, and its gradients and optimizer state when it trains. A multimodal
wrapper trained on text (Gemma 3 4B-27B) adds its tower's and projector's frozen weights (``wrapper_params``).

Activations per token and decoder layer are ``ACT_HIDDEN x hidden + ACT_KV x (k and v width) +
ACT_MLP x intermediate`` (plus ``ACT_NORM`` x hidden for each norm past two, Gemma 2 and 3) values of the compute dtype on CUDA (compiled layers, flash attention),
counted for the largest micro-batch the update really makes (``micro_batch_split``: a prompt's
samples stay together, so 64k-token micro-batches of the standard workload hold 54,912 tokens). The
constants were fitted to the update peaks the allocator reported on an H200 (2026-12-01 and 12-02,
BENCHMARKS.md) for Qwen2.5 0.5B, 1.5B and 3B without checkpointing at 12k to 55k tokens a micro-batch,
after subtracting weights, optimizer state and kept logits: those nine peaks lie within 1 GiB of the
estimate, and the estimates of the four checkpointed ones (1.5B to 7B) are 0.8 to 3.9 GiB above the
measured peaks. The eager CPU path (transformers' attention and MLP, nothing fused) saves more:
about 2.7 times what these constants give per token for 0.5B's widths at 512 tokens (autograd's
saved-tensor hooks, measured once on the CPU; its attention weights grow with the length, so this is
rough), hence ``EAGER_ACTIVATION_FACTOR`` on the CPU. ``OVERHEAD_BYTES`` covers
the CUDA context, the allocator's fragmentation and compiled kernels' workspaces.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reinforge.engine.image_embeddings import ENCODE_PATCHES as VISION_ENCODE_PATCHES
from reinforge.engine.memory_plan_splits import split_loads
from reinforge.engine.micro_batches import split_group
from reinforge.models.architectures import FAMILIES, architecture_spec, check_transformers_runs
from reinforge.models.kv_layout import kv_block_bytes, pool_blocks, window_pool_blocks
from reinforge.models.loading import read_model_config

GiB = 2**30
OVERHEAD_BYTES = 3 * GiB
"""CUDA context, cuBLAS/compile workspaces, allocator fragmentation (on top of every estimate)."""
HEADROOM = 0.94
"""Plans use at most this fraction of the device (and of the host's available memory)."""
MICRO_BATCH_CANDIDATES = (65536, 49152, 32768, 24576, 16384, 12288, 8192, 4096, 2048, 1024)
LOGITS_CHUNK_ROWS = 4096
ENGINE_MAX_NUM_SEQS = 512
ENGINE_MAX_BATCHED_TOKENS = 16384
KV_BLOCK_TOKENS = 16
"""Tokens of one block of the native engine's paged KV cache (its default ``block_size``)."""
# bytes saved per token per decoder layer for the backward, in units of the compute dtype's size:
# ACT_HIDDEN x hidden + ACT_KV x (k and v width) + ACT_MLP x intermediate
ACT_HIDDEN, ACT_KV, ACT_MLP = 9.5, 2, 2.4
ACT_NORM = 3
"""Values x hidden per token kept by each norm of a layer beyond its two (Gemma 2 and 3 also norm the attention's and
the MLP's outputs; their ``* (1 + w)`` norm keeps float32 values for the backward). Sized from the tensors one eager
layer saves, scaled by Qwen2.5's fitted-to-eager factor (``tests/engine/test_memory_plan_activations.py``: Gemma 2's
widths need at least 2.7)."""
FOUR_NORM_FAMILIES = ("gemma2", "gemma3", "gemma3_text")
"""Families whose decoder layer has four RMSNorms (before and after attention, before and after the MLP)."""
ACT_ROUTED, ACT_ROUTER = 2, 3
"""A mixture-of-experts layer's extra values per token: top_k x hidden for its sorted inputs and unweighted
outputs, and experts x 3 for the router's logits and float32 probabilities (counted from the code, not fitted)."""
EAGER_ACTIVATION_FACTOR = 3.0
MICRO_BATCH_OVERHEAD_TOKENS = 4096
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FAMILY_PROJECTIONS = ("qkv_proj", "gate_up_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
"""Projections of the families that name theirs otherwise (Phi-3's fused ones, DeepSeek's latent attention), which
adapters may target beside ``LORA_PROJECTIONS``."""
"""A micro-batch costs as much again as this many tokens (launches, the loss, FSDP's gathers and
reductions): each extra micro-batch took about 35 ms of update on the H200 of 2026-12-02 (1.5B:
5.05 s in 10 micro-batches of 30k tokens, 5.50 s in 22 of 12.7k; 0.5B: 1.90 s in 5, 2.07 s in 10);
on that GPU a 3B update in 2k-token micro-batches ran 5-7x slower than in 24k ones, so small
micro-batches must lose to checkpointing. The planner counts micro-batches as the update makes them
(``micro_batch_split``)."""
CHECKPOINT_COST = 0.2
"""Step-time fraction of checkpointing every layer: a third of a layer's forward and backward is its
forward, but the H200 measured less (1.5B, 24k micro-batches: 8.08 s plain, 9.40 s checkpointed, +16%)."""
UPDATE_SHARE = 0.65
"""The update's share of a GRPO step (the H200 bench: 0.57 for 0.5B, 0.65 for 1.5B, 0.68 for 3B)."""
GATHER_COST_MICRO_BATCHES = 0.5
"""The price of not keeping the parameters gathered (``Settings.keep_gathered``), in extra micro-batches: half of
one, so a plan keeps them only where they fit beside the settings it would choose anyway, never at the price of
smaller micro-batches or more recomputation. On one H200 the copies it saves took about 0.56 s of Gemma-2-2B's
8.7 s update in 14 micro-batches (each layer gathered for every forward and backward, reduced after each)."""


class MemoryPlanError(ValueError):
    """The run cannot fit; the message names the largest consumers and what would make it fit."""


VISION_DEFAULTS = {
    "qwen2_vl": dict(depth=32, embed_dim=1280, mlp_ratio=4, patch_size=14),
    "qwen2_5_vl": dict(depth=32, hidden_size=3584, intermediate_size=3420, patch_size=14, out_hidden_size=3584),
    "qwen3_vl": dict(depth=27, hidden_size=1152, intermediate_size=4304, patch_size=16, out_hidden_size=3584,
                     num_position_embeddings=2304, deepstack_visual_indexes=(8, 16, 24)),
}
"""transformers' defaults of each vision-language family's ``vision_config`` (a config.json may leave them out)."""
VISION_WORKING_HIDDEN, VISION_WORKING_MLP = 6, 3
"""Values per patch that one vision block holds at once in a forward without gradients: x hidden (residual, norm,
q, k, v, attention output) and x intermediate (the MLP's gate, up and product)."""


@dataclass(frozen=True)
class VisionShape:
    """The sizes of a vision-language model's vision tower (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), from ``vision_config``.

    An image of H x W pixels is (H / patch) x (W / patch) patches (a 448 x 448 image at 14 pixels: 1024), which
    the merger turns into patches / merge^2 image tokens of the language model (256). Every block is full
    multi-head attention over the patches' width and an MLP (Qwen2.5-VL's gated, with biases; the others' two
    linear layers); Qwen3-VL adds learned position embeddings and a merger per deepstack layer.
    """

    family: str
    hidden_size: int
    intermediate_size: int
    depth: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    merge_size: int = 2
    deepstack_mergers: int = 0
    position_embeddings: int = 0

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> VisionShape | None:
        """The tower of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL config.json; None for any other model (a text-only one)."""
        vision, family = config.get("vision_config"), str(config.get("model_type"))
        if not isinstance(vision, dict) or family not in VISION_DEFAULTS:
            return None
        values = VISION_DEFAULTS[family] | {
            key: value for key, value in vision.items() if value is not None}
        text = config.get("text_config") or config
        try:
            if family == "qwen2_vl":  # embed_dim is the tower's width, hidden_size the merger's output
                hidden = int(values["embed_dim"])
                width, out = int(hidden * float(values.get("mlp_ratio", 4))), int(values.get("hidden_size")
                                                                                 or text["hidden_size"])
            else:
                hidden, width = int(values["hidden_size"]), int(values["intermediate_size"])
                out = int(values.get("out_hidden_size") or text["hidden_size"])
            deepstack = values.get("deepstack_visual_indexes") or () if family == "qwen3_vl" else ()
            return cls(family=family, hidden_size=hidden, intermediate_size=width, depth=int(values["depth"]),
                       out_hidden_size=out, patch_size=int(values.get("patch_size") or 14),
                       temporal_patch_size=int(values.get("temporal_patch_size") or 2),
                       in_channels=int(values.get("in_channels") or values.get("in_chans") or 3),
                       merge_size=int(values.get("spatial_merge_size") or 2), deepstack_mergers=len(deepstack),
                       position_embeddings=int(values.get("num_position_embeddings") or 0)
                       if family == "qwen3_vl" else 0)
        except (KeyError, TypeError, ValueError) as error:
            raise MemoryPlanError(f"the model's vision_config has no whole-number size {error}; the planner needs its "
                                  "depth, hidden_size and intermediate_size (embed_dim and mlp_ratio for "
                                  "Qwen2-VL)") from None

    @property
    def num_params(self) -> int:
        """Parameters of the tower: patch embedding, blocks, merger(s) (Qwen2.5-VL-3B's: 0.67B)."""
        hidden, width, merged = self.hidden_size, self.intermediate_size, self.hidden_size * self.merge_size ** 2
        layer_norm = self.family != "qwen2_5_vl"  # LayerNorm (weight and bias); Qwen2.5-VL's RMSNorm has a weight
        norm = 2 * hidden if layer_norm else hidden
        patch = self.in_channels * self.temporal_patch_size * self.patch_size ** 2 * hidden
        patch += hidden if self.family == "qwen3_vl" else 0  # Qwen3-VL's patch projection has a bias
        attention = 3 * hidden * hidden + 3 * hidden + hidden * hidden + hidden
        mlp = (3 * hidden * width + 2 * width + hidden if self.family == "qwen2_5_vl"
               else 2 * hidden * width + width + hidden)
        block = 2 * norm + attention + mlp
        projection = merged * merged + merged + merged * self.out_hidden_size + self.out_hidden_size
        merger = norm + projection  # its norm is over one patch's width before the merge
        deepstack = self.deepstack_mergers * (2 * merged + projection)  # normed after the merge
        return patch + self.position_embeddings * hidden + self.depth * block + merger + deepstack

    def patches(self, image_tokens: int) -> int:
        """Patches the tower encodes for this many image tokens of the language model."""
        return image_tokens * self.merge_size ** 2

    def working_bytes_per_patch(self, dtype_bytes: int) -> int:
        """A forward without gradients (a frozen tower, the rollout's prefill): the pixels of a patch (float32)
        and what one block holds for it at once; nothing is kept from block to block but the hidden state."""
        pixels = 4 * self.in_channels * self.temporal_patch_size * self.patch_size ** 2
        return pixels + dtype_bytes * (VISION_WORKING_HIDDEN * self.hidden_size
                                       + VISION_WORKING_MLP * self.intermediate_size)

    def activation_bytes_per_patch(self, dtype_bytes: int, eager: bool = False) -> int:
        """A trained tower: what its blocks save per patch for the backward (the decoder layer's constants, with
        full multi-head attention's k and v of the tower's width), over every block."""
        values = ACT_HIDDEN * self.hidden_size + ACT_KV * 2 * self.hidden_size + ACT_MLP * self.intermediate_size
        return int(dtype_bytes * values * self.depth * (EAGER_ACTIVATION_FACTOR if eager else 1.0))


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that memory depends on (read from its config.json).

    Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE, DeepSeek V2/V3) count every expert's weights in
    memory and the experts a token runs through (``experts_per_token``) in activations and MFU; DeepSeek's
    multi-head latent attention (``kv_lora_rank`` > 0) has its own projections and caches one compressed
    latent and one rotary key per token and layer.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    attention_bias: bool = True
    """q, k and v carry biases (Qwen2 and Qwen2.5; not Llama, Mistral or Qwen3)."""
    num_experts: int = 0
    """Experts of each mixture-of-experts MLP; 0 for a dense MLP."""
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_dense_layers: int = 0
    """Layers of a mixture-of-experts model whose MLP is dense, of ``intermediate_size`` (DeepSeek's first k)."""
    q_lora_rank: int = 0
    """Multi-head latent attention: the query's low-rank width (0: a full q projection)."""
    kv_lora_rank: int = 0
    """Multi-head latent attention's compressed key-value width; 0 for standard attention."""
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    norms_per_layer: int = 2
    """RMSNorms of a decoder layer: 2 (before attention and before the MLP), 4 for ``FOUR_NORM_FAMILIES``."""
    attention_windows: tuple[int, ...] = ()
    """Each layer's sliding window (keys a query sees, itself included; 0 for the whole context), from
    ``layer_windows``; empty: every layer sees the whole context."""
    vision: VisionShape | None = None
    """A vision-language model's vision tower (counted apart: ``num_params`` and the rest are the language model's)."""
    wrapper_params: int = 0
    """Parameters a multimodal wrapper loads beside its language model that reinforge never runs (Gemma 3's vision
    tower and projector, on text prompts): frozen weights, counted in memory only (``wrapper_params``)."""

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], source: str = "the model's config.json") -> ModelShape:
        """The sizes of ``config`` (a config.json as a dict); ``source`` names it in a refusal."""
        given, config = config, with_family_defaults(config)
        text = standard_sizes(config.get("text_config") or config)
        check_size_values(text)
        check_routing_and_window(text, source)
        try:
            hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
            experts = int(text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts") or 0)
            expert_width = int(text.get("moe_intermediate_size") or text["intermediate_size"]) if experts else 0
            shared = int(text.get("shared_expert_intermediate_size") or 0) or (
                int(text.get("n_shared_experts") or 0) * expert_width)
            mla = int(text.get("kv_lora_rank") or 0)
            return cls(vocab_size=int(text["vocab_size"]), hidden_size=hidden,
                       num_layers=int(text["num_hidden_layers"]), num_heads=heads,
                       num_kv_heads=int(text.get("num_key_value_heads") or heads),
                       head_dim=int(text.get("head_dim") or hidden // heads),
                       intermediate_size=int(text["intermediate_size"]),
                       tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
                       attention_bias=bool(text.get("attention_bias", text.get("model_type", "qwen2") == "qwen2")),
                       num_experts=experts, experts_per_token=int(text.get("num_experts_per_tok") or 0) if experts else 0,
                       expert_intermediate_size=expert_width, shared_expert_intermediate_size=shared if experts else 0,
                       num_dense_layers=_dense_layers(text) if experts else 0,
                       q_lora_rank=int(text.get("q_lora_rank") or 0) if mla else 0, kv_lora_rank=mla,
                       qk_nope_head_dim=int(text.get("qk_nope_head_dim") or 0) if mla else 0,
                       qk_rope_head_dim=int(text.get("qk_rope_head_dim") or 0) if mla else 0,
                       v_head_dim=int(text.get("v_head_dim") or 0) if mla else 0,
                       norms_per_layer=4 if text.get("model_type") in FOUR_NORM_FAMILIES else 2,
                       attention_windows=layer_windows(text), vision=(vision := VisionShape.from_hf_config(given)),
                       wrapper_params=0 if vision is not None else wrapper_params(given))
        except KeyError as error:
            raise MemoryPlanError(f"the model's config.json has no {error.args[0]!r}; the planner needs the sizes of a "
                                  "decoder-only transformer (hidden_size, num_hidden_layers, num_attention_heads, "
                                  "intermediate_size, vocab_size)") from None
        except MemoryPlanError:
            raise
        except ZeroDivisionError:
            raise MemoryPlanError("the model's config.json gives num_attention_heads=0; the planner needs positive "
                                  "sizes (is model.path the right model?)") from None
        except (TypeError, ValueError, AttributeError) as error:
            raise MemoryPlanError(f"the model's config.json has a size that is not a whole number ({error}); the planner "
                                  "needs integer hidden_size, num_hidden_layers, num_attention_heads, intermediate_size "
                                  "and vocab_size") from None

    def __post_init__(self) -> None:
        keys = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
                "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
                "intermediate_size": "intermediate_size"}
        for name, key in keys.items():
            if getattr(self, name) < 1:
                raise MemoryPlanError(f"the model's config.json gives {key}={getattr(self, name)}; the planner needs "
                                      "positive sizes (is model.path the right model?)")
        if self.experts_per_token > self.num_experts:
            raise MemoryPlanError(f"the model's config.json routes each token through num_experts_per_tok="
                                  f"{self.experts_per_token} of "
                                  f"its {self.num_experts} experts; a mixture of experts needs 1 to {self.num_experts} "
                                  "(is model.path the right model?)")

    @classmethod
    def from_model_path(cls, path: str, key: str = "model.path") -> ModelShape:
        """The sizes of the model folder or hub id ``path``; ``key`` (the setting that gave it) names it in a refusal."""
        file = Path(path).expanduser() / "config.json"
        if not file.is_file():
            file = _hub_config(path, file, key)
        try:
            config = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise MemoryPlanError(f"{file} is not valid JSON ({error}); the memory planner reads the model's "
                                  "config.json, so repair or replace that file") from None
        if not isinstance(config, dict):
            raise MemoryPlanError(f"{file} holds a JSON {type(config).__name__}, not an object of model sizes; "
                                  f"{key} must be a Hugging Face model folder") from None
        return cls.from_hf_config(config, str(file))

    def _attention_shapes(self) -> list[tuple[int, int]]:
        """(rows, values per row) of one layer's attention weights, norms and biases."""
        hidden, heads = self.hidden_size, self.num_heads
        if self.kv_lora_rank:  # q (direct or through its low rank), kv_a (latent and rotary key), kv_b, o, norms
            q_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            query = ([(self.q_lora_rank, hidden), (self.q_lora_rank, 1), (heads * q_head, self.q_lora_rank)]
                     if self.q_lora_rank else [(heads * q_head, hidden)])
            return query + [(self.kv_lora_rank + self.qk_rope_head_dim, hidden), (self.kv_lora_rank, 1),
                            (heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
                            (hidden, heads * self.v_head_dim)]
        q_width, kv_width = heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = [(q_width, hidden), (kv_width, hidden), (kv_width, hidden), (hidden, q_width)]
        if self.attention_bias:
            shapes += [(q_width, 1), (kv_width, 1), (kv_width, 1)]
        return shapes

    def _mlp_shapes(self, sparse: bool) -> list[tuple[int, int]]:
        hidden = self.hidden_size
        if not sparse:
            width = self.intermediate_size
            return [(width, hidden), (width, hidden), (hidden, width)]
        # fused expert weights (gate and up together, down), the router, a shared expert and its gate
        experts, width, shared = self.num_experts, self.expert_intermediate_size, self.shared_expert_intermediate_size
        shapes = [(experts, 2 * width * hidden), (experts, hidden * width), (experts, hidden)]
        if shared:
            shapes += [(shared, hidden), (shared, hidden), (hidden, shared), (1, hidden)]
        return shapes

    def _layer_shapes(self, sparse: bool) -> list[tuple[int, int]]:
        return self._attention_shapes() + self._mlp_shapes(sparse) + [(self.hidden_size, 1), (self.hidden_size, 1)]

    @property
    def num_sparse_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.num_experts else 0

    @property
    def layer_params(self) -> int:
        """Parameters of the largest decoder layer (a mixture-of-experts layer in a MoE model)."""
        return sum(rows * width for rows, width in self._layer_shapes(bool(self.num_experts)))

    @property
    def dense_layer_params(self) -> int:
        return sum(rows * width for rows, width in self._layer_shapes(False))

    @property
    def active_intermediate_size(self) -> int:
        """The MLP width one token runs through (its experts' together for a mixture of experts)."""
        if self.num_experts:
            return self.experts_per_token * self.expert_intermediate_size + self.shared_expert_intermediate_size
        return self.intermediate_size

    @property
    def root_params(self) -> int:
        """Embeddings, the output head (unless tied) and the final norm."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @property
    def num_params(self) -> int:
        sparse = self.num_sparse_layers
        return sparse * self.layer_params + (self.num_layers - sparse) * self.dense_layer_params + self.root_params

    @property
    def projection_params(self) -> int:
        """Every layer's attention weights and dense MLP (a mixture of experts: its shared expert), what a LoRA
        actor's rollout engine copies; it reads the frozen experts, routers, norms and embeddings in place."""
        attention = sum(rows * width for rows, width in self._attention_shapes())
        dense = sum(rows * width for rows, width in self._mlp_shapes(False))
        sparse = self.num_sparse_layers
        return (self.num_layers * attention + (self.num_layers - sparse) * dense
                + sparse * 3 * self.hidden_size * self.shared_expert_intermediate_size)

    @property
    def num_active_params(self) -> int:
        """Parameters one token runs through: of each expert MLP only ``experts_per_token`` of its experts."""
        idle = self.num_experts - self.experts_per_token
        return self.num_params - self.num_sparse_layers * idle * 3 * self.hidden_size * self.expert_intermediate_size

    def tensor_shapes(self) -> list[tuple[int, int]]:
        """(first dimension, values per index of it) of every parameter tensor; FSDP shards along the first."""
        hidden = self.hidden_size
        root = [(self.vocab_size, hidden), (hidden, 1)] + ([] if self.tie_word_embeddings else [(self.vocab_size, hidden)])
        sparse = self.num_sparse_layers
        return root + self._layer_shapes(False) * (self.num_layers - sparse) + self._layer_shapes(True) * sparse

    def lora_tensor_shapes(self, rank: int, targets: tuple[str, ...] = LORA_PROJECTIONS) -> list[tuple[int, int]]:
        """The adapters' A (rank x in) and B (out x rank) of every decoder layer's ``targets`` projections.

        Only linear layers get adapters: a mixture-of-experts layer's MLP projections exist only as its shared
        expert (the fused 3-D expert weights stay frozen); latent attention has q_proj (without a q rank, else
        q_a_proj and q_b_proj), kv_a_proj_with_mqa, kv_b_proj and o_proj. ``targets`` names only layers of the
        model's family (Phi-3's fused qkv_proj and gate_up_proj, not q_proj ... up_proj).
        """
        hidden, heads = self.hidden_size, self.num_heads
        if self.kv_lora_rank:
            q_head, q_rank = self.qk_nope_head_dim + self.qk_rope_head_dim, self.q_lora_rank
            attention = {"q_proj": None if q_rank else (hidden, heads * q_head),
                         "q_a_proj": (hidden, q_rank) if q_rank else None,
                         "q_b_proj": (q_rank, heads * q_head) if q_rank else None,
                         "kv_a_proj_with_mqa": (hidden, self.kv_lora_rank + self.qk_rope_head_dim),
                         "kv_b_proj": (self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim)),
                         "o_proj": (heads * self.v_head_dim, hidden)}
        else:
            q_width, kv_width = heads * self.head_dim, self.num_kv_heads * self.head_dim
            attention = {"q_proj": (hidden, q_width), "k_proj": (hidden, kv_width), "v_proj": (hidden, kv_width),
                         "o_proj": (q_width, hidden), "qkv_proj": (hidden, q_width + 2 * kv_width)}

        def layer(width: int) -> list[tuple[int, int]]:
            fans = dict(attention)
            if width:
                fans |= {"gate_proj": (hidden, width), "up_proj": (hidden, width), "down_proj": (width, hidden),
                         "gate_up_proj": (hidden, 2 * width)}
            return [shape for name in targets if fans.get(name) for fan_in, fan_out in [fans[name]]
                    for shape in ((rank, fan_in), (fan_out, rank))]

        sparse = self.num_sparse_layers
        return (layer(self.intermediate_size) * (self.num_layers - sparse)
                + layer(self.shared_expert_intermediate_size) * sparse)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        if self.kv_lora_rank:  # the compressed latent and the shared rotary key
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def kv_block_bytes(self, block_size: int, kv_cache_dtype: str = "auto", dtype_bytes: float = 2) -> float:
        """Bytes of the rollout engine's cache block of ``block_size`` tokens over every layer, as the engine
        allocates it (``models/kv_layout.py``): fp8 counts its scales, 1 + 4 / head_dim bytes a value."""
        if self.kv_lora_rank:  # one latent entry per token; the engine keeps it in the model dtype
            if kv_cache_dtype == "fp8":
                raise ValueError("rollout.kv_cache_dtype=fp8: a model with latent attention (MLA) keeps its "
                                 "compressed cache in the model dtype; use rollout.kv_cache_dtype=auto")
            return kv_block_bytes(self.num_layers, 1, 1, self.kv_lora_rank + self.qk_rope_head_dim, block_size,
                                  kv_cache_dtype, dtype_bytes)
        return kv_block_bytes(self.num_layers, 2, self.num_kv_heads, self.head_dim, block_size, kv_cache_dtype,
                              dtype_bytes)

    def activation_bytes_per_token(self, dtype_bytes: int, eager: bool = False) -> int:
        """Saved for the backward by one decoder layer that is not checkpointed (the mean over the layers).

        A mixture-of-experts layer also keeps, per token, its top-k copies of the hidden state sorted by
        expert and the experts' outputs before weighting (``ACT_ROUTED`` x top_k x hidden), and the router's
        logits and probabilities (``ACT_ROUTER`` x experts).
        """
        if self.kv_lora_rank:
            kv_width = self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        else:
            kv_width = 2 * self.num_kv_heads * self.head_dim
        base = (ACT_HIDDEN + ACT_NORM * max(self.norms_per_layer - 2, 0)) * self.hidden_size + ACT_KV * kv_width
        dense = base + ACT_MLP * self.intermediate_size
        sparse = (base + ACT_MLP * self.active_intermediate_size + ACT_ROUTED * self.experts_per_token * self.hidden_size
                  + ACT_ROUTER * self.num_experts)
        values = (self.num_sparse_layers * sparse + (self.num_layers - self.num_sparse_layers) * dense) / self.num_layers
        return int(dtype_bytes * values * (EAGER_ACTIVATION_FACTOR if eager else 1.0))


WHOLE_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "vocab_size", "num_experts", "num_local_experts", "n_routed_experts",
               "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "n_shared_experts",
               "first_k_dense_replace", "decoder_sparse_step", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim", "sliding_window", "max_window_layers")
"""The sizes of a decoder's config the planner reads as whole numbers (null or absent: the family's default)."""
REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
POSITIVE_WHERE_GIVEN = ("num_key_value_heads", "head_dim")
"""Sizes the planner derives when they are absent or null, but which a config.json that gives them must give above 0
(a model of 0 key-value heads or a head dimension of 0 does not build)."""


def check_size_values(text: dict[str, Any]) -> None:
    """Refuse, naming the key, a size of ``WHOLE_SIZES`` in ``text`` that is no whole number (1.5, "wide", true), a
    ``REQUIRED_SIZES`` one given as null and a ``POSITIVE_WHERE_GIVEN`` one given as 0 or less, before the planner
    reads any."""
    for key in WHOLE_SIZES:
        value = text.get(key)
        if key in ("sliding_window", "max_window_layers") and text.get("model_type") in NO_WINDOW_FAMILIES:
            continue  # read by neither the model nor the planner
        if value is None and key in text and key in REQUIRED_SIZES:
            raise MemoryPlanError(f"the model's config.json gives {key}=null; the planner needs the sizes of a "
                                  f"decoder-only transformer ({', '.join(REQUIRED_SIZES)})")
        if value is None:
            continue
        whole = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
        if not whole:
            raise MemoryPlanError(f"the model's config.json gives {key}={value!r}, not a whole number; the planner "
                                  f"needs an integer {key} (is model.path the right model?)")
        if key in POSITIVE_WHERE_GIVEN and value < 1:
            raise MemoryPlanError(f"the model's config.json gives {key}={value}; the planner needs positive sizes "
                                  f"(leave {key} out or null to derive it; is model.path the right model?)")


def check_routing_and_window(text: dict[str, Any], source: str) -> None:
    """Refuse, naming the key, ``source`` (the config.json) and the fix, what a model of ``text`` (a decoder's config
    with its family's defaults and standard size names) would build wrongly or not at all: a mixture of experts
    without a ``num_experts_per_tok`` of 1 or more (0, null or absent: no expert runs), and a ``sliding_window`` that
    is not an integer of 1 or more. A null window is no window (Mistral, Phi-3, Qwen), except where ``layer_types``
    names sliding layers (Gemma 2 and 3 build none without it); Qwen's ``use_sliding_window=false`` reads no window, nor
    do the families of ``NO_WINDOW_FAMILIES``, whatever their config.json says."""
    experts = text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts")
    top_k = text.get("num_experts_per_tok")
    if experts and (top_k is None or isinstance(top_k, (int, float)) and top_k < 1):
        given = f"gives num_experts_per_tok={json.dumps(top_k)}" if "num_experts_per_tok" in text else \
            "has no num_experts_per_tok"
        raise MemoryPlanError(f"{source} {given} for its mixture of {experts} experts, so no expert would run; set "
                              f"num_experts_per_tok there to the experts each token runs through, 1 to {experts} "
                              "(the model's published top-k), or point model.path at the right model")
    if text.get("use_sliding_window") is False or text.get("model_type") in NO_WINDOW_FAMILIES:
        return  # no window is read: a leftover key builds and runs as transformers builds it
    window = text.get("sliding_window")
    if window is None:
        if "sliding_attention" in (text.get("layer_types") or ()):
            raise MemoryPlanError(f"{source} gives sliding_window=null, but its layer_types has sliding_attention "
                                  "layers, which need a window; set sliding_window there to the model's window in "
                                  "tokens (Gemma 2's is 4096)")
        return
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise MemoryPlanError(f"{source} gives sliding_window={json.dumps(window)}, which is no window; set it there "
                              "to the model's window in tokens (an integer of 1 or more), or to null for none")


def check_model_config(path: str) -> None:
    """``check_size_values`` and ``check_routing_and_window`` on the config.json of the local model folder ``path``
    (a hub id, a missing folder or a file that is not JSON pass: the planner or the load names what is wrong), so a
    run whose memory settings are all given is refused before its model loads too; then, on the config transformers
    builds from it, ``check_transformers_runs`` (a table family's config that transformers loads but cannot run); a
    config.json transformers cannot build a config from is refused as the load refuses it (``read_model_config``)."""
    file = Path(path).expanduser() / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return
    if isinstance(config, dict):
        given = config
        config = with_family_defaults(config)
        text = standard_sizes(config.get("text_config") or config)
        check_size_values(text)
        check_routing_and_window(text, str(file))
        config_class = _config_class(given.get("model_type") if isinstance(given.get("model_type"), str) else None)[0]
        try:  # no model_type, or one transformers has no config class of: read as the load reads it (below)
            built = config_class.from_dict(given) if config_class is not None else None
        except Exception:  # noqa: BLE001 (a config the class cannot build: transformers' own reading says why)
            built = None
        if built is None and "auto_map" not in given:
            # refused in one line where AutoConfig fails too; a folder with its own code (auto_map) is read by the
            # load, with model.trust_remote_code
            built = read_model_config(path)
        if built is not None:
            check_transformers_runs(built)


SIZE_ALIASES = {
    "hidden_size": ("n_embd", "d_model", "model_dim", "dim"),
    "num_hidden_layers": ("n_layer", "n_layers", "num_layers"),
    "num_attention_heads": ("n_head", "n_heads", "num_heads"),
    "num_key_value_heads": ("num_kv_heads", "n_head_kv", "kv_n_heads"),
    "intermediate_size": ("n_inner", "ffn_dim", "ffn_hidden_size", "d_ff", "inner_hidden_size"),
    "num_local_experts": ("moe_num_experts",),
    "num_experts_per_tok": ("moe_top_k", "moe_topk", "top_k_experts", "num_experts_per_token"),
}
"""Where a family's config.json keeps a standard size under its own name (GPT-2's n_embd, OPT's ffn_dim, Falcon's
num_kv_heads, DBRX's nested ffn_config and attn_config), after transformers' own map of each config class."""


CORE_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")


WRAPPER_PARTS = ("vision_config", "audio_config")
"""Sub-configs of a multimodal wrapper whose modules its language model does not run."""


def wrapper_params(config: dict[str, Any]) -> int:
    """Parameters of a multimodal wrapper outside its language model and head (Gemma 3 4B's SigLIP tower and
    projector: 0.42B), counted from the class reinforge loads, built on the meta device; 0 for a model without
    such parts, or one transformers cannot build from this config."""
    if not any(isinstance(config.get(name), dict) for name in WRAPPER_PARTS):
        return 0
    return _wrapper_params(json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=16)
def _wrapper_params(config_json: str) -> int:
    import torch
    from transformers import CONFIG_MAPPING

    from reinforge.models.classes import causal_lm_class

    given = json.loads(config_json)
    try:
        config = CONFIG_MAPPING[given["model_type"]].from_dict(given)
        with torch.device("meta"):
            model = causal_lm_class(config).from_config(config)
        language = {id(parameter) for parameter in model.get_decoder().parameters()}
        head = model.get_output_embeddings()
        if head is not None:
            language |= {id(parameter) for parameter in head.parameters()}
        return sum(parameter.numel() for parameter in model.parameters() if id(parameter) not in language)
    except Exception:  # the planner counts the language model alone
        return 0


@functools.cache
def _config_class(model_type: str | None) -> tuple[Any, dict[str, str], dict[str, Any]]:
    """transformers' config class of ``model_type``, its attribute map and its defaults (None, {}, {} where there is
    no transformers, or the type is unknown or has no default config)."""
    try:
        from transformers import CONFIG_MAPPING

        config_class = CONFIG_MAPPING[model_type]
        return config_class, dict(getattr(config_class, "attribute_map", {}) or {}), config_class().to_dict()
    except Exception:  # noqa: BLE001 (the names as they are)
        return None, {}, {}


def _under(given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``given`` with ``defaults`` filling the keys it leaves out, nested dicts (text_config) key by key."""
    merged = dict(defaults)
    for key, value in given.items():
        merged[key] = (_under(value, defaults[key]) if isinstance(value, dict) and isinstance(defaults.get(key), dict)
                       else value)
    return merged


def with_family_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with every key it leaves out taken from transformers' config class of its ``model_type``, built
    from it: the values the model is built with. Released files rely on them (Gemma 2 and Gemma 3 leave out
    ``tie_word_embeddings``, true; Gemma 3's multimodal files most of ``text_config``: heads, head_dim, vocab_size;
    Gemma 3 its ``layer_types``, which the class derives from ``sliding_window_pattern``). The file's own values,
    null ones included, stand; an unknown type or a config the class cannot build is left as it is."""
    model_type = config.get("model_type")
    config_class = _config_class(model_type if isinstance(model_type, str) else None)[0]
    if config_class is None:
        return config
    try:
        built = config_class.from_dict(config).to_dict()
    except Exception:  # noqa: BLE001 (the file as it is: the planner names what it lacks)
        return config
    return _under(config, built)


def standard_sizes(text: dict[str, Any]) -> dict[str, Any]:
    """``text`` (a decoder's config as a dict) with the standard size keys the planner reads filled in from the
    family's own names: the config class's ``attribute_map``, then ``SIZE_ALIASES`` (top level, then DBRX-style
    nested ``ffn_config``/``attn_config``), then the config class's own properties (NemotronH counts its layers
    from its block pattern). Where the family's config has no such size at all, as transformers builds it, the
    model's own convention stands in: an MLP of ``expansion_ratio`` (MPT) or 4 x hidden (GPT-2, BLOOM, Falcon,
    GPT-J, CodeGen, and GPT-Neo, whose config class leaves it None), one attention head for a model without
    attention (Mamba). Keys the config already has are kept; a known family's missing size stays missing (the
    planner says so). A size given per layer (Gemma 3n's list of MLP widths) stands as its largest entry."""
    values = dict(text)
    for key in WHOLE_SIZES:
        sizes = values.get(key)
        if isinstance(sizes, list) and sizes and all(isinstance(size, int) and not isinstance(size, bool)
                                                     for size in sizes):
            values[key] = max(sizes)
    model_type = values.get("model_type")
    config_class, aliases, defaults = _config_class(model_type if isinstance(model_type, str) else None)
    nested = [values] + [values[name] for name in ("attn_config", "ffn_config") if isinstance(values.get(name), dict)]
    for standard, names in SIZE_ALIASES.items():
        if values.get(standard) is not None:
            continue
        own = aliases.get(standard)
        found = [part[name] for part in nested for name in ((own,) if own else ()) + names
                 if part.get(name) is not None]
        if found:
            values[standard] = found[0]
    derived = [key for key in CORE_SIZES
               if values.get(key) is None and isinstance(getattr(config_class, key, None), property)]
    if derived:  # sizes the config class computes rather than stores (NemotronH's layers, from its block pattern)
        try:
            built = config_class.from_dict(values)
            values |= {key: getattr(built, key) for key in derived if isinstance(getattr(built, key, None), int)}
        except Exception:  # noqa: BLE001 (the config does not build: the conventions below, or the planner's error)
            pass
    if values.get("num_hidden_layers") is None:  # a hybrid's layers, one entry of its block pattern each
        patterns = [values.get(key) for key in ("layer_types", aliases.get("layer_types"), "layers_block_type",
                                                  "block_types", "hybrid_override_pattern") if key]
        lengths = [len(pattern) for pattern in patterns if isinstance(pattern, (list, str)) and pattern]
        if lengths:
            values["num_hidden_layers"] = lengths[0]
    if values.get("num_local_experts") and values.get("intermediate_size") is not None:
        values.setdefault("moe_intermediate_size", values["intermediate_size"])
    hidden = values.get("hidden_size")
    if defaults and isinstance(hidden, int):
        if values.get("intermediate_size") is None and defaults.get("intermediate_size") is None:  # GPT-Neo's too
            values["intermediate_size"] = int(float(values.get("expansion_ratio") or 4) * hidden)
        if (values.get("num_attention_heads") is None and "num_attention_heads" not in defaults
                and "num_attention_heads" not in aliases):
            values["num_attention_heads"] = 1
    return values


NO_WINDOW_FAMILIES = ("llama", "olmo2", "olmoe", "deepseek_v2", "deepseek_v3")
"""Families whose masks never slide (their models build only causal masks): a config.json that carries
``sliding_window`` (a fine-tune's leftover) still attends to the whole context, and its KV cache is counted whole."""


def layer_windows(text: dict[str, Any]) -> tuple[int, ...]:
    """Each decoder layer's sliding window as the model applies it (0: the whole context; () when no layer has one).

    A family of the architecture table (``models.architectures.FAMILIES``): the windows ``architecture_spec`` reads
    from the config transformers builds of ``text``, which transformers' masks and the native engine apply (Qwen3-MoE
    and Mistral slide every layer, whatever max_window_layers or layer_types say). Another family: ``layer_types``
    where the config lists them; else Gemma 2's even layers; Qwen's ``use_sliding_window`` from ``max_window_layers``
    on; else a ``sliding_window`` on every layer.
    """
    if text.get("model_type") in NO_WINDOW_FAMILIES:
        return ()
    layers, window = int(text["num_hidden_layers"]), int(text.get("sliding_window") or 0)
    if not window:
        return ()
    table = _table_windows(text)
    if table is not None:
        return tuple(size or 0 for size in table) if any(table) else ()
    types = text.get("layer_types")
    if types:
        sliding = [kind == "sliding_attention" for kind in types[:layers]]
    elif text.get("model_type") == "gemma2":
        sliding = [index % 2 == 0 for index in range(layers)]
    elif str(text.get("model_type", "")).startswith("qwen"):
        first = int(text.get("max_window_layers") or 0) if text.get("use_sliding_window") else layers
        sliding = [index >= first for index in range(layers)]
    else:
        sliding = [True] * layers
    return tuple(window if is_sliding else 0 for is_sliding in sliding) if any(sliding) else ()


def _table_windows(text: dict[str, Any]) -> list[int | None] | None:
    """Each layer's window (None: full attention) of a family in ``FAMILIES``, as ``architecture_spec`` reads it from
    the config transformers builds of ``text``; None for another family, or a config transformers cannot build or
    run (the load refuses it: ``check_model_config``)."""
    model_type = text.get("model_type")
    config_class = _config_class(model_type)[0] if model_type in FAMILIES else None
    if config_class is None:
        return None
    try:
        spec = architecture_spec(config_class.from_dict(text))
    except Exception:  # noqa: BLE001 (refused before the plan, in the load's own words)
        return None
    return None if spec is None else [layer.sliding_window for layer in spec.layers]


def _dense_layers(text: dict[str, Any]) -> int:
    """Dense-MLP layers of a mixture-of-experts config: DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers
    and decoder_sparse_step."""
    layers = int(text["num_hidden_layers"])
    if text.get("first_k_dense_replace"):
        return min(int(text["first_k_dense_replace"]), layers)
    step = int(text.get("decoder_sparse_step") or 1)
    only = {int(index) for index in text.get("mlp_only_layers") or []}
    return sum(1 for index in range(layers) if index in only or (index + 1) % step != 0)


@dataclass(frozen=True)
class RunShape:
    """What a step processes, per the config (prompt and response lengths are maxima)."""

    prompts: int
    samples_per_prompt: int
    prompt_length: int
    response_length: int
    num_mini_batches: int = 1
    num_devices: int = 1
    devices_per_host: int = 1
    """Training processes on one machine (trainer.devices_per_node), one a device: each keeps its own share of what
    is offloaded, so the host holds that many shares."""
    dtype_bytes: int = 2
    """Bytes of the compute dtype: 2 (bf16) on a GPU, 4 on the CPU."""
    eager: bool = False
    """The CPU's eager layers, which keep more activations than CUDA's compiled ones."""
    reference: bool = False
    critic: bool = False
    critic_model: ModelShape | None = None
    """The critic's own model (critic.model_path) where it is not the policy's; its backbone and value head train in
    float32 with AdamW, 16 bytes a parameter."""
    critic_tokens: int = 0
    """The critic's micro-batch budget (critic.max_tokens_per_micro_batch); 0: the actor's."""
    critic_offload: str = ""
    """Where the critic keeps its state off the device: "" (nowhere), "optimizer" (critic.optimizer_offload: the
    moments and a float32 master copy) or "param" (critic.param_offload: parameters, gradients and moments)."""
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = LORA_PROJECTIONS
    """The projections of each decoder layer that carry an adapter."""
    off_policy: bool = False
    """trainer.mode one_step_off or async: the rollout keeps its own copy of the weights (the last synced
    version) and generates while the update runs, so its memory stays allocated."""
    rollout_weights_on_host: bool = False
    """trainer.mode=async with trainer.trigger_sync_steps > 1: a validation or a checkpoint between two syncs copies
    the rollout's own weights (the whole model in the compute dtype) to the host, once for the run."""
    reward_model: ModelShape | None = None
    """reward.reward_model on these devices: its sizes (a ``reward`` phase scores with it)."""
    reward_model_offload: bool = True
    """Its weights wait on the host between scoring calls (on the device only in the ``reward`` phase)."""
    reward_model_tokens: int = 0
    """Its scoring micro-batch budget; 0: the update's (actor.max_tokens_per_micro_batch)."""
    judge: ModelShape | None = None
    judge_length: int = 0
    """reward.judge.max_prompt_length + reward.judge.max_tokens: the judge's longest sequence, which its engine's KV
    cache (of rollout.kv_cache_gib, as the policy's) must hold (``judge_sequence_gib``)."""
    """reward.judge's own model (not the policy) on these devices: its weights stay on each device whole; a
    ``judge`` phase adds its engine's weight copy, KV cache (rollout.kv_cache_gib, as the policy's) and activations."""
    kv_cache_dtype: str = "auto"
    """rollout.kv_cache_dtype: auto (the compute dtype) or fp8 (a byte a value plus a float32 scale per vector); auto
    where the native engine does not run (``native_engine``)."""
    native_engine: bool = True
    """The rollout runs on the native engine (rollout.name=native, on a model it runs); another engine (the hf backend)
    reads neither rollout.kv_cache_dtype nor rollout.gpu_memory_utilization."""
    kv_cache_fraction: float = 0.0
    """rollout.gpu_memory_utilization of the native engine on a GPU: its KV cache takes what the rollout leaves of this
    fraction of the device, up to what its max_num_seqs can use (``rollout.native.engine``'s sizing), not
    ``rollout.kv_cache_gib``; 0: the planner sizes the cache."""
    fp8_kv_cache_runs: bool = True
    """The devices can keep the native engine's fp8 cache (False on a GPU below compute capability 8.9, where its
    kernels do not compile): a refusal suggests rollout.kv_cache_dtype=fp8 only where it would run."""
    prefill_tokens: int = ENGINE_MAX_BATCHED_TOKENS
    """The most new tokens one prefill forward of the native engine runs, which its activations are sized for: its
    step of 16,384 tokens, or a longer rollout.max_prefill_chunk_tokens where a sequence is that long (a long
    prompt, or a preempted long sample prefilled again)."""
    image_tokens: int = 0
    """A vision-language model: the language model's image tokens of one prompt at most (data.max_image_tokens, else
    the prompt's length bounds them); its tower encodes ``VisionShape.patches`` of them. Ignored for a text model."""
    train_vision: bool = False
    """actor.freeze_vision_tower=false: the tower's gradients, optimizer state and saved activations count too."""

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def mini_batch_tokens(self) -> int:
        """Tokens computed for one mini-batch: each prompt once, each response."""
        prompts = self.prompts // max(self.num_mini_batches, 1)
        return prompts * (self.prompt_length + self.samples_per_prompt * self.response_length) // self.num_devices

    @property
    def response_fraction(self) -> float:
        per_sample_prompt = self.prompt_length / self.samples_per_prompt
        return self.response_length / (self.response_length + per_sample_prompt)


@dataclass
class Settings:
    """The settings the planner chooses (or is given). Their config keys are in ``SETTING_KEYS``."""

    micro_batch_tokens: int = 65536
    checkpoint_layers: int = 0
    """Decoder layers (from the first) whose activations are recomputed in the backward."""
    logits_buffer_gib: float = 24.0
    """A micro-batch's logits are kept for the backward when they take at most this; otherwise chunked."""
    kv_cache_gib: float = 0.0
    """0 sizes the cache for every sequence of a step at full length."""
    keep_rollout_memory: bool = True
    optimizer_offload: bool = False
    param_offload: bool = False
    ref_offload: bool = False
    keep_gathered: bool = False
    """One device: the update keeps every layer's gathered compute-dtype parameters from the first micro-batch's
    forward to the last one's backward and reduces the gradients once a mini-batch (``engine.train_step``)."""


SETTING_KEYS = {
    "micro_batch_tokens": "actor.max_tokens_per_micro_batch",
    "checkpoint_layers": "model.gradient_checkpointing",
    "logits_buffer_gib": "actor.logits_buffer_gib",
    "kv_cache_gib": "rollout.kv_cache_gib",
    "keep_rollout_memory": "rollout.free_cache_engine",
    "optimizer_offload": "actor.optimizer_offload",
    "param_offload": "actor.param_offload",
    "ref_offload": "ref.param_offload",
    "keep_gathered": "actor.keep_gathered",
}


def _hub_config(path: str, local: Path, key: str = "model.path") -> Path:
    """config.json of a hub id (``org/name``) through huggingface_hub's cache, as transformers would load the model;
    a path that is no local folder and no reachable hub id gets one line."""
    if Path(path).expanduser().is_file():  # model.path=/models/x/config.json: the folder was meant
        raise MemoryPlanError(f"{key}={path} is a file; point {key} at the folder that holds config.json "
                              f"({Path(path).expanduser().parent} for this one)")
    fetched, why = None, "no local folder of that name"
    if not Path(path).expanduser().exists() and path.count("/") == 1 and not path.startswith((".", "/", "~")):
        try:
            from huggingface_hub import hf_hub_download

            fetched = Path(hf_hub_download(path, "config.json"))
        except Exception as error:  # offline, unknown repo, gated: the user needs the one line below
            why = f"no local folder, and the hub did not give its config.json: {type(error).__name__}"
    if fetched is None:
        raise MemoryPlanError(f"{local} does not exist ({why}); the memory planner reads the model's config.json, so "
                              f"{key} must be a model folder or a reachable hub id")
    return fetched


@functools.lru_cache(maxsize=4096)
def micro_batch_split(run: RunShape, budget: int) -> tuple[int, int]:
    """(micro-batches per mini-batch, tokens of the largest) on one device at full lengths, as the update cuts them.

    Groups of a prompt and its samples stay together (``engine.micro_batches``), so the largest
    micro-batch is often well under the budget, and the planner sizes activations by it. Counted without making
    them (``memory_plan_splits``): 200,000 prompts plan in a fraction of a second.
    """
    groups = max(-(-run.prompts // max(run.num_mini_batches, 1)) // run.num_devices, 1)
    group = split_group(run.prompt_length, [run.response_length] * run.samples_per_prompt, budget)
    return split_loads([cost for _, cost in group], groups, budget)


SHARD_ALIGN = 512
"""Byte alignment of each offloaded shard in its unit's pinned host buffer (``engine.fsdp.pin_offloaded_shards``)."""


def shard_aligned(size: int) -> int:
    """``size`` bytes rounded up to ``SHARD_ALIGN``: the room a shard takes in its unit's pinned buffer."""
    return -(-size // SHARD_ALIGN) * SHARD_ALIGN


def pinned_bytes(shapes: list[tuple[int, int]], devices: int, value_bytes: int, power_of_two: bool = False) -> int:
    """Host bytes of these tensors' FSDP shards (the first dimension split over ``devices``, padded) once pinned.

    The offloaded shards themselves sit at their exact size in one page-locked buffer per FSDP unit
    (``engine.fsdp.pin_offloaded_shards``; each shard at a ``SHARD_ALIGN``-byte offset). The
    gradients FSDP offloads go through PyTorch's caching host allocator, which rounds every block up
    to a power of two (``power_of_two``; torch 2.11 has no setting against it): pinned that way,
    Qwen2.5-7B's 14.2 GiB of bf16 weights took 27.0 GiB (the H200 of 2026-12-02 counted 27.9 GiB of
    the process's shared pages, where pinned memory shows, for a 7B LoRA run).
    """
    total = 0
    for rows, width in shapes:
        size = -(-rows // devices) * width * value_bytes
        if size:
            total += 1 << (size - 1).bit_length() if power_of_two else shard_aligned(size)
    return total


@functools.lru_cache(maxsize=256)
def lora_params(shape: ModelShape, rank: int, targets: tuple[str, ...] = LORA_PROJECTIONS) -> int:
    """Parameters of the LoRA adapters (Qwen2.5-7B at rank 32 on all seven projections: 80.7M)."""
    return sum(rows * width for rows, width in shape.lora_tensor_shapes(rank, targets))


@functools.lru_cache(maxsize=256)
def pinned_model_bytes(shape: ModelShape, devices: int, value_bytes: int, lora_rank: int = 0,
                       lora_targets: tuple[str, ...] = LORA_PROJECTIONS, power_of_two: bool = False) -> int:
    """``pinned_bytes`` of the model's parameters, or of its LoRA adapters when ``lora_rank`` is set (cached:
    the planner's search asks for it thousands of times)."""
    shapes = shape.lora_tensor_shapes(lora_rank, lora_targets) if lora_rank else shape.tensor_shapes()
    return pinned_bytes(shapes, devices, value_bytes, power_of_two)


def needed_kv_gib(shape: ModelShape, run: RunShape, share: int = 1) -> float:
    """A KV cache that holds every sequence of a step (up to the engine's concurrency) at full length; with
    ``share`` > 1, one ``share``-th of them.

    The native engine gives a sequence whole blocks of ``KV_BLOCK_TOKENS`` and a decode step launched ahead
    room for one token more than it holds, so a sequence takes ceil((prompt + response + 1) / block) blocks;
    a pool a block short per sequence preempts sequences at the end of a rollout and prefills them again.
    Layers with a sliding window keep a pool per window that needs no more than one full-length sequence and
    every other sequence's window (``kv_pool_blocks``), so Gemma 2 and 3 at long responses ask for far less.
    """
    block_bytes, counts = kv_pool_blocks(shape, run, share)
    return sum(size * count for size, count in zip(block_bytes, counts, strict=True)) / GiB


def judge_sequence_gib(run: RunShape) -> float:
    """GiB of one judge sequence at full length in its engine's KV cache (whole blocks, the lookahead token); 0 without
    a judge model of its own or where the native engine does not run (the hf backend sizes its own cache)."""
    if run.judge is None or not run.judge_length or not run.native_engine:
        return 0.0
    dtype = "auto" if run.judge.kv_lora_rank else run.kv_cache_dtype  # latent attention keeps the model dtype
    blocks = -(-(run.judge_length + 1) // KV_BLOCK_TOKENS)
    return run.judge.kv_block_bytes(KV_BLOCK_TOKENS, dtype, run.dtype_bytes) * blocks / GiB


def rollout_concurrency(sequences: int, num_devices: int) -> int:
    """The native engine's ``max_num_seqs`` where the planner sizes its cache: one device's sequences of a step,
    at most ``ENGINE_MAX_NUM_SEQS``; a sliding pool then holds the windows of those sequences only."""
    return min(sequences // num_devices or 1, ENGINE_MAX_NUM_SEQS)


def kv_layer_groups(windows: tuple[int, ...], num_layers: int) -> list[tuple[int | None, int]]:
    """The native engine's KV pools as (window or None for full attention, layers): one per distinct window,
    full attention first, where full and sliding layers mix; else one pool of every layer, through the widest
    window when every layer slides."""
    if not windows:
        return [(None, num_layers)]
    distinct = sorted(set(windows))
    if len(distinct) == 1 or 0 not in distinct:
        return [(distinct[-1] or None, num_layers)]
    return [(window or None, windows.count(window)) for window in distinct]


def kv_pool_blocks(shape: ModelShape, run: RunShape, share: int = 1) -> tuple[list[float], list[float]]:
    """Each KV pool's bytes a block and the blocks it needs to hold every sequence of a step (up to the engine's
    concurrency, ``rollout_concurrency``) plus the lookahead token: the first pool each sequence's blocks, each
    other pool what the engine's split gives it (``models/kv_layout.py``'s ``pool_blocks``); with ``share`` > 1,
    for one ``share``-th of the sequences."""
    concurrency = rollout_concurrency(run.sequences, run.num_devices)
    sequences = concurrency / share
    length = run.prompt_length + run.response_length
    every_layer = shape.kv_block_bytes(KV_BLOCK_TOKENS, run.kv_cache_dtype, run.dtype_bytes)
    groups = kv_layer_groups(shape.attention_windows, shape.num_layers)
    caps = [window_pool_blocks(window, concurrency, length, KV_BLOCK_TOKENS) for window, _ in groups]
    first = sequences * -(-(length + 1) // KV_BLOCK_TOKENS)
    if len(groups) == 1:  # one pool: the engine takes every block the bytes hold
        return [every_layer], [min(first, caps[0]) if groups[0][0] is not None else first]
    return [every_layer / shape.num_layers * layers for _, layers in groups], pool_blocks(first, caps)


@functools.lru_cache(maxsize=4096)
def micro_batch_prompts(run: RunShape, budget: int) -> int:
    """Prompt copies (each with its images) in the largest micro-batch, at most: its tokens over the smallest item's
    (a prompt with as many of its responses as fit, ``split_group``), and no more than the mini-batch's items."""
    groups = max(-(-run.prompts // max(run.num_mini_batches, 1)) // run.num_devices, 1)
    items = split_group(run.prompt_length, [run.response_length] * run.samples_per_prompt, budget)
    _, tokens = micro_batch_split(run, budget)
    return min(-(-tokens // min(cost for _, cost in items)), len(items) * groups)


def add_vision_tower(phases: dict[str, dict[str, float]], host: dict[str, float], shape: ModelShape, run: RunShape,
                     settings: Settings, resident: dict[str, float]) -> None:
    """The vision tower's consumers, in place: its weights (float32 masters, or the base dtype under LoRA) beside
    the language model's, its copy in the rollout engine (``rollout.native.multimodal.VisionTower``, whole on every
    device), its gradients and optimizer state when trained, and its activations: a frozen tower encodes the step's
    images once, forward only (one block's working set for ``VISION_ENCODE_PATCHES`` patches), and their embeddings
    stay for the step (the actor's, and the reference's beside them during its pass); a trained one runs per
    micro-batch and keeps every block's activations for the backward."""
    tower, devices, dtype_bytes = shape.vision, run.num_devices, run.dtype_bytes
    assert tower is not None
    params, trained = tower.num_params, run.train_vision and not run.lora_rank
    weights = (dtype_bytes if run.lora_rank else 4) * params / devices
    offloaded = settings.param_offload
    update, rollout = phases["update"], phases["rollout"]
    placed = [(offloaded, "vision tower", weights)]  # (on the host, name, bytes)
    if trained:
        placed += [(offloaded, "vision gradients", 4 * params / devices),
                   (offloaded or settings.optimizer_offload, "vision optimizer state", 8 * params / devices)]
    if run.reference and not run.lora_rank:  # the reference model's tower
        placed.append((settings.ref_offload, "reference", dtype_bytes * params / devices))
    if run.off_policy:
        placed.append((False, "off-policy rollout model", dtype_bytes * params))
    for on_host, name, value in placed:
        if on_host:
            host[name] = host.get(name, 0.0) + value
            continue
        if name != "vision gradients":  # held in every phase (gradients only in the update)
            resident[name] = resident.get(name, 0.0) + value
            rollout[name] = rollout.get(name, 0.0) + value
        update[name] = update.get(name, 0.0) + value
    copy = dtype_bytes * params
    rollout["vision tower copy"] = copy
    if devices > 1:
        rollout["gathered parameters"] += dtype_bytes * params
    prefill_tokens = min(ENGINE_MAX_BATCHED_TOKENS, max(run.prompts // devices, 1) * run.image_tokens)  # once a prompt
    rollout["vision activations"] = tower.patches(prefill_tokens) * tower.working_bytes_per_patch(dtype_bytes)
    if "rollout weight copy" in update:
        update["vision tower copy"] = copy
    if run.off_policy:
        update["rollout vision activations"] = rollout["vision activations"]
    if trained:
        patches = tower.patches(micro_batch_prompts(run, settings.micro_batch_tokens) * run.image_tokens)
        update["vision activations"] = patches * tower.activation_bytes_per_patch(dtype_bytes, run.eager)
        return
    step_image_tokens = max(run.prompts // devices, 1) * run.image_tokens
    patches = min(max(VISION_ENCODE_PATCHES, tower.patches(run.image_tokens)), tower.patches(step_image_tokens))
    update["vision activations"] = patches * tower.working_bytes_per_patch(dtype_bytes)
    copies = 2 if run.reference and not run.lora_rank else 1
    update["image embeddings"] = (copies * step_image_tokens * tower.out_hidden_size * dtype_bytes
                                  * (1 + tower.deepstack_mergers))


def estimate(shape: ModelShape, run: RunShape, settings: Settings,
             gpu_bytes: float = 0.0) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Bytes per consumer: ``({"rollout": {...}, "update": {...}}, host)``, per device (the host's: per machine, the
    shares of its ``run.devices_per_host`` processes); with ``run.kv_cache_fraction``, the KV cache is what the
    rollout leaves of that fraction of ``gpu_bytes``."""
    devices, dtype_bytes, params = run.num_devices, run.dtype_bytes, shape.num_params
    trainable = lora_params(shape, run.lora_rank, run.lora_targets) if run.lora_rank else params
    host: dict[str, float] = {}
    resident: dict[str, float] = {}
    masters = 4 * params / devices if not run.lora_rank else dtype_bytes * params / devices + 4 * trainable / devices
    gradients = 4 * trainable / devices
    if settings.param_offload and not run.eager:  # pinned shards, and the gradients FSDP offloads (powers of two)
        gradients = pinned_model_bytes(shape, devices, 4, run.lora_rank, run.lora_targets, power_of_two=True)
        masters = pinned_model_bytes(shape, devices, dtype_bytes if run.lora_rank else 4)
        if run.lora_rank:  # the adapters' float32 weights
            masters += pinned_model_bytes(shape, devices, 4, run.lora_rank, run.lora_targets)
    (host if settings.param_offload else resident)["master weights"] = masters
    optimizer = 8 * trainable / devices
    (host if settings.param_offload or settings.optimizer_offload else resident)["optimizer state"] = optimizer
    if settings.param_offload:
        host["gradients"] = gradients
    elif settings.optimizer_offload:  # engine.offload: a float32 master copy beside the moments, two staging buckets
        host["master copy"] = 4 * trainable / devices
        host["staging buffers"] = 2 * 4 * (1 << 26)
    if run.reference and not run.lora_rank:
        (host if settings.ref_offload else resident)["reference"] = (
            pinned_model_bytes(shape, devices, dtype_bytes) if settings.ref_offload and not run.eager
            else dtype_bytes * params / devices) + dtype_bytes * shape.wrapper_params / devices
    if shape.wrapper_params:  # frozen, in the masters' dtype (the base dtype under LoRA), sharded like them
        (host if settings.param_offload else resident)["wrapper's unused weights"] = (
            (dtype_bytes if run.lora_rank else 4) * shape.wrapper_params / devices)
    if run.critic:  # its backbone and one-output value head (no vocabulary head), float32 with AdamW's moments
        critic, offload = reward_model_params(run.critic_model or shape) / devices, "" if run.eager else run.critic_offload
        if offload != "param":  # its parameters and gradients, and the moments unless they are on the host
            resident["critic"] = (8 if offload else 16) * critic
        if offload:  # the moments and a float32 master copy; offloaded parameters, their gradients too
            host["critic"] = (16 if offload == "param" else 12) * critic
    if run.off_policy:
        resident["off-policy rollout model"] = dtype_bytes * params
    if run.reward_model is not None:
        reward_weights = dtype_bytes * reward_model_params(run.reward_model) / devices
        (host if run.reward_model_offload and not run.eager else resident)["reward model"] = reward_weights
    if run.judge is not None:
        resident["judge"] = dtype_bytes * run.judge.num_params
    gathered = dtype_bytes * (shape.root_params + 2 * shape.layer_params)
    engine_weights = dtype_bytes * params
    if run.lora_rank and devices == 1 and not settings.param_offload and not run.off_policy:
        # the frozen base is the engine's too (rollout.native.model.weights_read_in_place): counted once
        engine_weights = dtype_bytes * shape.projection_params
    kv_cache = max(settings.kv_cache_gib or needed_kv_gib(shape, run), judge_sequence_gib(run)) * GiB
    engine_activations = (run.prefill_tokens * (4 * shape.intermediate_size + 8 * shape.hidden_size) * dtype_bytes
                          + ENGINE_MAX_NUM_SEQS * shape.vocab_size * 16 + (256 << 20))

    rollout = dict(resident)
    rollout["rollout weight copy"] = engine_weights
    if devices > 1:  # on one device the engine copies the local shards themselves (rollout.native.model.whole)
        rollout["gathered parameters"] = dtype_bytes * params
    rollout["kv cache"] = kv_cache
    rollout["rollout activations"] = engine_activations

    update = dict(resident)
    update["gradients"] = 0.0 if settings.param_offload else gradients
    # kept gathered: the whole compute-dtype copy (the accumulated float32 gradients replace the sharded ones)
    update["gathered parameters"] = dtype_bytes * params if settings.keep_gathered else gathered
    _, tokens = micro_batch_split(run, settings.micro_batch_tokens)
    plain, per_layer = shape.num_layers - settings.checkpoint_layers, shape.activation_bytes_per_token(dtype_bytes, run.eager)
    update["activations"] = tokens * (plain * per_layer
                                      + settings.checkpoint_layers * shape.hidden_size * dtype_bytes
                                      + (per_layer if settings.checkpoint_layers else 0)
                                      + 4 * shape.hidden_size * dtype_bytes)
    rows = tokens * run.response_fraction
    logits = rows * shape.vocab_size * dtype_bytes
    kept = logits <= settings.logits_buffer_gib * GiB
    update["logits"] = logits if kept else LOGITS_CHUNK_ROWS * shape.vocab_size * (2 * dtype_bytes + 8)
    # the output projection's weight gradient, made beside the logits (engine.log_probs; float32 when chunked)
    update["head gradient"] = shape.vocab_size * shape.hidden_size * (dtype_bytes if kept else 4)
    if settings.keep_rollout_memory or run.off_policy:
        update["rollout weight copy"] = engine_weights
        update["kv cache"] = kv_cache
    if run.off_policy:  # the rollout generates while the update runs
        update["rollout activations"] = engine_activations
    phases = {"rollout": rollout, "update": update}
    if shape.vision is not None:
        add_vision_tower(phases, host, shape, run, settings, resident)
    if run.kv_cache_fraction:  # the engine fills the fraction with its cache, after what the rollout holds besides,
        # up to what its default max_num_seqs of full-length sequences can use
        useful = needed_kv_gib(shape, dataclasses.replace(run, prompts=ENGINE_MAX_NUM_SEQS * devices,
                                                          samples_per_prompt=1)) * GiB
        kv_cache = min(max(run.kv_cache_fraction * gpu_bytes - sum(value for name, value in rollout.items()
                                                                   if name != "kv cache"), 0.0), useful)
        for phase in (rollout, update):
            if "kv cache" in phase:
                phase["kv cache"] = kv_cache
    kept = {name: update[name] for name in ("rollout weight copy", "vision tower copy", "kv cache") if name in update}
    if run.critic:  # the rollout generates beside it in the off-policy modes, as beside the actor's update
        phases["critic update"] = critic_phase(shape, run, settings, resident | kept | (
            {"rollout activations": update["rollout activations"]} if run.off_policy else {}))
    if run.reward_model is not None:
        phases["reward"] = reward_phase(run, settings, resident | kept)
    if run.judge is not None:
        phases["judge"] = judge_phase(run, kv_cache, resident | kept)
    host = {name: value * run.devices_per_host for name, value in host.items()}
    if run.rollout_weights_on_host:  # one copy, from the rollout's first rank (not one a process)
        host[ROLLOUT_WEIGHTS_ON_HOST] = dtype_bytes * params
    return phases, host


ROLLOUT_WEIGHTS_ON_HOST = "rollout weights between syncs"
"""The host's copy of the async rollout's weights while a validation or a checkpoint lands between two syncs."""


def peak_bytes(phases: dict[str, dict[str, float]]) -> tuple[str, float]:
    name = max(phases, key=lambda phase: sum(phases[phase].values()))
    return name, sum(phases[name].values()) + OVERHEAD_BYTES


CHUNKED_LOGITS_COST = 0.04
"""Step-time fraction of recomputing the logits chunk by chunk in the backward instead of keeping them."""


def checkpoint_choices(shape: ModelShape) -> list[tuple[int, float]]:
    """The recomputed decoder layers a plan may choose (none, each quarter, all), fewest first, with the step-time
    fraction each adds (``CHECKPOINT_COST``)."""
    quarter = max(shape.num_layers // 4, 1)
    layers = sorted({0, quarter, 2 * quarter, 3 * quarter, shape.num_layers})
    return [(count, CHECKPOINT_COST * count / shape.num_layers) for count in layers]


def cheapest_plan(choices: dict[str, list[tuple[Any, float]]], make: Callable[[dict[str, Any]], MemoryPlan],
                  size: Callable[[MemoryPlan], float]) -> tuple[MemoryPlan | None, MemoryPlan]:
    """Every combination of ``choices`` (a setting's name: its values with the step-time fraction each adds,
    fastest first) made a plan by ``make`` (the values by name): (the cheapest plan that fits, on a tie the first
    tried, or None; the plan of least ``size`` among those that do not fit, or the cheapest when every one fits)."""
    best: tuple[float, MemoryPlan] | None = None
    closest: tuple[float, MemoryPlan] | None = None
    for combination in itertools.product(*choices.values()):
        cost = sum(value_cost for _, value_cost in combination)
        if best is not None and cost >= best[0]:
            continue
        plan = make({name: value for name, (value, _) in zip(choices, combination, strict=True)})
        if plan.fits:
            best = (cost, plan)
        else:
            plan_size = size(plan)
            if closest is None or plan_size < closest[0]:
                closest = (plan_size, plan)
    assert best is not None or closest is not None
    return (best[1] if best else None), (closest[1] if closest else best[1])  # type: ignore[index]


def _options(shape: ModelShape, run: RunShape, lora: bool) -> dict[str, list[tuple[Any, float]]]:
    """Each setting's values, fastest first, with the cost of each: the step-time fraction it roughly adds
    (``MICRO_BATCH_OVERHEAD_TOKENS`` and ``CHECKPOINT_COST`` say where the first two come from; an optimizer
    step on the CPU or parameters streamed from it cost more than any other choice)."""
    longest = run.prompt_length + run.response_length
    sizes = [size for size in MICRO_BATCH_CANDIDATES if size >= longest] or [longest]
    fewest = micro_batch_split(run, sizes[0])[0]
    per_micro_batch = UPDATE_SHARE * MICRO_BATCH_OVERHEAD_TOKENS / max(run.mini_batch_tokens, 1)
    micro = [(size, per_micro_batch * (micro_batch_split(run, size)[0] - fewest)) for size in sizes]
    return {
        "keep_rollout_memory": [(True, 0.0)] if run.off_policy else [(True, 0.0), (False, 0.03)],
        "micro_batch_tokens": micro,
        "logits_buffer_gib": [(24.0, 0.0), (0.0, CHUNKED_LOGITS_COST)],
        "checkpoint_layers": checkpoint_choices(shape),
        "kv_cache_gib": [(0.0, 0.0)] + ([] if run.kv_cache_fraction else [
            (round(needed_kv_gib(shape, run, factor), 3), cost) for factor, cost in ((2, 0.05), (4, 0.15), (8, 0.4))]),
        "ref_offload": [(False, 0.0)] if lora else [(False, 0.0), (True, 0.2)],
        "optimizer_offload": [(False, 0.0), (True, 1.0)],
        "param_offload": [(False, 0.0), (True, 3.0)],
        "keep_gathered": ([(True, 0.0), (False, GATHER_COST_MICRO_BATCHES * per_micro_batch)]
                          if run.num_devices == 1 else [(False, 0.0)]),
    }


@dataclass
class MemoryPlan:
    settings: Settings
    given: set[str]
    """Settings the user set (not auto)."""
    phases: dict[str, dict[str, float]]
    host: dict[str, float]
    gpu_budget: float
    host_budget: float
    vision: str = ""
    """A vision-language model: one line on its tower (``vision_line``)."""
    kv_cache_fraction: float = 0.0
    """rollout.gpu_memory_utilization, where it sizes the KV cache (``RunShape.kv_cache_fraction``)."""
    model: str = ""
    """One line on the model's parameters and what of them trains (``model_line``)."""
    forced: frozenset[str] = frozenset()
    """Settings of ``given`` the run fixes where the user left them auto (the hf engine frees its memory; on the CPU
    nothing is offloaded): the table marks them fixed, not set."""

    @property
    def peak(self) -> tuple[str, float]:
        return peak_bytes(self.phases)

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    @property
    def fits(self) -> bool:
        return self.peak[1] <= self.gpu_budget and self.host_total <= self.host_budget

    def largest_consumers(self, count: int = 3) -> str:
        """The peak phase's ``count`` largest consumers, the fixed ``OVERHEAD_BYTES`` among them, then what the
        others add, so the figures sum to the peak: 'fixed overhead 3.0 GiB, rollout activations 2.2 GiB, rollout
        weight copy 0.9 GiB and 0.5 GiB in 2 others'."""
        phase, _ = self.peak
        items = sorted([*self.phases[phase].items(), ("fixed overhead", OVERHEAD_BYTES)], key=lambda item: -item[1])
        items = [(name, value) for name, value in items if value > 0]
        if len(items) == count + 1:  # the one other by its name
            count += 1
        named = ", ".join(f"{name} {value / GiB:.1f} GiB" for name, value in items[:count])
        others = items[count:]
        return (f"{named} and {sum(value for _, value in others) / GiB:.1f} GiB in {len(others)} others" if others
                else named)

    def table(self) -> str:
        phase, peak = self.peak
        lines = [f"memory plan: peak {peak / GiB:.1f} of {self.gpu_budget / GiB:.1f} usable GiB on the device ({phase}), "
                 f"host {self.host_total / GiB:.1f} of {self.host_budget / GiB:.1f} GiB"]
        if self.model:
            lines.append("  " + self.model)
        for name, key in SETTING_KEYS.items():
            value = getattr(self.settings, name)
            shown = _config_value(name, value)
            origin = "(fixed)" if name in self.forced else "(set)" if name in self.given else "(auto)"
            if name == "kv_cache_gib" and self.kv_cache_fraction:  # the engine's own sizing, not the setting
                shown = f"{self.phases['rollout']['kv cache'] / GiB:.1f}"
                origin = f"(rollout.gpu_memory_utilization={self.kv_cache_fraction:g})"
            lines.append(f"  {key:<36} {shown!s:<10} {origin}")
        consumers = sorted(self.phases[phase].items(), key=lambda item: -item[1])
        lines.append("  device, " + phase + ": " + ", ".join(f"{n} {v / GiB:.1f}" for n, v in consumers if v > 0)
                     + f", overhead {OVERHEAD_BYTES / GiB:.1f} GiB")
        if phase != "rollout":  # the rollout's own line: how much of it the KV cache takes (long responses)
            rollout = self.phases["rollout"]
            lines.append(f"  device, rollout: {peak_bytes({'rollout': rollout})[1] / GiB:.1f} GiB with a KV cache of "
                         f"{rollout['kv cache'] / GiB:.1f} GiB")
        if "reward" in self.phases and phase != "reward":
            lines.append(f"  device, reward: {sum(self.phases['reward'].values()) / GiB:.1f} GiB with the reward model's "
                         f"{self.phases['reward']['reward model'] / GiB:.1f} GiB of weights")
        if "judge" in self.phases and phase != "judge":
            judge = self.phases["judge"]
            lines.append(f"  device, judge: {sum(judge.values()) / GiB:.1f} GiB with the judge's {judge['judge'] / GiB:.1f} "
                         f"GiB of weights and its {judge['judge kv cache'] / GiB:.1f} GiB KV cache")
        if self.vision:
            lines.append("  " + self.vision)
        if self.host:
            lines.append("  host: " + ", ".join(f"{n} {v / GiB:.1f}" for n, v in self.host.items()) + " GiB")
        return "\n".join(lines)


def _config_value(name: str, value: Any) -> Any:
    """How a setting reads in the config (free_cache_engine is the negation of keeping the memory)."""
    if name == "keep_rollout_memory":
        return not value
    if name == "kv_cache_gib" and not value:
        return "all seqs"
    return value


def plan_memory(shape: ModelShape, run: RunShape, given: dict[str, Any], gpu_bytes: float,
                host_bytes: float, forced: frozenset[str] = frozenset()) -> MemoryPlan:
    """The fastest settings that fit; ``given`` holds the settings a user set (by ``Settings`` field name).

    Every combination of the ``auto`` settings' values is estimated (a few thousand sums) and the one
    with the smallest cost that fits wins; on a tie, the larger micro-batch.
    """
    best, closest = _search(shape, run, given, gpu_bytes, host_bytes)
    if best is not None:
        return dataclasses.replace(best, forced=forced, model=model_line(shape, run))
    raise MemoryPlanError(_refusal(shape, run, closest, given, gpu_bytes, host_bytes, forced))


def _search(shape: ModelShape, run: RunShape, given: dict[str, Any], gpu_bytes: float,
            host_bytes: float) -> tuple[MemoryPlan | None, MemoryPlan]:
    """(the cheapest plan that fits or None, the smallest plan tried)."""
    options = _options(shape, run, lora=bool(run.lora_rank))
    choices = {name: ([(given[name], 0.0)] if name in given else values) for name, values in options.items()}
    if given.get("keep_gathered") is True:  # kept as set: no plan streams the parameters instead
        choices["param_offload"] = [(False, 0.0)]
    return cheapest_plan(choices, lambda values: _make(shape, run, Settings(**values), given, gpu_bytes, host_bytes),
                         lambda plan: plan.peak[1] / max(plan.gpu_budget, 1) + plan.host_total / max(plan.host_budget, 1))


def _make(shape: ModelShape, run: RunShape, settings: Settings, given: dict[str, Any], gpu_bytes: float,
          host_bytes: float) -> MemoryPlan:
    if settings.param_offload:  # streamed parameters are gathered for each use (``engine.train_step``)
        settings = dataclasses.replace(settings, keep_gathered=False)
    phases, host = estimate(shape, run, settings, gpu_bytes)
    return MemoryPlan(dataclasses.replace(settings), set(given), phases, host, gpu_bytes * HEADROOM,
                      host_bytes * HEADROOM, vision_line(shape, run), run.kv_cache_fraction)


def model_line(shape: ModelShape, run: RunShape) -> str:
    """The plan's line on the model: its parameters (of a mixture of experts, those a token runs through too) and
    what trains: every parameter, or LoRA adapters on the targeted projections it has (a vision tower:
    ``vision_line``)."""
    active = f" ({shape.num_active_params / 1e9:.2f}B active a token)" if shape.num_experts else ""
    adapted = [name for name in run.lora_targets if lora_params(shape, run.lora_rank, (name,))]  # those it has
    trained = (f"LoRA adapters of rank {run.lora_rank} on {', '.join(adapted)} "
               f"({lora_params(shape, run.lora_rank, run.lora_targets) / 1e6:.1f}M parameters) train, the base is "
               "frozen" if run.lora_rank else "every parameter trains")
    return f"model: {shape.num_params / 1e9:.2f}B parameters{active}; {trained}"


def vision_line(shape: ModelShape, run: RunShape) -> str:
    """The plan's line on a vision tower ("" for a text model): its size, whether it trains, the patches counted."""
    tower = shape.vision
    if tower is None:
        return (f"multimodal wrapper: {shape.wrapper_params / 1e9:.2f}B parameters beside the language model (its "
                "vision tower and projector), loaded and frozen; prompts are text" if shape.wrapper_params else "")
    state = "trained" if run.train_vision and not run.lora_rank else "frozen"
    bound = "data.max_image_tokens" if run.image_tokens < run.prompt_length else \
        "every prompt token; data.max_image_tokens counts fewer"
    return (f"vision tower: {tower.num_params / 1e9:.2f}B parameters, {state} (actor.freeze_vision_tower), up to "
            f"{tower.patches(run.image_tokens)} patches a prompt ({run.image_tokens} image tokens of "
            f"{tower.merge_size ** 2} patches, {bound})")


def _refusal(shape: ModelShape, run: RunShape, plan: MemoryPlan, given: dict[str, Any], gpu_bytes: float,
             host_bytes: float, forced: frozenset[str] = frozenset()) -> str:
    phase, peak = plan.peak
    if peak > plan.gpu_budget:
        where = (f"needs {peak / GiB:.1f} GiB per device at its {phase} peak but {plan.gpu_budget / GiB:.1f} GiB "
                 f"are usable ({plan.largest_consumers()})")
    else:
        host_items = ", ".join(f"{n} {v / GiB:.1f} GiB" for n, v in sorted(plan.host.items(), key=lambda i: -i[1])[:3])
        where = (f"needs {plan.host_total / GiB:.1f} GiB of host memory but {plan.host_budget / GiB:.1f} GiB are "
                 f"usable ({host_items})")
    fixes = []
    user_set = [name for name in given if name not in forced]
    if user_set and _fits(shape, run, {name: given[name] for name in forced}, gpu_bytes, host_bytes):
        fixes.append(", ".join(f"{SETTING_KEYS[name]}=auto" for name in user_set))
    if not fixes:
        options = [("model.lora.rank=32", dataclasses.replace(run, lora_rank=32)),
                   (f"data.max_response_length={run.response_length // 2}",
                    dataclasses.replace(run, response_length=run.response_length // 2)),
                   (f"data.train_batch_size={max(run.prompts // 2, 1)}",
                    dataclasses.replace(run, prompts=max(run.prompts // 2, 1))),
                   (f"{run.num_devices * 2} devices (trainer.devices_per_node)",
                    dataclasses.replace(run, num_devices=run.num_devices * 2, devices_per_host=run.devices_per_host * 2))]
        if run.rollout_weights_on_host:  # a sync after every update: the rollout's weights are the trainer's
            options.insert(0, ("trainer.trigger_sync_steps=1 (no copy of the rollout's weights on the host)",
                               dataclasses.replace(run, rollout_weights_on_host=False)))
        if run.critic and not run.critic_offload:  # the critic's state is no planned setting: the user's to move
            options.insert(0, ("critic.optimizer_offload=true", dataclasses.replace(run, critic_offload="optimizer")))
        # half the KV bytes (docs/long_responses.md), where the native engine keeps the cache
        if run.kv_cache_dtype == "auto" and run.native_engine and run.fp8_kv_cache_runs and not shape.kv_lora_rank:
            options.insert(1, ("rollout.kv_cache_dtype=fp8", dataclasses.replace(run, kv_cache_dtype="fp8")))
        if run.kv_cache_fraction:  # the engine's cache fills the device whatever its size
            options.insert(0, ("rollout.gpu_memory_utilization=null (the planner sizes the KV cache)",
                               dataclasses.replace(run, kv_cache_fraction=0.0)))
        fixes = [text for text, option in options if option != run and _fits(shape, option, given, gpu_bytes, host_bytes)]
        if run.native_engine and not run.kv_cache_fraction and "kv_cache_gib" not in given:
            smaller = _smaller_kv_cache(shape, run, given, gpu_bytes, host_bytes)
            if smaller:  # after the fp8 cache, which keeps every sequence running at once
                fixes.insert(1 if fixes else 0, smaller)
        roomy = _search(shape, run, given, gpu_bytes, 64 * max(host_bytes, GiB))[0]
        if roomy is not None and roomy.host_total > host_bytes * HEADROOM:  # it fits on this device with more host memory
            fixes.insert(0, f"{-(-roomy.host_total // (HEADROOM * GiB)):.0f} GiB of host memory")
    advice = " or ".join(fixes[:3]) if fixes else "a larger device or a smaller model"
    return f"the run does not fit: it {where}; it would fit with {advice}"


def _smaller_kv_cache(shape: ModelShape, run: RunShape, given: dict[str, Any], gpu_bytes: float,
                      host_bytes: float) -> str | None:
    """A rollout.kv_cache_gib below the plan's own choices (an eighth of the step's sequences at full length, at
    least) with which the run fits, as a refusal's fix: the largest such cache that holds one sequence; None if none."""
    concurrency = rollout_concurrency(run.sequences, run.num_devices)
    factor = 16
    while factor <= concurrency:
        size = math.ceil(needed_kv_gib(shape, run, factor) * 100) / 100
        if _fits(shape, run, {**given, "kv_cache_gib": size}, gpu_bytes, host_bytes):
            return f"rollout.kv_cache_gib={size:g} (1/{factor} of a step's sequences at once)"
        factor *= 2
    return None


def _fits(shape: ModelShape, run: RunShape, given: dict[str, Any], gpu_bytes: float, host_bytes: float) -> bool:
    return _search(shape, run, given, gpu_bytes, host_bytes)[0] is not None


def reward_model_params(shape: ModelShape) -> int:
    """Parameters of a classification model of these sizes: the decoder (a mixture of experts' dense layers as
    dense), its embeddings and final norm, and a one-output head in place of the vocabulary's."""
    untied_head = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
    return shape.num_params - untied_head + shape.hidden_size


def reward_phase(run: RunShape, settings: Settings, held: dict[str, float]) -> dict[str, float]:
    """The reward model's scoring call: what stays allocated (``held``), its weights on the device, the gathered
    parameters of its root and two layers, and one layer's activations for its largest micro-batch (no grad:
    nothing is kept for a backward)."""
    shape, dtype_bytes = run.reward_model, run.dtype_bytes
    assert shape is not None
    phase = dict(held)
    phase["reward model"] = dtype_bytes * reward_model_params(shape) / run.num_devices
    phase["reward model gathered parameters"] = dtype_bytes * (shape.vocab_size * shape.hidden_size
                                                               + 2 * shape.layer_params)
    budget = run.reward_model_tokens or settings.micro_batch_tokens
    _, tokens = micro_batch_split(dataclasses.replace(run, num_mini_batches=1), budget)
    kv_width = 2 * shape.num_kv_heads * shape.head_dim
    per_token = dtype_bytes * (6 * shape.hidden_size + kv_width + 3 * shape.active_intermediate_size)
    phase["reward model activations"] = tokens * per_token * (EAGER_ACTIVATION_FACTOR if run.eager else 1.0)
    return phase


def critic_phase(shape: ModelShape, run: RunShape, settings: Settings, held: dict[str, float]) -> dict[str, float]:
    """The critic's update: what stays allocated (``held``, the critic's own state among it), the gathered parameters
    of its root and two layers, and the activations of its largest micro-batch, of its own model's widths (the
    policy's, or critic.model_path's), every layer recomputed where the actor recomputes any
    (model.gradient_checkpointing reaches the critic as true or false), and no logits."""
    critic, dtype_bytes = run.critic_model or shape, run.dtype_bytes
    phase = dict(held)
    phase["critic gathered parameters"] = dtype_bytes * (critic.vocab_size * critic.hidden_size + critic.hidden_size
                                                         + 2 * critic.layer_params)
    _, tokens = micro_batch_split(run, run.critic_tokens or settings.micro_batch_tokens)
    recomputed = critic.num_layers if settings.checkpoint_layers else 0
    per_layer = critic.activation_bytes_per_token(dtype_bytes, run.eager)
    phase["critic activations"] = tokens * ((critic.num_layers - recomputed) * per_layer
                                            + recomputed * critic.hidden_size * dtype_bytes
                                            + (per_layer if recomputed else 0) + 4 * critic.hidden_size * dtype_bytes)
    return phase


def judge_phase(run: RunShape, kv_cache: float, held: dict[str, float]) -> dict[str, float]:
    """The judge's generation: what stays allocated (``held``, the judge's weights among it), its engine's weight
    copy, its KV cache of ``kv_cache`` bytes and the engine's activations for its own sizes."""
    shape, dtype_bytes = run.judge, run.dtype_bytes
    assert shape is not None
    phase = dict(held)
    phase["judge weight copy"] = dtype_bytes * shape.num_params
    phase["judge kv cache"] = kv_cache
    phase["judge activations"] = (ENGINE_MAX_BATCHED_TOKENS * (4 * shape.intermediate_size + 8 * shape.hidden_size)
                                  * dtype_bytes + ENGINE_MAX_NUM_SEQS * shape.vocab_size * 16 + (256 << 20))
    return phase
