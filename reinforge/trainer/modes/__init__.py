"""Off-policy training modes (``trainer.mode``): one_step_off and async; sync is ``RLTrainer`` itself.

A mode is built from the config and the few trainer functions it calls (``TrainerCalls``). It
hands the trainer generated, scored batches (``next_batch``) and trains on them (``train``, which
ends in ``TrainerCalls.train_on_batch``); ``paused`` holds its background work still for a
checkpoint, whose part it provides with ``state_dict``.
"""

from __future__ import annotations

from reinforge.config.schema import Config
from reinforge.trainer.modes.async_mode import AsyncMode
from reinforge.trainer.modes.one_step_off import OneStepOffMode
from reinforge.trainer.modes.trainer_calls import TrainerCalls


def build_mode(config: Config, calls: TrainerCalls) -> AsyncMode | OneStepOffMode | None:
    """The mode ``config.trainer.mode`` names; None for sync."""
    mode = config.trainer.mode
    if mode == "async":
        return AsyncMode(config, calls)
    if mode == "one_step_off":
        return OneStepOffMode(config, calls)
    return None
