"""What the RL and SFT trainers share: resuming a run folder and the step loop around ``train_step``.

A trainer subclasses ``TrainingRun`` and provides ``train_step``, ``validate``,
``write_checkpoint`` and ``load_checkpoint_state`` (its models and optimizers, plus anything
else its checkpoint holds, declared by ``checkpoint_extras``). ``open_run_folder`` comes first,
before any model loads: it locks the folder, picks the checkpoint to resume from (the newest
that validates), refuses settings the checkpoint cannot take and writes ``config.yaml``.
``save`` and ``resume`` handle the rest (data loader position, RNG, step); ``resume`` also
drops what was logged after the checkpoint (everything, when the run starts at step 0), so
``metrics.jsonl`` and ``samples.jsonl`` are exact after a kill at any point; ``run_steps`` trains to ``total_steps``, validating and saving on the
configured cadence and always at the last step. A run resumed at its last step trains nothing
and reports the metrics that step logged. A run asked to stop (``stop_requested``, checked after each step is
logged) ends after that step, saved as at its last one.

A run whose steps draw a varying number of batches (DAPO's dynamic sampling) cannot know its
number of steps in advance: it ends when its epochs' data is used up (``data_used_up``), like
verl's loop over epochs. Data that runs out in the middle of a step (``DataExhausted``) drops
that step's batches: the last step trained becomes the final one, validated and saved then if
its cadence did not already, and the run fails when no step was trained at all.

A step whose batch must not reach the optimizer (``StepSkipped``: its tools all failed, their service down) is
logged as ``training/skipped_step`` with its rollout's metrics, and redone on the same prompts; the step counter
stays, so no checkpoint is ever written past an untrained step. After ``SKIPPED_ATTEMPTS`` skips in a row (or one
that cannot be redone: an off-policy mode's batch generated ahead) the run stops in one line, and running the same
command again, once the service is back, resumes from the checkpoint before that step and trains it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from reinforge.config import config_to_dict, save_config
from reinforge.protocol import Batch
from reinforge.tracking import Tracker
from reinforge.tracking.jsonl import METRICS_FILE, read_json_lines, write_failure
from reinforge.trainer.checkpoint import CheckpointManager, load_trainer_state, rng_state, set_rng_state
from reinforge.trainer.run_folder import RunLock, check_resumed_settings

logger = logging.getLogger(__name__)

STALLED_STEPS = 3
"""Training steps in a row whose every optimizer step was skipped (a gradient norm not finite) before a run stops."""


class TrainingStalled(RuntimeError):
    """Every optimizer step of several training steps in a row was skipped: the weights no longer change."""


class DataExhausted(Exception):
    """Raised by a run's ``next_batch`` when the data of its epochs is used up; the message says so in one line.

    Not a StopIteration: one raised inside a generator becomes a RuntimeError. ``fix`` is what to change when
    this ends a run before its first step."""

    def __init__(self, why: str, fix: str = "give the run more data or more epochs (trainer.total_epochs)") -> None:
        super().__init__(why)
        self.fix = fix


class NothingTrained(RuntimeError):
    """The data of the run's epochs was used up before its first step was complete."""


SKIPPED_ATTEMPTS = 3
"""Times in a row a step may be skipped (``StepSkipped``) before the run stops."""


class StepSkipped(Exception):
    """Raised by a trainer's ``train_step`` when its batch must not be applied to the optimizer (every tool call
    failed: a service down), before any update: the weights and optimizer state stay as they were.

    ``metrics``: what the step measured (its rollout's, which show the failure); ``can_redo``: the same batch of
    prompts may be passed to ``train_step`` again (False when the batch was generated ahead, in an off-policy mode)."""

    def __init__(self, reason: str, metrics: dict[str, float], can_redo: bool = True) -> None:
        super().__init__(reason)
        self.reason, self.metrics, self.can_redo = reason, metrics, can_redo


class StepsSkipped(RuntimeError):
    """A step was skipped ``SKIPPED_ATTEMPTS`` times in a row (or could not be redone); the run stops before it."""


def all_updates_skipped(metrics: dict[str, Any]) -> list[str]:
    """The roles (actor, critic, train) whose optimizer skipped every step of this training step: their mean
    finite gradient norm is NaN because none was finite."""
    return [key.rsplit("/", 1)[0] for key, value in metrics.items()
            if key.endswith("/grad_norm") and isinstance(value, float) and value != value
            and metrics.get(key.rsplit("/", 1)[0] + "/num_skipped_steps", 1.0) > 0]


class TrainingRun:
    config: Any
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

    def stop_requested(self) -> bool:
        """Whether the run is asked to end after the step just logged (checked once it is logged); the Python API
        replaces it with its callbacks' ``control.should_training_stop``."""
        return False

    def data_used_up(self) -> str | None:
        """None while the data of the run's epochs lasts; then one line saying it is used up.

        Only a run whose steps draw a varying number of batches says so (its ``total_steps`` is an upper
        bound); every other run's ``total_steps`` is exactly its epochs' batches."""
        return None

    def open_run_folder(self, resume: str, keep_last: int, refused: tuple[str, ...]) -> None:
        """Lock ``self.run_dir``, choose the checkpoint to resume from and write ``config.yaml``.

        ``refused``: settings (keys, or prefixes ending in '.') that a resumed run may not change.
        """
        self.run_lock = RunLock(self.run_dir).acquire()
        with self.run_folder_released_on_failure():
            self._choose_checkpoint(resume, keep_last, refused)

    @contextlib.contextmanager
    def run_folder_released_on_failure(self) -> Iterator[None]:
        """Release the run folder's lock when the block raises: a run refused while it starts (a setting its
        checkpoint cannot take, a tokenizer that fails to load) frees the folder at once, not when the trainer is
        garbage-collected, which a caller holding the exception (a notebook, a test) delays."""
        try:
            yield
        except BaseException:
            self.release_run_folder()
            raise

    def _choose_checkpoint(self, resume: str, keep_last: int, refused: tuple[str, ...]) -> None:
        self.checkpoints = CheckpointManager(self.run_dir, keep_last)
        self._resume_folder = self.checkpoints.resolve(resume)
        self._resume_state: dict[str, Any] | None = None
        if self._resume_folder is not None:
            self._resume_state = load_trainer_state(self._resume_folder)
            check_resumed_settings(self._resume_state.get("config"), config_to_dict(self.config), refused,
                                   self._resume_folder)
            self.checkpoints.remove_old()  # what a kill interrupted: a half-written checkpoint, an older one
        self._remove_old_checkpoints = resume == "never"  # done in resume(): after data, tokenizer and workers load
        try:
            save_config(self.config, self.run_dir / "config.yaml")
        except OSError as error:
            self.release_run_folder()
            raise write_failure(self.run_dir / "config.yaml", error, "the run's config") from None

    def release_run_folder(self) -> None:
        lock = getattr(self, "run_lock", None)
        if lock is not None:
            lock.release()

    def save(self) -> Path:
        """An atomic checkpoint of the current step; returns its folder."""
        state = {"step": self.step, "loader": self.train_loader.state_dict(), **self.checkpoint_extras(),
                 "rng": rng_state(), "config": config_to_dict(self.config)}
        folder = self.checkpoints.save(self.step, self.write_checkpoint, state)
        logger.info("saved checkpoint %s", folder)
        return folder

    def resume(self) -> None:
        """Continue from the checkpoint ``open_run_folder`` chose; without one, drop what an earlier try logged."""
        folder, state = self._resume_folder, self._resume_state
        if folder is None or state is None:
            if getattr(self, "_remove_old_checkpoints", False) and (removed := self.checkpoints.remove_all()):
                logger.warning("trainer.resume=never: removed the %d checkpoint(s) of the earlier run in %s", removed,
                               self.checkpoints.root)
            self.tracker.truncate_after(-1)
            return
        self.load_checkpoint_state(folder, state)
        self.train_loader.load_state_dict(state["loader"])
        set_rng_state(state["rng"])
        self.step = state["step"]
        self.tracker.truncate_after(self.step)
        logger.info("resumed from %s at step %d", folder, self.step)

    def run_steps(self, next_batch: Callable[[], Batch], *, test_every: int, save_every: int,
                  validate_first: bool) -> dict[str, float]:
        """Train from ``self.step`` to ``total_steps`` or until the data is used up; returns the last step's
        metrics."""
        last_metrics: dict[str, float] = {}
        used_up = self.data_used_up()
        if self.step >= self.total_steps or used_up:
            logger.info("the run is already at its final step %d%s; nothing to train", self.step,
                        f" ({used_up})" if used_up else "")
            last_metrics = self.logged_metrics(self.step)
        if self.step == 0 and validate_first:
            last_metrics = self.validate()
            if last_metrics:
                self.tracker.log(last_metrics, step=0)
        stalled = skipped = 0
        batch = None
        with self.tracker.progress(self.total_steps, initial=self.step) as progress:
            while self.step < self.total_steps and not used_up:
                try:
                    batch = batch if skipped else next_batch()  # a skipped step is redone on the same prompts
                    metrics = self.train_step(batch)
                except DataExhausted as exhausted:
                    return self._end_with_the_data(exhausted, last_metrics, test_every)
                except StepSkipped as skip:
                    skipped += 1
                    self._skip_step(skip, skipped)
                    continue
                skipped = 0
                self.step += 1
                metrics["training/global_step"] = self.step
                metrics["training/epoch"] = self.train_loader.epoch
                used_up = self.data_used_up()
                if used_up:
                    metrics["training/data_used_up"] = 1.0
                is_last = self.step == self.total_steps or used_up is not None
                if test_every > 0 and self.step % test_every == 0 or is_last:
                    metrics |= self.validate()
                self.tracker.log(metrics, step=self.step)
                progress.advance(metrics)
                stopping = not is_last and self.stop_requested()
                if save_every > 0 and self.step % save_every == 0 or is_last or stopping:
                    self.save()
                last_metrics = metrics
                if stopping:
                    logger.info("the run ends after step %d (of %d), as asked", self.step, self.total_steps)
                    break
                roles = all_updates_skipped(metrics)
                stalled = stalled + 1 if roles else 0
                if stalled >= STALLED_STEPS:
                    raise TrainingStalled(
                        f"steps {self.step - stalled + 1}-{self.step}: every optimizer step of {', '.join(roles)} was "
                        "skipped because the gradient norm was not finite, so the weights no longer change (the "
                        f"metrics and checkpoints so far are in {self.run_dir}); look for NaN or inf in the loss and "
                        "the weights: lower the learning rate, or check the rewards and model.lora.alpha")
        if used_up and self.step < self.total_steps:
            logger.info("the run ends after step %d (of at most %d): %s", self.step, self.total_steps, used_up)
        return last_metrics

    def _skip_step(self, skip: StepSkipped, attempts: int) -> None:
        """Log step ``self.step + 1``'s skipped attempt (``training/skipped_step``) and its reason; stop the run when
        the step cannot be redone, or has been skipped ``SKIPPED_ATTEMPTS`` times in a row.

        Nothing of the step was applied and the step counter stays: no checkpoint is ever written past a step
        that was not trained, so the rerun of a run stopped here resumes before the step and trains its prompts."""
        step = self.step + 1
        self.tracker.log(skip.metrics | {"training/skipped_step": 1.0, "training/global_step": float(step)}, step=step)
        logger.warning("step %d skipped, nothing applied to the weights or the optimizer (attempt %d of %d): %s",
                       step, attempts, SKIPPED_ATTEMPTS, skip.reason)
        if skip.can_redo and attempts < SKIPPED_ATTEMPTS:
            return
        tries = f"{attempts} time(s) in a row" if skip.can_redo else "and cannot be redone in this run"
        last = self.checkpoints.latest()
        resumes = f"from {last.name}" if last is not None else "from the start"
        raise StepsSkipped(f"step {step} was skipped {tries}: {skip.reason}; nothing of it was applied to the weights "
                           f"or the optimizer; fix the tools' service and run the same command again: it resumes "
                           f"{resumes} and trains step {step} (metrics and checkpoints so far are in {self.run_dir})")

    def _end_with_the_data(self, exhausted: DataExhausted, last_metrics: dict[str, float],
                           test_every: int) -> dict[str, float]:
        """The data ran out inside step ``self.step + 1``: step ``self.step`` becomes the final one.

        It is validated and saved now unless its cadence did that already (or its checkpoint is the one this
        run resumed from), so the run ends with its final checkpoint and metrics, as after its last step; a
        checkpoint saved now holds the loader at the end of the data, so resuming it trains nothing. One its
        cadence saved holds the loader before the dropped step: a rerun draws that step's batches again and
        ends here again, logging nothing twice (the step's final line is already in ``metrics.jsonl``). A run
        that trained no step fails: exiting 0 would pass off an empty run folder as a trained model."""
        if self.step == 0:
            raise NothingTrained(f"nothing was trained (the first step was not complete): {exhausted}; {exhausted.fix}")
        logger.info("the run ends after step %d (of at most %d): %s", self.step, self.total_steps, exhausted)
        logged = self.logged_metrics(self.step)
        if "training/data_used_up" in logged:  # a rerun of this run, resumed from its final step's checkpoint
            return last_metrics or logged
        final = {"training/data_used_up": 1.0}
        if not (test_every > 0 and self.step % test_every == 0):
            final |= self.validate()
        self.tracker.log(final, step=self.step)
        if not self.checkpoints.folder_of(self.step).is_dir():  # saved by its cadence, or resumed from
            self.save()
        return (last_metrics or self.logged_metrics(self.step)) | final

    def logged_metrics(self, step: int) -> dict[str, float]:
        """What ``metrics.jsonl`` holds for ``step`` (empty without the jsonl logger), less the rows of its skipped
        attempts (``training/skipped_step``), which the step's redo trained over."""
        path = self.run_dir / METRICS_FILE
        merged: dict[str, float] = {}
        for record in read_json_lines(path) if path.is_file() else []:
            if record.get("step") == step and not record.get("training/skipped_step"):
                # null: a NaN or an infinity, which strict JSON cannot hold (tracking.jsonl.json_line)
                merged |= {key: float("nan") if value is None else value for key, value in record.items() if key != "step"}
        return merged


class SupervisedRun(TrainingRun):
    """A run over a dataset of its own, no rollout (SFT, DPO, reward models): ``fit`` trains to ``total_steps``,
    validating and saving as ``config.trainer`` says. Needs ``train_loader.next_batch`` and ``val_loader``."""

    val_loader: Any

    def before_training(self) -> None:
        """Runs after the checkpoint is restored, before the first step (DPO scores its reference earlier, in
        ``resume``, before the checkpoint loads)."""

    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps``; returns the last step's metrics (with the final validation's)."""
        trainer = self.config.trainer
        try:
            self.resume()
            self.before_training()
            return self.run_steps(self.train_loader.next_batch, test_every=trainer.test_every,
                                  save_every=trainer.save_every,
                                  validate_first=self.val_loader is not None and trainer.val_before_train)
        finally:
            self.tracker.close()
            self.release_run_folder()

    def final_model_dir(self) -> Path | None:
        """The ``hf/`` folder of the latest checkpoint."""
        latest = self.checkpoints.latest()
        return latest / "hf" if latest is not None else None
