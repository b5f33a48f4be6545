"""What the RL and SFT trainers share: resuming a run folder and the step loop around ``train_step``.

A trainer subclasses ``TrainingRun`` and provides ``train_step``, ``validate``,
``write_checkpoint`` and ``load_checkpoint_state`` (its models and optimizers, plus anything
else its checkpoint holds, declared by ``checkpoint_extras``). ``save`` and ``resume`` handle
the rest (data loader position, RNG, step); ``resume`` also drops metrics logged after the
checkpoint; ``run_steps`` trains to ``total_steps``, validating and saving on the
configured cadence and always at the last step. A run resumed at its last step trains nothing
and reports the metrics that step logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reinforge.protocol import Batch
from reinforge.tracking import Tracker
from reinforge.tracking.jsonl import METRICS_FILE, read_json_lines
from reinforge.trainer.checkpoint import CheckpointManager, load_trainer_state, rng_state, set_rng_state

logger = logging.getLogger(__name__)


class TrainingRun:
    run_dir: Path
    tracker: Tracker
    checkpoints: CheckpointManager
    train_loader: Any
    """Has ``epoch``, ``state_dict()`` and ``load_state_dict()``."""
    step: int
    total_steps: int

    def train_step(self, batch: Batch) -> dict[str, float]:
        raise NotImplementedError

    def validate(self) -> dict[str, float]:
        raise NotImplementedError

    def write_checkpoint(self, folder: Path) -> None:
        """Write this trainer's own parts of a checkpoint (models, optimizers) into ``folder``."""
        raise NotImplementedError

    def checkpoint_extras(self) -> dict[str, Any]:
        """What this trainer adds to trainer_state.pt besides the step, the loader and the RNG."""
        return {}

    def load_checkpoint_state(self, folder: Path, state: dict[str, Any]) -> None:
        """Restore this trainer's own parts of the checkpoint in ``folder`` (``state``: trainer_state.pt)."""
        raise NotImplementedError

    def save(self) -> Path:
        """An atomic checkpoint of the current step; returns its folder."""
        state = {"step": self.step, "loader": self.train_loader.state_dict(), **self.checkpoint_extras(),
                 "rng": rng_state()}
        folder = self.checkpoints.save(self.step, self.write_checkpoint, state)
        logger.info("saved checkpoint %s", folder)
        return folder

    def resume(self, spec: str) -> None:
        """Continue from the checkpoint ``spec`` names (auto, never or a path), if there is one."""
        folder = self.checkpoints.resolve(spec)
        if folder is None:
            return
        state = load_trainer_state(folder)
        self.load_checkpoint_state(folder, state)
        self.train_loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        self.step = state["step"]
        self.tracker.truncate_after(self.step)
        logger.info("resumed from %s at step %d", folder, self.step)

    def run_steps(self, next_batch: Callable[[], Batch], *, test_every: int, save_every: int,
                  validate_first: bool) -> dict[str, float]:
        """Train from ``self.step`` to ``total_steps``; returns the last step's metrics."""
        last_metrics: dict[str, float] = {}
        if self.step >= self.total_steps:
            logger.info("the run is already at its final step %d; nothing to train", self.step)
            last_metrics = self.logged_metrics(self.step)
        if self.step == 0 and validate_first:
            last_metrics = self.validate()
            if last_metrics:
                self.tracker.log(last_metrics, step=0)
        with self.tracker.progress(self.total_steps, initial=self.step) as progress:
            while self.step < self.total_steps:
                metrics = self.train_step(next_batch())
                self.step += 1
                metrics["training/global_step"] = self.step
                metrics["training/epoch"] = self.train_loader.epoch
                is_last = self.step == self.total_steps
                if test_every > 0 and self.step % test_every == 0 or is_last:
                    metrics |= self.validate()
                self.tracker.log(metrics, step=self.step)
                progress.advance(metrics)
                if save_every > 0 and self.step % save_every == 0 or is_last:
                    self.save()
                last_metrics = metrics
        return last_metrics

    def logged_metrics(self, step: int) -> dict[str, float]:
        """What ``metrics.jsonl`` holds for ``step`` (empty without the jsonl logger)."""
        path = self.run_dir / METRICS_FILE
        merged: dict[str, float] = {}
        for record in read_json_lines(path) if path.is_file() else []:
            if record.get("step") == step:
                merged |= {key: value for key, value in record.items() if key != "step"}
        return merged
