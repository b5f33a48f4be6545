"""The generation seed of a training step, shared by the sync step and the off-policy modes.

Every step's requests get their own seed, and a prompt drawn for step k is generated with the
same seed in every mode (sync, one_step_off, async), so a mode that samples with the current
weights samples what the sync trainer samples.
"""

from __future__ import annotations


def step_seed(seed: int, step: int) -> int:
    """The seed of the generation of step ``step`` (0-based: the ``step``-th prompt batch drawn) of a run
    seeded ``seed`` (``trainer.seed``); the workers derive each request's seed from it and the prompt's uid."""
    return seed * 1_000_003 + step
