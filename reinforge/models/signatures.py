"""What a model's forward accepts, read from its signature."""

from __future__ import annotations

import inspect

from torch import nn


def takes_position_ids(model: nn.Module) -> bool:
    """Whether ``model``'s forward names ``position_ids``: transformers' ``generate`` computes them from the attention
    mask (left padding left out) and passes them only then; a forward without them numbers positions itself (BART's
    decoders) or has none (RWKV). A peft wrapper answers for the model it wraps."""
    wrapped = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        return "position_ids" in inspect.signature(wrapped.forward).parameters
    except (TypeError, ValueError):
        return True
