"""Model FLOPs utilisation and throughput of an update.

MFU counts the matrix FLOPs an update computes per token (``update_flops_per_token``: 2 x parameters
forward, 2 x parameters for the inputs' gradients, 2 x trainable parameters for the weights' gradients,
so 6 x parameters when every weight trains and 4 x the frozen base + 6 x the adapters with LoRA; attention
and recomputation left out; a mixture-of-experts layer counts the parameters a token runs through, its
experts' weights times top_k / num_experts, ``num_active_parameters``) times the tokens, over the time
the update took, against the device's datasheet dense bf16 rate (989 TFLOP/s for the H100 and H200
SXM). ``perf/mfu_measured_peak/<role>`` divides by the rate measured on this project's H200 instead (799 TFLOP/s, an 8192^3 bf16 product through
PyTorch), the most a matrix product reached there. The tokens are those the model actually ran:
with shared prompts (``engine.packing``) a prompt counts once for its group, so MFU measures the
hardware, while the tokens/s figure counts every sequence's tokens, as the workload defines them.
"""

from __future__ import annotations

import torch
from torch import nn

from reinforge.engine.moe import moe_blocks

DATASHEET_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
MEASURED_BF16_FLOPS = {"H200": 799e12}
"""What a bf16 matrix product reached on this project's H200 (2026-12)."""


def peak_flops(device: torch.device, table: dict[str, float] = DATASHEET_BF16_FLOPS) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in table.items() if key in name), None)


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights once), full sizes even when sharded."""
    return sum(parameter.numel() for parameter in {id(p): p for p in model.parameters()}.values())


def _active_shares(model: nn.Module) -> dict[int, float]:
    """id(parameter) -> the share of it one token runs through: top_k / num_experts for the fused expert weights
    of each mixture-of-experts block (every other parameter: 1)."""
    shares = {}
    for block in moe_blocks(model):
        experts = block.experts
        top_k = getattr(block.gate, "top_k", None) or getattr(getattr(model, "config", None), "num_experts_per_tok", 1)
        for parameter in experts.parameters():
            if parameter.dim() == 3:
                shares[id(parameter)] = top_k / parameter.shape[0]
    return shares


def num_active_parameters(model: nn.Module) -> float:
    """Parameters one token runs through (``num_parameters`` for a dense model)."""
    shares = _active_shares(model)
    return sum(p.numel() * shares.get(key, 1.0) for key, p in {id(p): p for p in model.parameters()}.items())


def update_flops_per_token(model: nn.Module) -> float:
    """Matrix FLOPs of one token's forward and backward: every weight multiplies forward (2 x parameters) and
    passes the gradient back to its input (2 x parameters); only trainable weights get their own gradient
    (2 x trainable parameters). A frozen weight's gradient is never computed, so it is not counted. Parameters
    are the active ones (``num_active_parameters``)."""
    shares = _active_shares(model)
    parameters = {id(p): p for p in model.parameters()}
    active = sum(p.numel() * shares.get(key, 1.0) for key, p in parameters.items())
    trainable = sum(p.numel() * shares.get(key, 1.0) for key, p in parameters.items() if p.requires_grad)
    return 4.0 * active + 2.0 * trainable


def update_perf_metrics(role: str, model: nn.Module, num_tokens: float, seconds: float,
                        device: torch.device, computed_tokens: float | None = None) -> dict[str, float]:
    """perf/mfu/<role> (where the peak is known) and perf/update_tokens_per_s/<role> of one rank.

    ``num_tokens``: the sequences' tokens; ``computed_tokens``: those run through the model
    (fewer with shared prompts; default ``num_tokens``).
    """
    computed = num_tokens if computed_tokens is None else computed_tokens
    metrics = {f"perf/update_tokens_per_s/{role}": num_tokens / max(seconds, 1e-9),
               f"perf/computed_tokens/{role}": computed}
    flops_per_s = update_flops_per_token(model) * computed / max(seconds, 1e-9)
    for name, table in (("mfu", DATASHEET_BF16_FLOPS), ("mfu_measured_peak", MEASURED_BF16_FLOPS)):
        peak = peak_flops(device, table)
        if peak is not None:
            metrics[f"perf/{name}/{role}"] = flops_per_s / peak
    return metrics
