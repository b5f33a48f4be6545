"""AdamW with a warmup-then-constant or warmup-then-cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from reinforge.config.schema import OptimConfig
from reinforge.engine.offload import HostOffloadedAdamW


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


def lr_multiplier(step: int, total_steps: int, config: OptimConfig) -> float:
    """Factor on the base lr after ``step`` optimizer steps."""
    warmup = config.warmup_steps or int(config.warmup_ratio * total_steps)
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if config.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int,
                    config: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, config))
