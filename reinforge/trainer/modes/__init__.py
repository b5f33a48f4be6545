"""Off-policy training modes (``trainer.mode``): one_step_off and async; sync is ``RLTrainer`` itself.

A mode hands the trainer generated, scored batches (``next_batch``) and trains on them
(``train``, which ends in ``RLTrainer.train_on_batch``); ``paused`` holds its background work
still for a checkpoint, whose part it provides with ``state_dict``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reinforge.trainer.modes.async_trainer import AsyncMode
from reinforge.trainer.modes.one_step_off import OneStepOffMode

if TYPE_CHECKING:
    from reinforge.trainer.rl_trainer import RLTrainer


def build_mode(trainer: RLTrainer) -> AsyncMode | OneStepOffMode | None:
    mode = trainer.config.trainer.mode
    if mode == "async":
        return AsyncMode(trainer)
    if mode == "one_step_off":
        return OneStepOffMode(trainer)
    return None
