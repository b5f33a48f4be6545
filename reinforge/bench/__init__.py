"""Benchmarks behind ``reinforge bench``: ``rollout`` (the native engine against ``generate``) and ``train``
(full RL steps, phase by phase). They measure; nothing in the library imports them."""
