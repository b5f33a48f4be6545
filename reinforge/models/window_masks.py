"""Whether a transformers model's own masks ever slide.

Most families that read ``config.sliding_window`` build a sliding-window mask for their windowed layers. A few
carry the key without using it: Llama, OLMo 2 and OLMoE build only causal masks, so their eager and SDPA forwards
attend to every earlier token whatever the config says (OLMoE hands the window to its attention function, which only
flash attention reads). transformers' ``DynamicCache`` still reads the key and keeps only the last window of keys
for every layer, so ``generate`` over such a config attends to fewer keys than the forward that scores its tokens.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn


def builds_window_masks(modeling: Any) -> bool:
    """Whether a modeling module of transformers holds any of its windowed mask builders (a module outside
    transformers, remote code, is assumed to: its ``sliding_window`` argument stands)."""
    if modeling is None or not modeling.__name__.startswith("transformers.models."):
        return True
    return any(getattr(value, "__module__", None) == "transformers.masking_utils" and ("window" in name or "sliding"
               in name) for name, value in vars(modeling).items())


def window_never_applies(model: nn.Module) -> bool:
    """``model``'s text config names a ``sliding_window``, yet neither its modeling module nor any of its attention
    modules' builds a window mask: its forward attends to every earlier token."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(config, "sliding_window", None):
        return False
    modelings = {type(model).__module__} | {type(module).__module__ for module in model.modules()
                                            if type(module).__name__.endswith("Attention")}
    return not any(builds_window_masks(sys.modules.get(name)) for name in modelings)
