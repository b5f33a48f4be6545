"""Model FLOPs utilisation and throughput of an update.

MFU counts the matrix FLOPs an update computes per token (``update_flops_per_token``: 2 x parameters
forward, 2 x parameters for the inputs' gradients, 2 x trainable parameters for the weights' gradients,
so 6 x parameters when every weight trains and 4 x the frozen base + 6 x the adapters with LoRA; attention
and recomputation left out) times the tokens, over the time the update took, against the device's datasheet dense
bf16 rate (989 TFLOP/s for the H100 and H200 SXM). ``perf/mfu_measured_peak/<role>`` divides by
the rate measured on this project's H200 instead (799 TFLOP/s, an 8192^3 bf16 product through
PyTorch), the most a matrix product reached there. The tokens are those the model actually ran:
with shared prompts (``engine.packing``) a prompt counts once for its group, so MFU measures the
hardware, while the tokens/s figure counts every sequence's tokens, as the workload defines them.
"""

from __future__ import annotations

import torch
from torch import nn

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


def update_flops_per_token(model: nn.Module) -> float:
    """Matrix FLOPs of one token's forward and backward: every weight multiplies forward (2 x parameters) and
    passes the gradient back to its input (2 x parameters); only trainable weights get their own gradient
    (2 x trainable parameters). A frozen weight's gradient is never computed, so it is not counted."""
    parameters = {id(p): p for p in model.parameters()}.values()
    trainable = sum(parameter.numel() for parameter in parameters if parameter.requires_grad)
    return 4.0 * num_parameters(model) + 2.0 * trainable


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
