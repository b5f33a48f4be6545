"""What the engine does to a transformers model's modules for training passes on CUDA.

Over a packed micro-batch the matrix products of a 0.5B model run near the GPU's peak, and
what is left is elementwise work that eager PyTorch does one pass per op.

- ``fuse_elementwise`` swaps the ``forward`` of each RMSNorm and gated MLP for the same math
  written as one function, which ``torch.compile`` turns into one kernel each way: the three
  norm kinds of ``models.architectures`` (Llama: float32 statistics, cast back, then the weight;
  Gemma: ``* (1 + w)`` in float32, cast after; OLMo: ``* w`` in float32, cast after) and the
  gated MLP with SiLU or tanh-GELU, separate gate/up projections or Phi-3's fused ``gate_up_proj``.
  The numerics match the transformers modules up to the order of a reduction.
- ``compile_decoder_layers`` compiles each decoder layer's forward for packed passes, so residual adds, rotary embedding and casts fuse too.
- ``use_packed_attention_layout`` keeps q, k and v in the flash kernel's (tokens, heads, dim)
  layout and applies the rotary embedding with one opaque op (``engine.rotary``: a Triton
  kernel on CUDA, read and written once), which the compiled layer calls instead of inductor's
  kernels for transformers' expression. It reads the table: separate or fused qkv, head or
  projection qk-norm, partial rotary (only the first dims rotate), NoPE layers (none do), each
  layer's window and the attention soft-cap. DeepSeek's MLA keeps transformers' attention
  forward, with the varlen attention under it.

What is swapped is decided by the model's ``ArchitectureSpec`` (``models.architectures``), and
only modules of the model's own transformers module are touched (an RMSNorm of another
family inside it keeps its forward). A model the table does not know still trains, on every
device: transformers' own modules with the varlen attention, decoder layers compiled where
transformers marks the model compilable. ``describe_training_path`` is the one line a run
prints about it. Without ``compile`` the swapped forwards run eagerly, which is how the CPU
tests check them against the originals.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reinforge.engine.attention import packed_attention, use_varlen_attention
from reinforge.engine.rotary import apply_rotary
from reinforge.models.architectures import ArchitectureSpec, architecture_spec, runs_code_it_ships
from reinforge.models.head_probe import final_softcap
from reinforge.models.loading import checkpointing_enabled
from reinforge.models.vision import (
    is_vision_language,
    keep_vision_tower_attention,
    language_model_spec,
    use_batched_vision_attention,
)

logger = logging.getLogger(__name__)


def model_spec(model: nn.Module) -> ArchitectureSpec | None:
    """The architecture table of ``model`` (a causal LM or its backbone), None for a family outside it and for a
    model that runs code its folder ships (the table describes transformers' modules of the family)."""
    config = getattr(model, "config", None)
    if runs_code_it_ships(model):
        return None
    if is_vision_language(config):  # the language model's family; the vision tower keeps transformers' modules
        return language_model_spec(config)
    return architecture_spec(config) if config is not None else None


def _own_module(model: nn.Module) -> str:
    """The transformers module that defines the model's classes, e.g. transformers.models.qwen2.modeling_qwen2."""
    return type(model).__module__


def rms_norm(hidden: Tensor, weight: Tensor, eps: float) -> Tensor:
    normed = hidden.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(hidden.dtype)


def gemma_rms_norm(hidden: Tensor, weight: Tensor, eps: float) -> Tensor:
    normed = hidden.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(hidden.dtype)


def olmo_rms_norm(hidden: Tensor, weight: Tensor, eps: float) -> Tensor:
    normed = hidden.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed).to(hidden.dtype)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def gelu_tanh_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.gelu(gate, approximate="tanh") * up


NORMS = {"llama": rms_norm, "gemma": gemma_rms_norm, "olmo": olmo_rms_norm}
GATES = {"silu": silu_mul, "gelu_tanh": gelu_tanh_mul}
ACTIVATION_CLASSES = {"silu": ("SiLU", "SiLUActivation"), "gelu_tanh": ("GELUTanh", "PytorchGELUTanh")}
"""Names of transformers' activation modules of each gate, as ``ACT2FN`` builds them."""


RECOMPILE_LIMIT = 128
"""Each (grad mode, train or eval mode, dtype, epsilon, device) a function meets is one compiled variant:
a process that trains, runs forward-only rows in training mode (``actor.skip_zero_advantage_backward``),
scores without grad and runs a reference or critic model of another config needs more than dynamo's
default of 8, after which it would silently fall back to eager."""


def configure_compiler() -> None:
    """Dynamo settings for the compiled functions and layers: the recompile limit above, and no duck sizing.

    Duck sizing takes two sizes that are equal when a graph is first traced for one symbol. A packed
    micro-batch's ``packed_kv_index`` of exactly ``hidden_size`` entries (1536 in the 1.5B bench's first
    update micro-batch) would be taken for the hidden size, which the weights fix, and the graph would guard on
    it: the next micro-batch would recompile every decoder layer, 3 s of one step. Without duck sizing nothing
    recompiles (``tests/engine/test_recompiles.py`` checks it on a small model, that case included).
    """
    import torch._dynamo
    import torch.fx.experimental._config

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    torch.fx.experimental._config.use_duck_shape = False


@functools.cache
def _compiled(function, compiled: bool):
    if not compiled:
        return function
    configure_compiler()
    return torch.compile(function, dynamic=True)


def _norm_forward(self: nn.Module, hidden: Tensor) -> Tensor:
    return self._fused_rms_norm(hidden, self.weight, self._fused_eps)


def _mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    return self.down_proj(self._fused_gate(self.gate_proj(x), self.up_proj(x)))


def _fused_gate_up_forward(self: nn.Module, x: Tensor) -> Tensor:
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(self._fused_gate(gate, up))


def _plain_linears(module: nn.Module, *names: str) -> bool:
    """Whether these projections are plain ``nn.Linear`` (an adapter-wrapped one keeps the module's own forward)."""
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in names)


def _activation_is(module: nn.Module, activation: str) -> bool:
    act = getattr(module, "act_fn", None) or getattr(module, "activation_fn", None)
    return type(act).__name__ in ACTIVATION_CLASSES.get(activation, ())


def _norm_epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def fuse_elementwise(model: nn.Module, compile: bool = True) -> int:
    """Swap the forward of every RMSNorm and gated MLP of the model's own family; returns how many (0 outside the table)."""
    spec = model_spec(model)
    if spec is None:
        return 0
    own = _own_module(model)
    norm_fn = _compiled(NORMS[spec.norm], compile)
    gate_fn = _compiled(GATES[spec.activation], compile) if spec.activation in GATES else None
    count = 0
    for module in model.modules():
        if type(module).__module__ != own:
            continue
        name = type(module).__name__
        if (name.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), nn.Parameter)
                and _norm_epsilon(module) is not None):
            module._fused_rms_norm, module._fused_eps = norm_fn, _norm_epsilon(module)
            module.forward = types.MethodType(_norm_forward, module)
            count += 1
        elif gate_fn is not None and _activation_is(module, spec.activation):
            if _plain_linears(module, "gate_proj", "up_proj", "down_proj"):
                module._fused_gate = gate_fn
                module.forward = types.MethodType(_mlp_forward, module)
                count += 1
            elif spec.fused_gate_up and _plain_linears(module, "gate_up_proj", "down_proj"):
                module._fused_gate = gate_fn
                module.forward = types.MethodType(_fused_gate_up_forward, module)
                count += 1
    return count


def _project_qkv(self: nn.Module, hidden_states: Tensor, tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """q (tokens, heads, d), k and v (tokens, kv_heads, d), qk-normed as the family does it."""
    spec: ArchitectureSpec = self._spec
    d = spec.head_dim
    if spec.fused_qkv:  # Phi-3: rows [q | k | v]
        qkv = self.qkv_proj(hidden_states)
        q_size = self.config.num_attention_heads * d
        kv_size = self.config.num_key_value_heads * d
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    else:
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
    if spec.qk_norm == "projection":  # OLMo 2: over the whole projection, before the heads split
        q, k = self.q_norm(q), self.k_norm(k)
    if spec.clip_qkv is not None:  # OLMoE: after the projection norms, as transformers clamps them
        q, k, v = (tensor.clamp(-spec.clip_qkv, spec.clip_qkv) for tensor in (q, k, v))
    q, k, v = (tensor.reshape(tokens, -1, d) for tensor in (q, k, v))
    if spec.qk_norm == "head":  # Qwen3, Gemma 3: each head, before the rotary embedding
        q, k = self.q_norm(q), self.k_norm(k)
    return q, k, v


def _packed_attention_forward(self: nn.Module, hidden_states: Tensor, position_embeddings=None, attention_mask=None,
                              **kwargs):
    """Attention of a packed row in the flash kernel's (tokens, heads, dim) layout, else the module's own forward.

    transformers transposes q, k and v to (1, heads, tokens, dim) before the rotary embedding,
    and the packed path transposes them back; here they stay as the projections leave them.
    """
    if kwargs.get("packed_cu_seqlens") is None:
        return self._transformers_forward(hidden_states, position_embeddings=position_embeddings,
                                          attention_mask=attention_mask, **kwargs)
    spec: ArchitectureSpec = self._spec
    tokens = hidden_states.shape[1]
    q, k, v = _project_qkv(self, hidden_states, tokens)
    if self._layer_rope:
        cos, sin = (table[0] for table in position_embeddings)  # (tokens, rotary dim)
        rotary_dim = cos.shape[-1]
        if rotary_dim == q.shape[-1]:
            q, k = apply_rotary(q, k, cos, sin)
        else:  # partial rotary: the first rotary_dim dims rotate, the rest pass through
            q_rot, k_rot = apply_rotary(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)
            q = torch.cat((q_rot, q[..., rotary_dim:]), dim=-1)
            k = torch.cat((k_rot, k[..., rotary_dim:]), dim=-1)
    out = packed_attention(q, k, v, self.scaling, kwargs, window=self._layer_window, softcap=spec.attn_softcap)
    return self.o_proj(out.reshape(1, tokens, -1)), None


def use_packed_attention_layout(model: nn.Module) -> int:
    """Swap the forward of every attention module of the model's own family; returns how many (0 outside the table
    and for MLA, whose attention keeps transformers' forward)."""
    spec = model_spec(model)
    if spec is None or spec.mla is not None:
        return 0
    own = _own_module(model)
    projections = ("qkv_proj", "o_proj") if spec.fused_qkv else ("q_proj", "k_proj", "v_proj", "o_proj")
    count = 0
    for module in model.modules():
        if (type(module).__module__ == own and type(module).__name__.endswith("Attention")
                and isinstance(getattr(module, "layer_idx", None), int) and _plain_linears(module, *projections)):
            module._spec = spec
            # the layer's own differences as plain values: the compiled layers guard on these, equal from layer to
            # layer, so layers alike share one graph (indexing the table by ``layer_idx`` guarded on the index:
            # one compilation per layer)
            layer = spec.layers[module.layer_idx]
            module._layer_rope, module._layer_window = layer.rope != "none", layer.sliding_window
            module._transformers_forward = module.forward
            module.forward = types.MethodType(_packed_attention_forward, module)
            count += 1
    return count


def compile_decoder_layers(model: nn.Module, backend: str = "inductor") -> int:
    """``torch.compile`` the forward of each decoder layer for packed passes; returns how many.

    One compiled graph then covers a whole layer (norms, rotary embedding, residual adds, the
    casts between them) instead of only the norm and MLP pieces. Only packed passes (those
    carrying ``packed_cu_seqlens``) take the compiled forward; generation with a KV cache keeps
    the eager one. FSDP's hooks stay outside: they run around ``forward``, which is what is
    swapped. Must run before ``shard_model``, on a model without activation checkpointing.
    """
    from reinforge.engine.fsdp import decoder_layers

    configure_compiler()
    layers = decoder_layers(model)
    for layer in layers:
        eager = layer.forward
        compiled = torch.compile(eager, backend=backend, dynamic=True)

        def forward(*args, _eager=eager, _compiled=compiled, **kwargs):
            return (_compiled if kwargs.get("packed_cu_seqlens") is not None else _eager)(*args, **kwargs)

        layer.forward = forward
    return len(layers)


def _compilable(model: nn.Module) -> bool:
    """Whether a family outside the table gets compiled decoder layers: transformers marks the model compilable and
    its decoder layers are found."""
    from reinforge.engine.fsdp import decoder_layers

    if not getattr(model, "_can_compile_fullgraph", False):
        return False
    try:
        decoder_layers(model)
    except ValueError:
        return False
    return True


def describe_training_path(model: nn.Module, device: torch.device) -> str:
    """The one line a run prints about its packed training passes: the path, why, and what it costs."""
    spec = model_spec(model)
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    from reinforge.engine.forward import PACKS_ROWS

    if getattr(model, PACKS_ROWS, True) is False:
        compiled = ("decoder layers compiled" if device.type == "cuda" and _compilable(model)
                    else "decoder layers eager")
        from reinforge.engine.attention import NAME, OWN_ATTENTION_WHY

        own = getattr(getattr(model, "config", None), "_attn_implementation", NAME)
        why = (f"it keeps its own {own} attention ({getattr(model, OWN_ATTENTION_WHY, 'as transformers loads it')})"
               if own != NAME else "its layers cannot keep packed sequences apart (its attention does not take "
               "reinforge's varlen arguments, or state runs along the row)")
        return (f"training passes of {model_type}: transformers modules for {model_type} over padded rows, not packed "
                f"ones: {why}; no fused kernels, {compiled}, expect ~2-3x slower updates than a family of the table "
                "(padding is computed, prompts are not shared)")
    if device.type != "cuda":
        if spec is None:  # the path it takes on CUDA too: say why
            return (f"packed training of {model_type}: transformers modules for {model_type} with reinforge's varlen "
                    f"attention ({_outside_table_why(model, model_type)}: no fused kernels on CUDA either, expect "
                    f"~1.5-2x slower updates there than a family of the table; on {device.type} every family runs "
                    "exact and unfused)")
        return (f"packed training of {model_type}: transformers' modules with reinforge's varlen attention "
                f"(the fused kernels run on CUDA only; on {device.type} the modules are exact and unfused)")
    if spec is not None:
        if spec.mla is not None:
            attention = "transformers' MLA projections over flash varlen attention"
        elif spec.attn_softcap is not None:
            attention = "soft-capped Triton attention in the packed layout"
        else:
            attention = "flash varlen attention in the packed layout"
        windows = ", sliding windows in the kernel" if spec.windowed else ""
        tower = ("; the vision tower in transformers' modules, once per step over the batch's images when frozen, "
                 "else once per micro-batch over its images"
                 if is_vision_language(model.config) else "")
        return (f"packed training of {model_type}: fast path for {spec.model_type} (fused norms and MLP, "
                f"{attention}{windows}, compiled decoder layers){tower}")
    compiled = "decoder layers compiled" if _compilable(model) else "decoder layers eager"
    return (f"packed training of {model_type}: transformers modules for {model_type}: no fused kernels "
            f"({_outside_table_why(model, model_type)}), {compiled}, expect ~1.5-2x slower updates than a family of "
            "the table; the varlen attention keeps it exact")


def _outside_table_why(model: nn.Module, model_type: str) -> str:
    """Why ``model`` trains through transformers' modules rather than the table's fast path."""
    if runs_code_it_ships(model):
        return (f"its code ships with the model (model.trust_remote_code), not transformers' {model_type} modules "
                "reinforge.models.architectures describes")
    return f"{model_type} is not in reinforge.models.architectures"


_DESCRIBED: set[tuple[str, str]] = set()


def _say_once(model: nn.Module, device: torch.device) -> None:
    line = describe_training_path(model, device)
    if (line, device.type) in _DESCRIBED:
        return
    _DESCRIBED.add((line, device.type))
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank():
        return
    (logger.info if model_spec(model) is not None or device.type != "cuda" else logger.warning)("%s", line)


PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
"""Largest log-prob gap between a sequence packed beside another and the same sequence alone (others: 0.1)."""
LEAK_FRACTION = 0.01
"""In float32 and float64, a leak of one packed sequence into the next counts from this fraction of
``PROBE_TOLERANCE``: the shapes are unchanged, so only a leak moves the numbers."""


@torch.no_grad()
def check_packed_sequences_stay_apart(model: nn.Module) -> None:
    """For a family outside the table: two sequences in one packed row give the log-probs of each alone.

    Any causal LM runs through transformers' modules with the varlen attention, which keeps packed
    sequences apart. A model whose attention does not take packed rows runs padded rows
    (``engine.forward.packs_rows``). One that still mixes packed sequences (recurrent or linear-attention layers
    beside its attention, attention limited only by its masks) runs padded rows too, from here on; a model that
    fails even padded is refused here, in one line, before any step, as is one whose forward fails in training mode
    only. About a dozen forwards of a few tokens, then three greedy tokens from ``generate``, whose log-probs the
    training passes must give: a model whose generate prepares other inputs than its forward reads (XLM appends a
    mask token and predicts it) is refused too.
    """
    from reinforge.engine.forward import (
        OWN_LOGITS,
        PACKS_ROWS,
        build_position_ids,
        own_logits_log_probs,
        packs_rows,
        response_log_probs,
    )
    from reinforge.protocol import Batch

    model_type = getattr(model.config, "model_type", type(model).__name__)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    high = min(int(getattr(model.get_output_embeddings(), "out_features", 64) or 64), 100)
    prompts = torch.randint(3, high, (2, 4), generator=generator)
    responses = torch.randint(3, high, (2, 5), generator=generator)

    def probe_batch(responses: torch.Tensor, prompts: torch.Tensor = prompts) -> Batch:
        attention_mask = torch.ones(2, prompts.shape[1] + responses.shape[1], dtype=torch.long)
        return Batch.from_dict(tensors={
            "prompts": prompts, "responses": responses, "response_mask": torch.ones(responses.shape),
            "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
            "position_ids": build_position_ids(attention_mask)}).to(device)

    batch = probe_batch(responses)
    flipped = torch.tensor([True, False])[:, None]  # the first sequence's tokens reversed, the second's kept
    other_first = probe_batch(torch.where(flipped, responses.flip(1), responses),
                              torch.where(flipped, prompts.flip(1), prompts))
    # the same with prompts of one token: the second sequence's responses right after the boundary, where a causal
    # convolution carries the tokens before it (Zamba's Mamba layers: 3 tokens), past which nothing of it is left
    at_boundary = [probe_batch(rows, prompts[:, -1:]) for rows in (
        responses, torch.where(flipped, responses.flip(1), responses))]
    tolerance = PROBE_TOLERANCE.get(next(model.parameters()).dtype, 0.1)
    # in float32 the same shapes give the same numbers to well within LEAK_FRACTION of the tolerance; in 16-bit
    # types a mixture of experts can take other kernels for the other first sequence's token counts per expert
    leak_tolerance = tolerance * (LEAK_FRACTION if next(model.parameters()).dtype in PROBE_TOLERANCE else 1.0)
    was_training = model.training
    model.eval()
    gap, failure, future_gap = float("inf"), None, 0.0
    try:
        _keep_own_attention_where_varlen_differs(model, model_type, torch.cat([prompts, responses], 1), tolerance)
        for _ in range(2):  # packed rows, then (if they mix or fail) padded ones
            padded = not packs_rows(model)
            try:
                packed = response_log_probs(model, batch)[0].float()
                alone = torch.cat([response_log_probs(model, batch.index([row]))[0].float() for row in range(2)])
                # packed: the second sequence after another first one of the same lengths. The same shapes, the same
                # kernels, so any change is the first sequence leaking into it (a recurrent or convolution state
                # carried across the packed row), however small next to the rounding between different shapes
                leak = 0.0 if padded else max(
                    float((response_log_probs(model, other_first)[0].float()[1] - packed[1]).abs().max()),
                    float((response_log_probs(model, at_boundary[0])[0].float()[1]
                           - response_log_probs(model, at_boundary[1])[0].float()[1]).abs().max()))
            except Exception as error:
                if padded:  # the decoder's last hidden state through lm_head fails even over padded rows
                    failure = error
                    break
                # its layers do not take a packed row at all (a recurrent mixer that reads the attention mask
                # as padding): padded rows from here on
                setattr(model, PACKS_ROWS, False)
                continue
            gap = float((packed - alone).abs().max())
            if leak > leak_tolerance:
                gap = max(gap, leak * tolerance / leak_tolerance)  # mixed: padded rows (a padded leak is refused)
            if gap <= tolerance or padded:
                break
            setattr(model, PACKS_ROWS, False)  # its packed sequences mix: padded rows from here on
        if failure is not None or gap <= tolerance:
            # the log-probs come from the decoder's last hidden state through lm_head and the head's known transforms
            # (engine.forward.logit_transform); a head that does more would train on other probabilities than it
            # samples, and one that reshapes the hidden state first (Electra's generator head) fails there
            try:
                own = torch.cat([own_logits_log_probs(model, batch.index([row]), 1.0, False, False)[0].float()
                                 for row in range(2)])
                if failure is not None:
                    alone = own
                    gap = float((own_logits_log_probs(model, batch, 1.0, False, False)[0].float() - own).abs().max())
                # a causal LM's log-prob of a token does not move with the tokens after it (generate never sees them)
                early = own_logits_log_probs(model, probe_batch(responses[:, :2]).index([0]), 1.0, False, False)[0]
                future_gap = float((early.float() - own[:1, :2]).abs().max())
            except Exception as error:
                raise ValueError(_own_forward_fails(model, model_type, device, error)) from error
    finally:
        model.train(was_training)
    if gap > tolerance:
        raise ValueError(f"{type(model).__name__} (model_type={model_type!r}) mixes the rows of a batch (log-probs "
                         f"move by {gap:.3g} beside another sequence, even in padded rows); reinforge cannot train it")
    if future_gap > tolerance:
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        switches = {name: True for name in ("causal", "is_causal", "is_decoder")
                    if getattr(model.config, name, None) is False}  # a causal switch the config has, off
        switches |= {name: False for name in ("use_bidirectional_attention",) if getattr(text, name, None)}
        # advised only where the model, switched so, reads no token after a position and generates from the
        # probabilities its forward gives (XLM made causal still predicts a mask token its generate appends)
        advised = switches and _switched_model_passes(model, switches, lambda: _reads_ahead(
            model, probe_batch(responses).index([0]), probe_batch(responses[:, :2]).index([0])) <= tolerance and (
            (_generate_gap(model, prompts[:1].to(device), probe_batch) or 0.0) <= tolerance))
        settings = " and ".join(f"{name}={str(value).lower()}" for name, value in switches.items())
        fix = f"set {settings} in its config.json or use a causal LM" if advised else "use a causal LM"
        raise ValueError(f"{type(model).__name__} (model_type={model_type!r}, from model.path's config.json) reads the "
                         f"tokens after each position (a token's log-prob moves by {future_gap:.3g} with what follows "
                         f"it), so it is no causal LM and would train on other probabilities than it samples; {fix}")
    head_gap = float((own - alone).abs().max())
    if failure is not None or head_gap > tolerance:  # training would follow other probabilities than the model samples
        setattr(model, OWN_LOGITS, True)
        setattr(model, PACKS_ROWS, False)
        how = (f"its last hidden state through lm_head fails ({_first_line(failure)})" if failure is not None
               else f"log-probs {head_gap:.3g} from the model's own")
        logger.warning("%s (model_type=%r) computes its logits beyond lm_head in a way reinforge does not reproduce "
                       "(%s): its training passes read the logits its own forward returns, over padded rows, every "
                       "vocabulary entry at once (more memory, slower)", type(model).__name__, model_type, how)
    training_failure = _training_forward_failure(model, batch)
    if training_failure is not None:
        raise ValueError(_own_forward_fails(model, model_type, device, training_failure, " in training mode")
                         ) from training_failure
    generate_gap = _generate_gap(model, prompts[:1].to(device), probe_batch)
    if generate_gap is not None and generate_gap > tolerance:
        raise ValueError(f"{type(model).__name__} (model_type={model_type!r}, from model.path's config.json) samples in "
                         f"transformers' generate from other probabilities than its forward gives the same tokens "
                         f"(log-probs {generate_gap:.3g} apart: its generate prepares other inputs), so training would "
                         "follow other probabilities than the rollout samples; reinforge cannot train it")


@torch.no_grad()
def _keep_own_attention_where_varlen_differs(model: nn.Module, model_type: str, input_ids: Tensor,
                                             tolerance: float) -> None:
    """A model outside the table whose own forward computes other probabilities through ``reinforge_varlen`` than
    through the attention implementation it was loaded with keeps that one, and runs padded rows.

    The varlen implementation runs a call without packed rows as transformers' SDPA does, with SDPA-style masks
    (a purely causal one left out). A few causal LMs are not written for that: transformers runs them with eager
    attention only (``_supports_sdpa = False``), and their modules rely on the mask alone, or on eager's handling of
    the arguments they pass (Inkling 2's position biases and sinks). One forward of two rows, one left-padded,
    through each implementation: where the log-probs differ, the model's own attention serves every pass. So it does
    where the model hands the attention the keys an indexer selected (DeepSeek V3.2, GLM-5): their selection keeps
    every key of a sequence shorter than its top-k (2,048 keys), as the probe's are, so only the call says it.
    """
    from reinforge.engine.attention import NAME, OWN_ATTENTION, OWN_ATTENTION_WHY, watch_attention_calls
    from reinforge.engine.forward import PACKS_ROWS, build_position_ids

    own = getattr(model, OWN_ATTENTION, None)
    if own is None or own == NAME or getattr(model.config, "_attn_implementation", None) != NAME:
        return
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
              "position_ids": build_position_ids(attention_mask), "use_cache": False}
    valid = attention_mask.bool()

    def log_probs() -> Tensor:
        return model(**inputs).logits.float().log_softmax(-1)[valid]

    try:
        with watch_attention_calls() as calls:
            varlen = log_probs()
        model.set_attn_implementation(own)
        gap = float((log_probs() - varlen).abs().max())
    except Exception:  # noqa: BLE001 (a forward that fails either way: the probes after this one name it)
        model.set_attn_implementation(NAME)
        return
    if gap <= tolerance and not calls.sparse:
        model.set_attn_implementation(NAME)
        return
    if calls.sparse:
        why = "reinforge's varlen attention would attend to every key, not to those its indexer selects"
    else:
        why = f"reinforge's varlen attention computed other probabilities ({gap:.3g} apart)"
    setattr(model, OWN_ATTENTION_WHY, why)
    setattr(model, PACKS_ROWS, False)
    logger.info("%s (model_type=%r): %s; it keeps its own %s attention, over padded rows (slower, more memory)",
                type(model).__name__, model_type, why, own)


def check_final_soft_cap(model: nn.Module) -> None:
    """A family of the table whose composite config (a vision-language model's) names a final soft-cap in its text
    config: whether the model's own forward applies it (``models.head_probe``, its answer kept on the model); the
    log-probs follow the model's own logits."""
    from reinforge.engine.forward import logit_transform

    multiplier, cap = logit_transform(model.config)
    if cap is None or getattr(model, "get_output_embeddings", lambda: None)() is None:
        return
    if final_softcap(model, cap, multiplier) is None:
        logger.info("%s returns its logits without its text config's final_logit_softcapping=%s; training reads "
                    "them uncapped too, as the model samples them", type(model).__name__, cap)


GENERATE_PROBE_TOKENS = 3
"""Tokens the start-up probe has ``generate`` choose greedily, to compare with the training passes' log-probs."""


@torch.no_grad()
def _generate_gap(model: nn.Module, prompt: torch.Tensor, batch_of) -> float | None:
    """Largest gap between the log-probs ``generate`` chose its greedy tokens from (its raw logits, before any
    processor) and the training passes' for the same tokens after ``prompt`` (one row); None where the model has no
    ``generate`` or it fails (the rollout reports that itself)."""
    from reinforge.engine.forward import response_log_probs

    if not callable(getattr(model, "generate", None)):
        return None
    was_training = model.training
    model.eval()
    try:
        output = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                max_new_tokens=GENERATE_PROBE_TOKENS, output_logits=True, return_dict_in_generate=True,
                                pad_token_id=int(prompt[0, 0]))
        tokens = output.sequences[:, prompt.shape[1]:]
        if tokens.shape[1] == 0 or not output.logits:
            return None
        logits = torch.stack(output.logits[:tokens.shape[1]], 1).float()
        sampled = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
        rows = tokens.expand(2, -1).cpu()  # the probe's batch holds two rows; the first is this prompt's
        trained = response_log_probs(model, batch_of(rows).index([0]))[0].float()
        return float((trained - sampled).abs().max())
    except Exception:
        return None
    finally:
        model.train(was_training)


@torch.no_grad()
def _reads_ahead(model: nn.Module, whole: Any, start: Any) -> float:
    """How far a token's log-prob moves with the tokens after it: the model's own log-probs of ``start`` (the first
    response tokens of one probe row) against the same tokens within ``whole`` (the row)."""
    from reinforge.engine.forward import own_logits_log_probs

    early = own_logits_log_probs(model, start, 1.0, False, False)[0].float()
    full = own_logits_log_probs(model, whole, 1.0, False, False)[0].float()
    return float((early - full[:, :early.shape[1]]).abs().max())


def _switched_model_passes(model: nn.Module, switches: dict[str, bool], passes: Callable[[], bool]) -> bool:
    """Whether ``passes()`` holds with the config's ``switches`` set, and the modules' attributes that copied them at
    build time (those of the same names, as XLM's ``causal``, and ``is_causal``); everything is set back after."""
    from reinforge.engine.forward import OWN_LOGITS, PACKS_ROWS

    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    configs = (model.config, text)
    # the training passes read the model's own logits over padded rows, which any head gives exactly
    changed: list[tuple[Any, str, Any]] = [(model, name, getattr(model, name, None)) for name in (OWN_LOGITS, PACKS_ROWS)]
    setattr(model, OWN_LOGITS, True)
    setattr(model, PACKS_ROWS, False)
    was_training = model.training
    model.eval()
    try:
        for owner in [*configs, *model.modules()]:
            # the attention modules' is_causal, which some families derive from the switch when they are built
            is_config = any(owner is config for config in configs)
            for name, value in [*switches.items(), *([] if is_config else [("is_causal", True)])]:
                if isinstance(getattr(owner, name, None), bool) and getattr(owner, name) != value:
                    changed.append((owner, name, getattr(owner, name)))
                    setattr(owner, name, value)
        return bool(passes())
    except Exception:
        return False
    finally:
        for owner, name, value in reversed(changed):
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        model.train(was_training)


def _training_forward_failure(model: nn.Module, batch: Any) -> BaseException | None:
    """The error of the training passes' forward over ``batch`` with the model in training mode (the probes run it in
    eval mode; Reformer's training forward refuses a sequence length that is no multiple of its chunk length), None
    where it runs. Any dropout it draws leaves the random state as it was."""
    from reinforge.engine.forward import response_log_probs

    was_training = model.training
    device = next(model.parameters()).device
    model.train()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            response_log_probs(model, batch)
    except Exception as error:  # noqa: BLE001 (whatever the model's training forward raises is named in the refusal)
        return error
    finally:
        model.train(was_training)
    return None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _own_forward_fails(model: nn.Module, model_type: str, device: torch.device, error: BaseException,
                       mode: str = "") -> str:
    """The one line that refuses a model whose own transformers forward fails over a few padded tokens (``mode``:
    " in training mode" where only that forward fails)."""
    import transformers

    return (f"{type(model).__name__} (model_type={model_type!r}, from model.path's config.json) fails in transformers' "
            f"own forward{mode} on {device.type} ({_first_line(error)}), so reinforge cannot train it; check the config's "
            f"sizes, or use a transformers version (this is {transformers.__version__}) that runs {model_type}")


def prepare_for_training(model: nn.Module, device: torch.device) -> None:
    """Route attention through the packed varlen path and, on CUDA, take the fast path for packed passes.

    What every worker does to the HF model it trains or scores; any causal LM transformers loads
    is accepted. On CUDA, for a family of the table: fused RMSNorm and gated MLP, q/k/v in the
    flash layout with the rotary embedding as one op, and each decoder layer compiled (not with
    activation checkpointing, whose recomputation runs the layer outside the compiled graph); a
    family outside it keeps transformers' modules, compiled where transformers says it can be, once a
    probe shows its packed sequences stay apart (``check_packed_sequences_stay_apart``). On the CPU
    the modules keep transformers' forwards. Logs the path taken once per process.
    """
    use_varlen_attention(model)
    # a MoE config's output_router_logits makes transformers' forward compute its aux loss against an attention mask
    # a packed row does not have (an opaque scatter_add_ error); the actor's RouterRecorder computes it itself
    from reinforge.engine.moe import without_router_logits_output

    without_router_logits_output(model)
    if is_vision_language(getattr(model, "config", None)):
        keep_vision_tower_attention(model)
        use_batched_vision_attention(model)  # one attention call per vision layer, not one per image or window
    spec = model_spec(model)
    output_embeddings = getattr(model, "get_output_embeddings", None)
    if spec is None and callable(output_embeddings) and output_embeddings() is not None:  # a causal LM
        check_packed_sequences_stay_apart(model)
    elif spec is not None:
        check_final_soft_cap(model)
    _say_once(model, device)
    if device.type != "cuda":
        return
    if spec is not None:
        fuse_elementwise(model)
        use_packed_attention_layout(model)
    if not checkpointing_enabled(model) and (spec is not None or _compilable(model)):
        compile_decoder_layers(model)
