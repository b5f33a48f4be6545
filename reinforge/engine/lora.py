"""LoRA for the actor (``model.lora.rank > 0``), on peft's layers.

peft injects its adapter layers into the HF model itself: ``q_proj`` becomes a LoRA layer that
holds the frozen base ``nn.Linear`` (``q_proj.base_layer``) and the trainable ``lora_A``/``lora_B``.
Everything else keeps working on that same HF model (FSDP2 shards it one decoder layer per unit,
frozen and trainable parameters side by side; the packed forwards call the layers as before), and
the ``PeftModel`` wrapper is kept only for what it adds:

- ``disable_adapter()``: the reference policy is the same model with the adapters off, no copy;
- merged weights for the rollout, W + (alpha / rank) B A, computed from the gathered parameters
  at wake-up and written into the engine's own weight copy (native: ``lora_deltas`` added in place)
  or into new tensors the module reads while it generates (hf: ``merged_weights``, the base layers' forwards reading merged tensors). peft's own
  ``merge_adapter`` writes into W, which FSDP may share with the trained weights; we never do.

The frozen base is kept in the compute dtype (bfloat16 on a GPU: no float32 master copy is
needed for weights that never change), the adapters in float32.

Checkpoints and exports name tensors as the adapted HF model does; ``merge_lora_weights`` folds
the adapters into plain weights, ``write_adapter_folder`` writes peft's own format.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from reinforge.config.schema import LoraConfig

logger = logging.getLogger(__name__)

ADAPTER_NAME = "default"


def linear_targets(model: nn.Module, targets: list[str]) -> list[str]:
    """The full names of ``model``'s linear layers whose last name is one of ``targets``.

    Given a mixture of experts, peft would also match the fused 3-D expert weights by name (``gate_up_proj``,
    ``down_proj``) and wrap them in a parametrization the merged-weight rollout and export cannot read; naming the
    linear layers themselves keeps the experts frozen, as ``EXPERTS_NOTE`` says."""
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets and module.weight.numel()]


def _peft_config(config: LoraConfig, base_model_path: str = "", model: nn.Module | None = None,
                 head: str | None = None):
    from peft import LoraConfig as PeftLoraConfig

    targets = list(config.target_modules)
    experts = None
    if model is not None:
        experts = [name for name, module in model.named_modules()
                   if name.rsplit(".", 1)[-1] == "experts" and isinstance(getattr(module, "down_proj", None), Tensor)
                   and module.down_proj.dim() == 3] or None
        if experts and targets != ["all-linear"]:
            targets = linear_targets(model, targets) or targets
    excluded = [*(experts or []), *([head] if head else []), *_frozen_tower_linears(model), *_empty_linears(model),
                *_linears_with_own_forward(model)]
    excluded = excluded or None
    return PeftLoraConfig(r=config.rank, lora_alpha=config.alpha, exclude_modules=excluded,
                          target_modules="all-linear" if targets == ["all-linear"] else targets,
                          lora_dropout=config.dropout, bias="none", task_type=None if head else "CAUSAL_LM",
                          base_model_name_or_path=base_model_path or None)


def _empty_linears(model: nn.Module | None) -> list[str]:
    """Linear layers without weights (DeepSeek's shared MLP with ``n_shared_experts: 0`` is (hidden, 0) wide): no
    layer to adapt."""
    if model is None:
        return []
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and not module.weight.numel()]


def _linears_with_own_forward(model: nn.Module | None) -> list[str]:
    """Linear layers whose class gives them a forward of their own that is no linear map of its input (PhiMoE's router
    returns its logits, routing weights and experts): an adapter's output cannot be added to what it returns, and the
    rollout's merged weight, read through a plain linear forward in its place, would skip what it does. One that
    computes W x + b another way (Falcon's) is adapted as any."""
    if model is None:
        return []
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and type(module).forward is not nn.Linear.forward
            and not _computes_a_linear(module)]


def _computes_a_linear(module: nn.Linear) -> bool:
    """Whether ``module`` returns W x + b for an input row (assumed where its weight holds no values to try)."""
    weight = module.weight
    if weight.is_meta or isinstance(weight, DTensor) or not weight.numel():
        return True
    row = torch.linspace(-1.0, 1.0, module.in_features, device=weight.device).to(weight.dtype)[None]
    with torch.no_grad():
        try:
            out = module(row.clone())
        except (RuntimeError, TypeError, ValueError):
            return False
        expected = nn.functional.linear(row, weight, module.bias)
    return isinstance(out, Tensor) and out.shape == expected.shape and torch.allclose(
        out.float(), expected.float(), rtol=1e-2, atol=1e-3)


def _frozen_tower_linears(model: nn.Module | None) -> list[str]:
    """The linear layers of a vision-language model's frozen vision tower (``actor.freeze_vision_tower``): a frozen
    tower gets no adapter, whatever the targets name (Qwen2.5-VL's tower MLP has ``gate_proj`` ... ``down_proj``)."""
    from reinforge.models.vision import vision_tower

    tower = vision_tower(model) if model is not None else None
    if tower is None or any(parameter.requires_grad for parameter in tower.parameters()):
        return []
    prefix = next(name for name, module in model.named_modules() if module is tower)
    return [f"{prefix}.{name}" for name, module in tower.named_modules() if isinstance(module, nn.Linear)]


def add_lora(model: nn.Module, config: LoraConfig, base_model_path: str = "", seed: int = 0,
             head: str | None = None) -> nn.Module:
    """Inject adapters into ``model`` in place (its base parameters frozen); returns the PeftModel around it.

    ``head``: the attribute name of a classification model's head (a reward model's ``score``), which gets no
    adapter and trains whole.

    lora_B starts at zero, so the model computes exactly what it did before. lora_A's random start comes
    from ``seed`` (the global generator is left as it was): two runs with one seed start alike, and every
    rank of a sharded run draws the same matrices.
    """
    from peft import get_peft_model

    from reinforge.engine.moe import moe_blocks

    experts = bool(moe_blocks(model))
    if experts:
        logger.info("LoRA on a mixture of experts: %s", EXPERTS_NOTE)
    chosen = _targets_for(model, config, head)
    if chosen is not config and list(config.target_modules) == ["all-linear"]:
        logger.info("LoRA: model.lora.target_modules=all-linear on %s: its adapters go on its linear layers %s, not "
                    "the state-space mixer's %s, which peft refuses", type(model).__name__,
                    ", ".join(chosen.target_modules), ", ".join(sorted(STATE_SPACE_MIXER_LAYERS)))
    elif chosen is not config:
        logger.info("LoRA: %s names its projections otherwise than model.lora.target_modules' defaults (%s); its "
                    "adapters go on its linear layers %s", type(model).__name__, ", ".join(config.target_modules),
                    ", ".join(chosen.target_modules))
    config = chosen
    from reinforge.models.vision import vision_tower

    tower = vision_tower(model)
    tower_trains = tower is not None and any(parameter.requires_grad for parameter in tower.parameters())
    try:
        with (torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []),
              _named_layers_only(model) if experts else contextlib.nullcontext()):
            torch.manual_seed(seed)
            with warnings.catch_warnings():  # peft reads transformers' old checkpointing flag, which warns from 5.25 on
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                peft_model = get_peft_model(model, _peft_config(config, base_model_path, model, head))
            _share_adapters_of_shared_weights(model)
            _say_unmatched_targets(model, config)
            if tower_trains:
                _say_untrained_tower(tower, config)
            if head:
                getattr(model, head).requires_grad_(True)
            return peft_model
    except ValueError as error:
        if any(said in str(error) for said in ("not found in the base model", "Target modules",
                                               "No modules were targeted")):
            raise ValueError(f"model.lora.target_modules={list(config.target_modules)} matches no layer of "
                             f"{type(model).__name__}; name some of its linear layers "
                             f"({', '.join(linear_layer_names(model, head)) or 'none found'}), or all-linear") from error
        raise


def _share_adapters_of_shared_weights(model: nn.Module) -> None:
    """Adapted layers whose base weight is one parameter (Zamba's shared transformer block: the same weights read by
    several hybrid layers, each its own module) get one adapter, the first such layer's: peft gives each module its
    own, and the one merged weight that the rollout's copy and an export hold cannot be W + B1 A1 and W + B2 A2."""
    first: dict[int, nn.Module] = {}
    for layer in lora_layers(model):
        owner = first.setdefault(id(layer.get_base_layer().weight), layer)
        if owner is not layer:
            layer.lora_A[ADAPTER_NAME] = owner.lora_A[ADAPTER_NAME]
            layer.lora_B[ADAPTER_NAME] = owner.lora_B[ADAPTER_NAME]


def _say_unmatched_targets(model: nn.Module, config: LoraConfig) -> None:
    """One warning line naming the targets the user set that adapted no layer of this model (peft skips them)."""
    if list(config.target_modules) == ["all-linear"]:
        return
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    missed = [name for name in config.target_modules if name.rsplit(".", 1)[-1] not in adapted]
    if missed and adapted:
        logger.warning("model.lora.target_modules names %s, which match no linear layer of this %s; its adapters "
                       "are on %s only", missed, type(model).__name__, ", ".join(sorted(adapted)))


def _say_untrained_tower(tower: nn.Module, config: LoraConfig) -> None:
    """One warning line when a vision tower left to train (``actor.freeze_vision_tower=false``) got no adapter: LoRA
    freezes its weights, so it would train nothing (Qwen3-VL's tower names its layers qkv, proj, linear_fc1/2)."""
    if any(hasattr(module, "lora_A") for module in tower.modules()):
        return
    names = sorted({name.rsplit(".", 1)[-1] for name, module in tower.named_modules() if isinstance(module, nn.Linear)
                    and not name.rsplit(".", 1)[-1].isdigit()})
    logger.warning("actor.freeze_vision_tower=false, but model.lora.target_modules=%s match no linear layer of the "
                   "vision tower (%s): under LoRA it trains nothing; add some of its layers to model.lora.target_modules "
                   "(or all-linear), or set actor.freeze_vision_tower=true to say so", list(config.target_modules),
                   ", ".join(names))


def linear_layer_names(model: nn.Module, head: str | None = None) -> list[str]:
    """The distinct last names of ``model``'s linear layers (transformers' Conv1D, GPT-2's, included), its output
    head and a classification ``head`` left out."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skipped = {output, getattr(model, head, None) if head else None} - {None}
    names = [name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if (isinstance(module, nn.Linear) or _is_conv1d(module)) and module not in skipped
             and module.weight.numel()]
    return list(dict.fromkeys(names))


STATE_SPACE_FAMILIES = ("mamba", "mamba2", "falcon_mamba", "falcon_h1", "nemotron_h")
STATE_SPACE_MIXER_LAYERS = {"out_proj", "conv1d"}
"""Layers of a state-space mixer that peft gives no adapter (it refuses them by name in these families)."""


def _targets_for(model: nn.Module, config: LoraConfig, head: str | None) -> LoraConfig:
    """``config``, or where its targets are the default: a copy with the family's own projections where the table
    names them otherwise (Phi-3's fused qkv_proj and gate_up_proj, DeepSeek's MLA q_a_proj ... kv_b_proj) or the
    model has fewer of them (a mixture of experts without dense MLPs: its attention projections), or with
    the model's linear layers where the defaults name none of them (GPT-2's c_attn, Mamba's in_proj); ``add_lora``
    says so in one line. all-linear on a state-space family names its linear layers but the mixer's out_proj,
    which peft refuses there (and would refuse again loading an adapter folder that says all-linear)."""
    from reinforge.config.schema import LoraConfig

    default = LoraConfig().target_modules  # the projections of Llama-style families
    names = set(linear_layer_names(model, head))
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    if list(config.target_modules) == ["all-linear"] and model_type in STATE_SPACE_FAMILIES:
        return dataclasses.replace(config, target_modules=sorted(names - STATE_SPACE_MIXER_LAYERS))
    if list(config.target_modules) != default:
        return config
    family = [name for name in LINEAR_LAYERS.get(model_type, ()) if name in names]
    if family and set(family) != set(default):  # a mixture of experts without dense MLPs: its attention only
        return dataclasses.replace(config, target_modules=family)
    if names & set(default):
        return config
    kept = sorted(names - (STATE_SPACE_MIXER_LAYERS if model_type in STATE_SPACE_FAMILIES else set()))
    return dataclasses.replace(config, target_modules=kept or ["all-linear"])


@contextlib.contextmanager
def _named_layers_only(model: nn.Module) -> Iterator[None]:
    """Inside the block peft adapts the layers its targets name and nothing else.

    For the families whose experts transformers 5 fused into 3-D weights (Qwen3-MoE, DeepSeek-V2/V3, ...), peft
    turns every target named ``gate_proj``, ``up_proj`` or ``down_proj`` into the experts' fused parameters, so
    that adapters trained on transformers 4's per-expert linear layers still load; it does so for a DeepSeek
    shared expert's or dense layer's linear layer too, adapting every routed expert. peft picks those families by
    ``config.model_type``, which reads as no known family inside the block.
    """
    config = model.config
    own = vars(config).get("model_type")
    config.model_type = f"{config.model_type}:linear-layers"
    try:
        yield
    finally:
        if own is None:
            del config.model_type  # the class's own again
        else:
            config.model_type = own


DENSE_MLP_LAYERS = ("gate_proj", "up_proj", "down_proj")

LINEAR_LAYERS = {
    **dict.fromkeys(("qwen2", "qwen3", "llama", "mistral", "gemma", "gemma2", "gemma3_text", "olmo2", "smollm3",
                     "qwen3_moe"), ("q_proj", "k_proj", "v_proj", "o_proj", *DENSE_MLP_LAYERS)),
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    **dict.fromkeys(("mixtral", "olmoe"), ("q_proj", "k_proj", "v_proj", "o_proj")),
    **dict.fromkeys(("deepseek_v2", "deepseek_v3"), ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                      "o_proj", *DENSE_MLP_LAYERS)),
}
"""The decoder layers' linear layers by ``model_type``: what ``model.lora.target_modules`` can name. A mixture of
experts keeps its experts in fused 3-D weights, no linear layers: its adapters go on the attention projections and
on the dense MLPs where it has some (``has_dense_mlp``: Qwen3-MoE's ``mlp_only_layers`` and the layers
``decoder_sparse_step`` skips, DeepSeek's first ``first_k_dense_replace`` layers and shared experts), and the experts
stay frozen (``EXPERTS_NOTE``)."""
EXPERTS_NOTE = ("the experts' fused 3-D weights get no adapter and stay frozen: peft can adapt such parameters "
                "(target_parameters), but the merged weights reinforge hands the rollout and writes on export do not "
                "include those adapters")


PEFT_FLOOR = "0.18"
"""The oldest peft whose LoRA layers reinforge builds on transformers 5 (``exclude_modules``; 0.17's layers fail on
transformers 5's modules)."""


def peft_problem() -> str | None:
    """Why peft cannot make reinforge's adapters here (not installed, or older than ``PEFT_FLOOR``); None when it can."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import InvalidVersion, Version

    try:
        found = version("peft")
    except PackageNotFoundError:
        return "peft is not installed here"
    try:
        old = Version(found) < Version(PEFT_FLOOR)
    except InvalidVersion:
        return None  # a build that names itself otherwise: peft's own errors speak
    return f"peft {found} is installed here, older than {PEFT_FLOOR}, the first that makes them on transformers 5" \
        if old else None


def require_peft(config: LoraConfig, key: str = "model.lora.rank") -> None:
    """Refuse adapters (``config.rank`` > 0) in one line, before any model loads, where peft cannot make them."""
    if config.rank <= 0:
        return
    problem = peft_problem()
    if problem:
        raise ValueError(f"{key}={config.rank} trains LoRA adapters with peft, and {problem}; pip install -U "
                         f"'peft>={PEFT_FLOOR}' (or reinforge[lora]), or set {key}=0 to train every weight")


def check_target_modules(config: LoraConfig, model_path: str) -> None:
    """Fail before any weight loads when no name in ``model.lora.target_modules`` is a linear layer of the
    model's architecture (read from its config.json; architectures not in ``LINEAR_LAYERS`` are left to peft).
    peft matches a name against the end of each module's path, so ``self_attn.q_proj`` counts as ``q_proj``. The
    default targets are not checked: the model gets its family's own projections in their place (``_targets_for``)."""
    from reinforge.config.schema import LoraConfig

    if config.rank <= 0 or list(config.target_modules) == LoraConfig().target_modules:
        return
    file = Path(model_path).expanduser() / "config.json"
    try:
        model_config = json.loads(file.read_text())
        model_type = model_config.get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # no readable local config: the model's own loading says what is wrong
    linears = LINEAR_LAYERS.get(model_type)
    targets = list(config.target_modules)
    if linears is None or "all-linear" in targets:
        return
    absent: tuple[str, ...] = ()
    if model_type in ("qwen3_moe", "deepseek_v2", "deepseek_v3"):
        from transformers import AutoConfig

        try:
            family_config = AutoConfig.for_model(**model_config)
        except (TypeError, ValueError, KeyError):
            return  # a config transformers cannot read: the model's own loading says what is wrong
        if not has_dense_mlp(family_config):
            absent += DENSE_MLP_LAYERS
        if model_type != "qwen3_moe":  # a query of low rank, or a whole one
            absent += ("q_proj",) if family_config.q_lora_rank else ("q_a_proj", "q_b_proj")
    linears = tuple(name for name in linears if name not in absent)
    unknown = [name for name in targets if name.rsplit(".", 1)[-1] not in linears]
    why = (f" (every MLP of this {model_type} is a mixture of experts, whose fused weights get no adapter)"
           if {name.rsplit(".", 1)[-1] for name in unknown} & set(absent) & set(DENSE_MLP_LAYERS) else "")
    if unknown and len(unknown) < len(targets):  # peft ignores them: a typo would silently adapt fewer layers
        logger.warning("model.lora.target_modules names %s, no linear layer of a %s model%s; peft ignores it "
                       "(use some of %s)", unknown, model_type, why, ", ".join(linears))
    if len(unknown) == len(targets):
        raise ValueError(f"model.lora.target_modules={targets} names no linear layer of a {model_type} model{why}; "
                         f"use some of {', '.join(linears)}")


def has_dense_mlp(config: PretrainedConfig) -> bool:
    """Whether a Qwen3-MoE or DeepSeek V2/V3 ``config`` gives some decoder layer a dense MLP (``gate_proj``,
    ``up_proj``, ``down_proj`` linear layers) beside its mixtures of experts, as transformers builds the layers."""
    layers = range(config.num_hidden_layers)
    if config.model_type == "qwen3_moe":
        sparse = [index not in config.mlp_only_layers and config.num_experts > 0
                  and (index + 1) % config.decoder_sparse_step == 0 for index in layers]
        return not all(sparse)
    first_dense = min(config.first_k_dense_replace or 0, len(layers))
    return first_dense > 0 or (config.n_shared_experts or 0) > 0


def lora_scaling(config: LoraConfig) -> float:
    return config.alpha / config.rank


def lora_layers(peft_model: nn.Module) -> list[nn.Module]:
    """The adapted layers (peft's LoRA layers) of the model, in module order."""
    from peft.tuners.lora import LoraLayer

    return [module for module in peft_model.modules() if isinstance(module, LoraLayer)]


def lora_deltas(peft_model: nn.Module, device: torch.device | None = None) -> Iterator[tuple[nn.Module, Tensor]]:
    """(adapted layer, scaling * B A in float32) one layer at a time; B and A as the module holds them (gathered).

    ``device``: where to compute the delta (the rollout engine's), when the adapter lives elsewhere
    (``actor.param_offload`` keeps it on the CPU between phases).
    """
    for layer in lora_layers(peft_model):
        lora_a, lora_b = (_whole(layer.lora_A[ADAPTER_NAME].weight), _whole(layer.lora_B[ADAPTER_NAME].weight))
        if device is not None:
            lora_a, lora_b = lora_a.to(device), lora_b.to(device)
        yield layer, (lora_b.detach().float() @ lora_a.detach().float()) * layer.scaling[ADAPTER_NAME]


def _whole(weight: Tensor) -> Tensor:
    """An adapter weight as a plain full tensor (still sharded when the rollout reads a single device's shards)."""
    return weight.full_tensor() if isinstance(weight, DTensor) else weight


@contextlib.contextmanager
def merged_weights(peft_model: nn.Module) -> Iterator[None]:
    """Inside the block each adapted layer computes with a new weight W + scaling * B A and skips its adapter.

    For a rollout engine that runs the module itself (hf). The merged weights are new tensors
    next to W, never written into it: FSDP's gathered W may share storage with the trained
    weights (one rank, no dtype cast), and W + BA - BA is not W in floating point.
    """
    swapped: list[tuple[nn.Module, nn.Module]] = []
    try:
        for layer, delta in lora_deltas(peft_model):
            base = layer.get_base_layer()
            transposed = _is_conv1d(base)  # GPT-2's layers keep W as (in, out)
            merged = (base.weight.detach().float() + (delta.T if transposed else delta)).to(base.weight.dtype)
            # the forward reads the merged tensor; the registered parameters stay FSDP's own
            base.forward = functools.partial(_conv1d if transposed else _linear, weight=merged, bias=base.bias)
            layer.merged_adapters.append(ADAPTER_NAME)
            swapped.append((layer, base))
        yield
    finally:
        for layer, base in swapped:
            del base.forward
            layer.merged_adapters.remove(ADAPTER_NAME)


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return nn.functional.linear(x, weight, bias)


def _conv1d(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """transformers' Conv1D forward (GPT-2's linear layer, W stored (in, out)) on the merged ``weight``."""
    return torch.addmm(bias, x.view(-1, x.size(-1)), weight).view(*x.shape[:-1], weight.size(-1))


def _is_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def transposed_layers(model: nn.Module) -> frozenset[str]:
    """The names of ``model``'s layers that store their weight transposed, (in, out): transformers' Conv1D (GPT-2's
    c_attn, c_fc, c_proj), without peft's ``base_layer`` wrapping. An adapter's B A is (out, in): merged into them
    it is transposed (``merge_lora_weights``, ``merged_by_name``)."""
    return frozenset(name.removesuffix(".base_layer") for name, module in model.named_modules() if _is_conv1d(module))


def _delta_for(prefix: str, delta: Tensor, transposed: frozenset[str]) -> Tensor:
    """``delta`` in the layout of the weight at ``prefix`` (names may carry peft's or a wrapper's leading parts)."""
    for name in transposed:
        if prefix == name or prefix.endswith(f".{name}") or name.endswith(f".{prefix}"):
            return delta.T
    return delta


def _merged(prefix: str, weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float,
            transposed: frozenset[str]) -> Tensor:
    """W + scaling * B A in float32, back in W's dtype and layout (the layer at ``prefix``)."""
    delta = _delta_for(prefix, scaling * (lora_b.float() @ lora_a.float()), transposed)
    return (weight.float() + delta).to(weight.dtype)


def merge_lora_weights(state: dict[str, Tensor], scaling: float,
                       transposed: frozenset[str] = frozenset()) -> dict[str, Tensor]:
    """Plain weights from an adapted model's state dict, in place: W + scaling * B A; the adapters dropped.

    Accepts the adapted names (``q_proj.base_layer.weight``) or plain base names with the adapter
    tensors added (``q_proj.weight`` and ``q_proj.lora_A.default.weight``). Returns ``state``.
    ``transposed``: the layers whose weight is (in, out) (``transposed_layers``).
    """
    marker_a = f".lora_A.{ADAPTER_NAME}.weight"
    for name in [name for name in state if ".base_layer." in name]:
        state[name.replace(".base_layer.", ".")] = state.pop(name)
    for name_a in [name for name in state if name.endswith(marker_a)]:
        prefix = name_a[:-len(marker_a)]
        lora_a = state.pop(name_a)
        lora_b = state.pop(f"{prefix}.lora_B.{ADAPTER_NAME}.weight")
        state[f"{prefix}.weight"] = _merged(prefix, state[f"{prefix}.weight"], lora_a, lora_b, scaling, transposed)
    leftover = [name for name in state if ".lora_" in name]
    if leftover:
        raise ValueError(f"adapter tensor {leftover[0]} has no lora_A/lora_B partner; the state is not one adapter")
    return state


def merged_by_name(state: dict[str, Tensor], scaling: float,
                   transposed: frozenset[str] = frozenset()) -> Iterator[tuple[str, Tensor]]:
    """(plain name, tensor) for an adapted model's named tensors, each adapted weight merged only when reached.

    Unlike ``merge_lora_weights`` nothing is kept: one merged weight exists at a time.
    """
    marker = ".base_layer."
    for name, tensor in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if marker in name and name.endswith(".weight"):
            prefix = name[:name.index(marker)]
            lora_a = state[f"{prefix}.lora_A.{ADAPTER_NAME}.weight"]
            lora_b = state[f"{prefix}.lora_B.{ADAPTER_NAME}.weight"]
            tensor = _merged(prefix, tensor, lora_a, lora_b, scaling, transposed)
        yield name.replace(marker, "."), tensor


def adapter_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The adapter tensors of an adapted model's state dict (``...lora_A.default.weight``)."""
    return {name: tensor for name, tensor in state.items() if ".lora_A." in name or ".lora_B." in name}


def write_adapter_folder(folder: Path, adapters: dict[str, Tensor], config: LoraConfig, base_model_path: str,
                         state_names: Iterable[str] = ()) -> None:
    """peft's adapter format (adapter_config.json, adapter_model.safetensors), loadable by PeftModel.from_pretrained.

    ``state_names``: the names of the adapted model's whole state. Where the adapted layers' last names also name
    layers that got no adapter (targets such as ``layers.0.self_attn.q_proj``), the folder names the adapted layers
    by their full names, so that peft adapts those and no others when it loads the folder."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    # a copy each: the layers of a shared weight share one adapter, whose tensors safetensors writes once per name
    peft_names = {f"base_model.model.{name.replace(f'.{ADAPTER_NAME}.', '.')}": tensor.detach().cpu().clone()
                  for name, tensor in adapters.items()}
    save_file(peft_names, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    paths = {name.split(".lora_A.")[0] for name in adapters if ".lora_A." in name}
    adapted = sorted({path.rsplit(".", 1)[-1] for path in paths})
    layers = {name.rsplit(".", 1)[0].removesuffix(".base_layer") for name in state_names if ".lora_" not in name}
    if any(layer.rsplit(".", 1)[-1] in adapted and layer not in paths for layer in layers):
        adapted = sorted(paths)  # peft matches a full name to that layer alone
    if adapted and set(adapted) != set(config.target_modules):
        # the layers add_lora adapted, no more: a target that adapted nothing in training (a MoE's gate_proj/up_proj/
        # down_proj, which peft >= 0.18 on transformers 5 maps onto the fused experts) would get a new, untrained
        # adapter when peft loads the folder ("missing adapter keys"); all-linear would name layers add_lora left
        # alone, some of which peft refuses (a state-space mixer's out_proj) or cannot adapt (PhiMoE's router)
        config = dataclasses.replace(config, target_modules=adapted)
    local = Path(base_model_path).expanduser() if base_model_path else None
    if local is not None and local.is_dir():  # a relative model.path names nothing once read from another folder
        base_model_path = str(local.resolve())
    peft_config = _peft_config(config, base_model_path).to_dict()
    (folder / "adapter_config.json").write_text(json.dumps(_jsonable(peft_config), indent=2, sort_keys=True) + "\n")


def read_adapter_weights(folder: Path) -> dict[str, Tensor]:
    """The adapter tensors of a folder in peft's format, named as ``write_adapter_folder`` read them (the adapted HF
    model's names, ``...lora_A.default.weight``)."""
    from safetensors.torch import load_file

    state = {}
    for name, tensor in load_file(str(folder / "adapter_model.safetensors")).items():
        plain = name.removeprefix("base_model.model.")
        for part in (".lora_A.", ".lora_B."):
            plain = plain.replace(part, f"{part}{ADAPTER_NAME}.")
        state[plain] = tensor
    return state


def read_adapter_config(folder: Path) -> tuple[float, str]:
    """(scaling alpha / rank, base model path) from an adapter folder's adapter_config.json."""
    saved = json.loads((folder / "adapter_config.json").read_text())
    return float(saved["lora_alpha"]) / int(saved["r"]), saved.get("base_model_name_or_path") or ""


def _jsonable(value):
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(item) for item in (sorted(value) if isinstance(value, set) else value)]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value.value if hasattr(value, "value") else value)
