"""What the engine does to a transformers model's modules for training passes on CUDA.

Over a packed micro-batch the matrix products of a 0.5B model run near the GPU's peak, and
what is left is elementwise work that eager PyTorch does one pass per op.

- ``fuse_elementwise`` swaps the ``forward`` of RMSNorm (cast to float32, square, mean, rsqrt,
  two products, cast back) and of the gated MLP's ``silu(gate) * up`` for the same math
  written as one function, which ``torch.compile`` turns into one kernel each way. The math is
  the one of the transformers modules it replaces (float32 statistics, the result cast back
  before the weight multiplies it), so the numerics match up to the order of a reduction.
- ``compile_decoder_layers`` compiles each decoder layer's forward for packed passes, so residual adds, rotary embedding and casts fuse too.
- ``use_packed_attention_layout`` keeps q, k and v in the flash kernel's (tokens, heads, dim)
  layout and applies the rotary embedding with one opaque op (``engine.rotary``: a Triton
  kernel on CUDA, read and written once), which the compiled layer calls instead of inductor's
  kernels for transformers' expression.

Each supported architecture has one ``ArchitectureAdapter`` in ``ADAPTERS``, keyed by the HF
config's ``model_type``: the transformers classes of its attention, RMSNorm and gated MLP, whose
forwards are swapped (instances of exactly those classes, nothing found by name). A model of
another architecture is refused with a clear error by ``architecture_adapter``, before any
module is touched. Without ``compile`` the swapped forwards run eagerly, which is how the CPU
tests check them against the originals.
"""

from __future__ import annotations

import functools
import importlib
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reinforge.engine.attention import packed_attention, use_varlen_attention
from reinforge.engine.rotary import apply_rotary


@dataclass(frozen=True)
class ArchitectureAdapter:
    """The modules of one transformers architecture that the fast path replaces (None: kept as they are).

    Names are of classes in ``transformers.models.<model_type>.modeling_<model_type>``.
    """

    rms_norm: str
    """An RMSNorm with ``weight`` and ``variance_epsilon``: float32 statistics, cast back, then the weight."""
    attention: str | None = None
    """Attention with q/k/v/o projections (and Qwen3's q/k norms) taking transformers' rotary tables."""
    gated_mlp: str | None = None
    """down(silu(gate(x)) * up(x))."""

    def classes(self, model_type: str) -> dict[str, type]:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        names = {"rms_norm": self.rms_norm, "attention": self.attention, "gated_mlp": self.gated_mlp}
        return {role: getattr(module, name) for role, name in names.items() if name is not None}


ADAPTERS: dict[str, ArchitectureAdapter] = {
    "qwen2": ArchitectureAdapter("Qwen2RMSNorm", "Qwen2Attention", "Qwen2MLP"),
    "qwen3": ArchitectureAdapter("Qwen3RMSNorm", "Qwen3Attention", "Qwen3MLP"),
    "llama": ArchitectureAdapter("LlamaRMSNorm", "LlamaAttention", "LlamaMLP"),
    "mistral": ArchitectureAdapter("MistralRMSNorm", "MistralAttention", "MistralMLP"),
    "qwen3_moe": ArchitectureAdapter("Qwen3MoeRMSNorm"),
}
"""config.model_type -> its adapter: the architectures reinforge trains."""


def architecture_adapter(model: nn.Module) -> dict[str, type]:
    """The classes to swap in ``model`` (a causal LM or its backbone), by role; raises for an unsupported model."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(f"{type(model).__name__} (model_type={model_type!r}) is not an architecture reinforge's "
                         f"packed training passes support; use a model of type {', '.join(sorted(ADAPTERS))}, or "
                         "add an ArchitectureAdapter for it to reinforge.engine.fused.ADAPTERS")
    return ADAPTERS[model_type].classes(model_type)


def rms_norm(hidden: Tensor, weight: Tensor, eps: float) -> Tensor:
    normed = hidden.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(hidden.dtype)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


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
def _functions(compiled: bool):
    if not compiled:
        return rms_norm, silu_mul
    configure_compiler()
    return torch.compile(rms_norm, dynamic=True), torch.compile(silu_mul, dynamic=True)


def _norm_forward(self: nn.Module, hidden: Tensor) -> Tensor:
    return self._fused_rms_norm(hidden, self.weight, self.variance_epsilon)


def _mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    return self.down_proj(self._fused_silu_mul(self.gate_proj(x), self.up_proj(x)))


def _plain_linears(module: nn.Module, *names: str) -> bool:
    """Whether these projections are plain ``nn.Linear`` (an adapter-wrapped one keeps the module's own forward)."""
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in names)


def _is_silu(module: nn.Module) -> bool:
    return type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")


def fuse_elementwise(model: nn.Module, compile: bool = True) -> int:
    """Swap the forward of every RMSNorm and gated-SiLU MLP of the model's architecture; returns how many."""
    classes = architecture_adapter(model)
    norm_fn, mlp_fn = _functions(compile)
    count = 0
    for module in model.modules():
        if type(module) is classes["rms_norm"]:
            module._fused_rms_norm = norm_fn
            module.forward = types.MethodType(_norm_forward, module)
            count += 1
        elif (type(module) is classes.get("gated_mlp") and _is_silu(module)
              and _plain_linears(module, "gate_proj", "up_proj", "down_proj")):
            module._fused_silu_mul = mlp_fn
            module.forward = types.MethodType(_mlp_forward, module)
            count += 1
    return count


def _packed_attention_forward(self: nn.Module, hidden_states: Tensor, position_embeddings=None, attention_mask=None,
                              **kwargs):
    """Attention of a packed row in the flash kernel's (tokens, heads, dim) layout, else the module's own forward.

    transformers transposes q, k and v to (1, heads, tokens, dim) before the rotary embedding,
    and the packed path transposes them back; here they stay as the projections leave them.
    """
    if kwargs.get("packed_cu_seqlens") is None:
        return self._transformers_forward(hidden_states, position_embeddings=position_embeddings,
                                          attention_mask=attention_mask, **kwargs)
    tokens = hidden_states.shape[1]
    q = self.q_proj(hidden_states).view(tokens, -1, self.head_dim)
    k = self.k_proj(hidden_states).view(tokens, -1, self.head_dim)
    v = self.v_proj(hidden_states).view(tokens, -1, self.head_dim)
    if hasattr(self, "q_norm"):  # Qwen3 normalises each head before the rotary embedding
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = (table[0] for table in position_embeddings)  # (tokens, dim)
    q, k = apply_rotary(q, k, cos, sin)
    out = packed_attention(q, k, v, self.scaling, kwargs)
    return self.o_proj(out.reshape(1, tokens, -1)), None


def use_packed_attention_layout(model: nn.Module) -> int:
    """Swap the forward of every attention module of the model's architecture; returns how many."""
    attention = architecture_adapter(model).get("attention")
    count = 0
    for module in model.modules():
        if type(module) is attention and _plain_linears(module, "q_proj", "k_proj", "v_proj", "o_proj"):
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


def prepare_for_training(model: nn.Module, device: torch.device) -> None:
    """Route attention through the packed varlen path and, on CUDA, take the fast path for packed passes.

    What every worker does to the HF model it trains or scores. On CUDA: fused RMSNorm and
    gated MLP, q/k/v in the flash layout with the rotary embedding as one op, and each decoder
    layer compiled (not with activation checkpointing, whose recomputation runs the layer
    outside the compiled graph). On the CPU the modules keep transformers' forwards.
    """
    architecture_adapter(model)  # an unsupported architecture fails here, on every device
    use_varlen_attention(model)
    if device.type != "cuda":
        return
    fuse_elementwise(model)
    use_packed_attention_layout(model)
    if not getattr(model, "is_gradient_checkpointing", False):
        compile_decoder_layers(model)
