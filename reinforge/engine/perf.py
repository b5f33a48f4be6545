"""Model FLOPs utilisation and throughput of an update.

MFU counts 6 x parameters x tokens (forward and backward of every parameter, attention and
recomputation left out) over the time the update took, against the device's bf16 matrix
rate. The tokens are those the model actually ran: with shared prompts (``engine.packing``)
a prompt counts once for its group, so MFU measures the hardware, while the tokens/s figure
counts every sequence's tokens, as the workload defines them. The H100/H200 figure is the
one measured on this project's H200 (an 8192^3 bf16 product through PyTorch), not the
datasheet's 989 TFLOP/s.
"""

from __future__ import annotations

import torch
from torch import nn

PEAK_BF16_FLOPS = {"H200": 799e12, "H100": 799e12, "A100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def num_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights once), full sizes even when sharded."""
    return sum(parameter.numel() for parameter in {id(p): p for p in model.parameters()}.values())


def update_perf_metrics(role: str, model: nn.Module, num_tokens: float, seconds: float,
                        device: torch.device, computed_tokens: float | None = None) -> dict[str, float]:
    """perf/mfu/<role> (where the peak is known) and perf/update_tokens_per_s/<role> of one rank.

    ``num_tokens``: the sequences' tokens; ``computed_tokens``: those run through the model
    (fewer with shared prompts; default ``num_tokens``).
    """
    computed = num_tokens if computed_tokens is None else computed_tokens
    metrics = {f"perf/update_tokens_per_s/{role}": num_tokens / max(seconds, 1e-9),
               f"perf/computed_tokens/{role}": computed}
    peak = peak_flops(device)
    if peak is not None:
        metrics[f"perf/mfu/{role}"] = 6.0 * num_parameters(model) * computed / max(seconds, 1e-9) / peak
    return metrics
