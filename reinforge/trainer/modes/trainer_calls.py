"""What an off-policy mode uses of the trainer: a few functions and values, handed in by ``RLTrainer``.

A mode draws prompts, generates on the rollout's worker group, scores, recomputes log-probs for
the decoupled loss, runs the trainer's step on a generated batch and syncs the rollout's weights;
it sees nothing else of the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reinforge.controller.worker_group import GroupFuture
from reinforge.protocol import Batch
from reinforge.rollout.base import SamplingParams


@dataclass(frozen=True)
class TrainerCalls:
    next_prompts: Callable[[], Batch]
    """The loader's next batch of prompts, one row per prompt (raises ``DataExhausted`` once used up)."""
    generate: Callable[[Batch, SamplingParams, int], GroupFuture]
    """Submit ``generate(batch, sampling, seed)`` to the group that generates (the rollout group with
    trainer.separate_rollout, else actor_rollout); the future's ``result()`` is the generated batch."""
    score: Callable[[Batch], Batch]
    """The reward group's scores of a generated batch (``token_level_scores`` and the scorer's extras)."""
    compute_log_prob: Callable[[Batch], Batch]
    """The actor's log-probs of a batch with the weights before the update (the proximal policy)."""
    train_on_batch: Callable[[Batch, dict[str, float], dict[str, float], float], dict[str, float]]
    """``RLTrainer.train_on_batch(batch, timing, metrics, step_start)``: the step after generation and scoring."""
    sync_rollout_weights: Callable[[], None]
    """The rollout generates with the current weights from now on (a new version)."""
    trained_steps: Callable[[], int]
    """Steps trained so far (the run's step counter, which moves after each step is logged)."""
    sampling: SamplingParams
    """The training rollout's sampling parameters."""
    pad_token_id: int
    run_dir: Path
    rollout_copy_weights: Callable[[], Any] | None = None
    """The generating group's own copy of the weights (the last synced version), on the CPU: a dict, or a list
    per rank whose first item is it; None where the rollout has no copy of its own."""
    load_rollout_weights: Callable[[Any], None] | None = None
    """Put weights from ``rollout_copy_weights`` back into the generating group's copy."""
