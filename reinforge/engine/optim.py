"""AdamW with a linear warmup, then one of the learning-rate schedules of ``LR_SCHEDULES``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from reinforge.engine.offload import HostOffloadedAdamW

if TYPE_CHECKING:
    from reinforge.config.schema import OptimConfig


def build_optimizer(model: nn.Module, config: OptimConfig, offload: bool = False) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; ``offload`` keeps its state and step on the host (engine.offload)."""
    if offload:
        return HostOffloadedAdamW(((name, p) for name, p in model.named_parameters() if p.requires_grad),
                                  lr=config.lr, betas=tuple(config.betas), eps=config.eps,
                                  weight_decay=config.weight_decay)
    parameters = [p for p in model.parameters() if p.requires_grad]
    # fused AdamW is faster on CUDA; foreach is the portable default elsewhere.
    fused = all(p.is_cuda for p in parameters)
    return torch.optim.AdamW(parameters, lr=config.lr, betas=tuple(config.betas), eps=config.eps,
                             weight_decay=config.weight_decay, fused=fused or None)


def _cosine(progress: float, config: OptimConfig) -> float:
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


LR_SCHEDULES: dict[str, Callable[[float, OptimConfig], float]] = {
    "constant": lambda progress, config: 1.0,
    "cosine": _cosine,
    "linear": lambda progress, config: 1.0 - progress,  # to 0, as transformers' get_linear_schedule_with_warmup
}
"""optim.schedule -> the lr factor after warmup, given the fraction of post-warmup steps done (0..1)."""


def lr_multiplier(step: int, total_steps: int, config: OptimConfig) -> float:
    """Factor on the base lr after ``step`` optimizer steps."""
    warmup = config.warmup_steps or int(config.warmup_ratio * total_steps)
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return LR_SCHEDULES[config.schedule](progress, config)


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int,
                    config: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, config))
