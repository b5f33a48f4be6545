"""reinforge: post-train language models with reinforcement learning."""

__version__ = "0.1.0"
