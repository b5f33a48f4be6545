"""Model FLOPs utilisation and throughput of an update.

MFU counts the matrix FLOPs an update computes per token (``update_flops_per_token``: 2 x parameters
forward, 2 x parameters for the inputs' gradients, 2 x trainable parameters for the weights' gradients,
so 6 x parameters when every weight trains and 4 x the frozen base + 6 x the adapters with LoRA; attention
and recomputation left out; a mixture-of-experts layer counts the parameters a token runs through, its
experts' weights times top_k / num_experts, ``num_active_parameters``; a vision-language model's vision tower
and projector left out, ``token_parameters``: they run over image patches, not the tokens) times the tokens, over the time
the update took, against the device's datasheet dense bf16 rate (989 TFLOP/s for the H100 and H200
SXM, 756 for the H100 PCIe; ``table_flops``). ``perf/mfu_measured_peak/<role>`` divides by the rate measured on
this project's H200 instead (799 TFLOP/s, an 8192^3 bf16 product through
PyTorch), the most a matrix product reached there. The tokens are those the model actually ran:
with shared prompts (``engine.packing``) a prompt counts once for its group, so MFU measures the
hardware, while the tokens/s figure counts every sequence's tokens, as the workload defines them.

``perf/mfu_with_attention/<role>`` adds the attention's own products, which the parameter count
leaves out and which grow with the square of a sequence's length: a query-key pair costs
2 x heads x (query-key dim + value dim) FLOPs forward in each layer (the scores and the weighted
values), three times that with the backward; a causal segment of q queries over k keys (its prompt's
too when prompts are shared) has sum(k - q + i, i = 1..q) pairs, each term capped at a sliding
layer's window (``attention_pairs``). At 512 tokens it adds a few percent; at 32k, for 1.5B, about
as much again as the parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from reinforge.engine.memory_plan import MemoryPlanError, ModelShape
from reinforge.engine.moe import moe_routers

DATASHEET_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "GH200": 989e12, "H100 PCIe": 756e12, "A100": 312e12,
                        "A100 PCIe": 312e12}
"""Dense bf16 rates of the SXM parts, and of the PCIe cards where their rate is known; another form of a part (an
H100 or H200 NVL) has none (``table_flops``), so no MFU is reported for it rather than one against the wrong peak."""
MEASURED_BF16_FLOPS = {"H200": 799e12}
"""What a bf16 matrix product reached on this project's H200 (2026-12)."""
OTHER_FORMS = ("pcie", "nvl")
"""Words of a device name that mark a form of a part whose rate is not its SXM form's."""


def table_flops(name: str, table: dict[str, float]) -> float | None:
    """The rate of the first key of ``table`` whose words are all in the device ``name`` (case apart) and that names
    the name's form (PCIe, NVL) where it has one: an "H100 PCIe" is not an "H100", an "A100-PCIE-40GB" is an
    "A100 PCIe"."""
    words = set(name.lower().replace("-", " ").split())
    form = next((form for form in OTHER_FORMS if form in words), None)
    for key, flops in table.items():
        wanted = set(key.lower().split())
        if wanted <= words and (form is None or form in wanted):
            return flops
    return None


def peak_flops(device: torch.device, table: dict[str, float] = DATASHEET_BF16_FLOPS) -> float | None:
    if device.type != "cuda":
        return None
    return table_flops(torch.cuda.get_device_name(device), table)


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights once), full sizes even when sharded."""
    return sum(parameter.numel() for parameter in {id(p): p for p in model.parameters()}.values())


def token_parameters(model: nn.Module) -> dict[int, nn.Parameter]:
    """id -> parameter of those a token runs through, tied ones once: all but a vision-language model's vision tower
    and multimodal projector (``models.vision.vision_tower``), which encode image patches, not the tokens."""
    from reinforge.models.vision import vision_tower

    parameters = {id(p): p for p in model.parameters()}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's own
    inner = getattr(base, "model", base)
    for module in (vision_tower(base), getattr(inner, "multi_modal_projector", None)):
        if isinstance(module, nn.Module):
            for parameter in module.parameters():
                parameters.pop(id(parameter), None)
    return parameters


def _active_shares(model: nn.Module) -> dict[int, float]:
    """id(parameter) -> the share of it one token runs through: top_k / num_experts for the fused expert weights
    of each mixture-of-experts block (every other parameter: 1)."""
    shares = {}
    for block, router in moe_routers(model):
        experts = block.experts
        top_k = getattr(router, "top_k", None) or getattr(getattr(model, "config", None), "num_experts_per_tok", 1)
        for parameter in experts.parameters():
            if parameter.dim() == 3:
                shares[id(parameter)] = top_k / parameter.shape[0]
    return shares


def num_active_parameters(model: nn.Module) -> float:
    """Parameters one token runs through (``num_parameters`` for a dense text model)."""
    shares = _active_shares(model)
    return sum(p.numel() * shares.get(key, 1.0) for key, p in token_parameters(model).items())


def update_flops_per_token(model: nn.Module) -> float:
    """Matrix FLOPs of one token's forward and backward: every weight multiplies forward (2 x parameters) and
    passes the gradient back to its input (2 x parameters); only trainable weights get their own gradient
    (2 x trainable parameters). A frozen weight's gradient is never computed, so it is not counted. Parameters
    are the active ones (``num_active_parameters``)."""
    shares = _active_shares(model)
    parameters = token_parameters(model)
    active = sum(p.numel() * shares.get(key, 1.0) for key, p in parameters.items())
    trainable = sum(p.numel() * shares.get(key, 1.0) for key, p in parameters.items() if p.requires_grad)
    return 4.0 * active + 2.0 * trainable


def forward_share(model: nn.Module) -> float:
    """A forward pass's share of ``update_flops_per_token``: 2 x active parameters over it, 1/3 when every weight
    trains, about 1/2 for a LoRA adapter's frozen base (which gets no weight gradients)."""
    flops = update_flops_per_token(model)
    return 2.0 * num_active_parameters(model) / flops if flops else 0.0


def capped_sum(first, count, cap: int) -> np.ndarray:
    """sum(min(first + j, cap) for j in range(count)), elementwise over arrays; cap 0: no cap."""
    first, count = np.asarray(first, dtype=np.float64), np.asarray(count, dtype=np.float64)
    if not cap:
        return count * first + count * (count - 1) / 2
    below = np.clip(cap - first, 0, count)  # the terms under the cap: first .. first + below - 1
    return below * first + below * (below - 1) / 2 + (count - below) * cap


def attention_pairs(query_lengths: Sequence[int], key_lengths: Sequence[int], window: int = 0) -> float:
    """Query-key pairs of causal segments of q queries over k keys aligned to the keys' end (query i sees
    k - q + i keys, at most ``window``; 0: no window)."""
    queries, keys = np.asarray(query_lengths, dtype=np.float64), np.asarray(key_lengths, dtype=np.float64)
    return float(capped_sum(keys - queries + 1, queries, window).sum())


def attention_layers(model: nn.Module) -> tuple[tuple[int, float], ...]:
    """(window or 0, forward FLOPs per query-key pair) of each decoder layer, from ``model.config``; () when the
    model has no transformer config (its attention is then not counted)."""
    config = getattr(model, "config", None)
    try:
        shape = ModelShape.from_hf_config(config.to_dict())
    except (AttributeError, MemoryPlanError):
        return ()
    if shape.kv_lora_rank:
        width = shape.qk_nope_head_dim + shape.qk_rope_head_dim + shape.v_head_dim
    else:
        width = 2 * shape.head_dim
    windows = shape.attention_windows or (0,) * shape.num_layers
    return tuple((window, 2.0 * shape.num_heads * width) for window in windows)


def attention_flops(layers: tuple[tuple[int, float], ...], query_lengths: Sequence[int],
                    key_lengths: Sequence[int]) -> float:
    """FLOPs of the attention products of these segments, forward and backward (3 x forward), in all layers."""
    by_window: dict[int, float] = {}
    for window, flops in layers:
        by_window[window] = by_window.get(window, 0.0) + flops
    return 3.0 * sum(flops * attention_pairs(query_lengths, key_lengths, window) for window, flops in by_window.items())


def update_perf_metrics(role: str, model: nn.Module, num_tokens: float, seconds: float,
                        device: torch.device, computed_tokens: float | None = None,
                        computed_attention_flops: float | None = None) -> dict[str, float]:
    """perf/mfu/<role> (where the peak is known) and perf/update_tokens_per_s/<role> of one rank.

    ``num_tokens``: the sequences' tokens; ``computed_tokens``: those run through the model (fewer with shared
    prompts; a forward-only pass's at its ``forward_share``; default ``num_tokens``); ``computed_attention_flops``: the attention
    products' FLOPs of the same passes (``attention_flops``), which add ``perf/mfu_with_attention/<role>``.
    """
    computed = num_tokens if computed_tokens is None else computed_tokens
    metrics = {f"perf/update_tokens_per_s/{role}": num_tokens / max(seconds, 1e-9),
               f"perf/computed_tokens/{role}": computed}
    flops_per_s = update_flops_per_token(model) * computed / max(seconds, 1e-9)
    for name, table in (("mfu", DATASHEET_BF16_FLOPS), ("mfu_measured_peak", MEASURED_BF16_FLOPS)):
        peak = peak_flops(device, table)
        if peak is not None:
            metrics[f"perf/{name}/{role}"] = flops_per_s / peak
    peak = peak_flops(device)
    if computed_attention_flops is not None and peak is not None:
        attention_per_s = computed_attention_flops / max(seconds, 1e-9)
        metrics[f"perf/mfu_with_attention/{role}"] = (flops_per_s + attention_per_s) / peak
    return metrics
