"""Activation checkpointing of the first k decoder layers (the memory planner's partial checkpointing).

A checkpointed layer keeps only its input for the backward and runs its forward again there.
The wrapper goes around the layer's ``forward`` (compiled or not), inside FSDP's hooks, so the
parameters the recomputation needs are the ones FSDP gathers for the layer's backward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from reinforge.engine.fsdp import decoder_layers


def checkpoint_decoder_layers(model: nn.Module, num_layers: int) -> int:
    """Recompute the activations of the first ``num_layers`` decoder layers in training passes; returns how many."""
    layers = decoder_layers(model)[:max(num_layers, 0)]
    for layer in layers:
        inner = layer.forward

        def forward(*args, _inner=inner, _layer=layer, **kwargs):
            if _layer.training and torch.is_grad_enabled():
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return _inner(*args, **kwargs)

        layer.forward = forward
    return len(layers)
