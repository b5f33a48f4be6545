"""reinforge: post-train language models with reinforcement learning.

``from reinforge import GRPOTrainer, GRPOConfig`` (and ``SFTTrainer``, ``DPOTrainer``, ``RewardTrainer``
with their configs) gives the Python API (``reinforge.api``); it is imported on first use, so ``import reinforge`` (and the CLI's checks
before torch loads) stays light.
"""

from typing import Any

__version__ = "0.1.0"

_API_NAMES = ("DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "RewardConfig", "RewardTrainer", "SFTConfig",
              "SFTTrainer")

__all__ = ["__version__", *_API_NAMES]


def __getattr__(name: str) -> Any:
    if name in _API_NAMES:
        from reinforge import api

        return getattr(api, name)
    raise AttributeError(f"module 'reinforge' has no attribute {name!r}")
