"""Where a LongRoPE model switches from its short to its long rotary factors, read from its config.

transformers' LongRoPE (Phi-3, Phi-4, PhiMoE, or any family whose ``rope_parameters`` name ``longrope``) uses its
long factors at every position of a forward whose largest position reaches ``original_max_position_embeddings``,
else its short ones: a sequence that grows past that length changes the factors of all its earlier keys.
"""

from __future__ import annotations

from torch import nn


def longrope_original_length(model: nn.Module) -> int | None:
    """The original length of a LongRoPE model whose positions may pass it, else None."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(parameters, dict) or parameters.get("rope_type", parameters.get("type")) != "longrope":
        return None
    original = parameters.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None)
    maximum = getattr(config, "max_position_embeddings", None)
    if original is None or (maximum is not None and maximum <= original):
        return None
    return int(original)
