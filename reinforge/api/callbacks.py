"""TRL's (transformers') view of a run while it trains: ``trainer.state`` with its ``log_history``, and the
``TrainerCallback`` objects a script hands the trainer, called as each step's metrics are logged.

A step's metrics keep reinforge's names (``actor/pg_loss``, ``critic/score/mean``) and get TRL's beside them
(``loss``, ``reward``, ``learning_rate``, ``grad_norm``...), so a script reading ``log_history[-1]["loss"]`` or
``logs["reward"]`` in ``on_log`` finds them.

Steps count as TRL counts them, in optimizer steps: a reinforge RL step that generates once and makes ``updates``
optimizer steps (steps_per_generation, num_iterations) is TRL's steps ``(step - 1) * updates + 1 .. step *
updates``, each with its ``on_step_end``, then one ``on_log``. A callback's ``control.should_training_stop`` ends
the run after the reinforge step it was set in (a checkpoint saved, as at the last step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from reinforge.tracking.backends import TrackingBackend

logger = logging.getLogger(__name__)

TRL_METRIC_NAMES = {
    "loss": ("train/loss", "actor/pg_loss"),
    "grad_norm": ("train/grad_norm", "actor/grad_norm"),
    "learning_rate": ("train/lr", "actor/lr"),
    "reward": ("critic/score/mean",),
    "kl": ("actor/kl_loss",),
    "entropy": ("actor/entropy",),
    "completions/mean_length": ("response_length/mean",),
    "completions/min_length": ("response_length/min",),
    "completions/max_length": ("response_length/max",),
    "completions/clipped_ratio": ("response_length/clip_ratio",),
    "eval_loss": ("val/loss",),
    "epoch": ("training/epoch",),
}
"""TRL's name of a logged metric -> reinforge's names for it, the first one logged taken."""

CALLBACK_EVENTS = ("on_init_end", "on_train_begin", "on_step_end", "on_log", "on_train_end")
"""The TrainerCallback events a reinforge run calls; the others (on_step_begin, on_save, on_evaluate...) it does not."""


def trl_logs(metrics: dict[str, float]) -> dict[str, float]:
    """A step's metrics with TRL's names added."""
    logs = dict(metrics)
    for name, sources in TRL_METRIC_NAMES.items():
        source = next((source for source in sources if source in metrics), None)
        if source is not None and name not in logs:
            logs[name] = metrics[source]
    return logs


def make_state(max_steps: int, history: list[dict[str, Any]]) -> Any:
    """transformers' ``TrainerState`` of a run at the end of ``history`` (its logged rows, each with TRL's
    ``step``); ``max_steps`` in TRL's steps."""
    from transformers import TrainerState

    state = TrainerState(max_steps=max_steps, log_history=history)
    state.global_step = int(history[-1]["step"]) if history else 0
    state.epoch = float(history[-1].get("epoch", 0.0)) if history else 0.0
    return state


def logged_history(run_dir: Path, last_step: int, updates: int = 1) -> list[dict[str, Any]]:
    """The rows ``metrics.jsonl`` holds up to reinforge's step ``last_step``, as TRL's log_history entries (TRL's
    steps: ``updates`` optimizer steps each)."""
    from reinforge.tracking.jsonl import METRICS_FILE, read_json_lines

    path = run_dir / METRICS_FILE
    rows = read_json_lines(path) if path.exists() else []
    return [trl_logs({key: value for key, value in row.items() if key != "step"}) | {"step": row["step"] * updates}
            for row in rows if row.get("step", 0) <= last_step]


def callback_objects(callbacks: Sequence[Any] | None) -> list[Any]:
    """TRL takes callback classes or instances; a class is made without arguments. A callback that defines events a
    reinforge run never calls (on_save, on_evaluate...) is said to, once, in a warning naming them."""
    made = []
    for callback in callbacks or ():
        callback = callback() if isinstance(callback, type) else callback
        if not any(hasattr(callback, event) for event in CALLBACK_EVENTS):
            raise TypeError(f"callbacks holds a {type(callback).__name__}, which has none of "
                            f"{', '.join(CALLBACK_EVENTS)}; pass transformers.TrainerCallback objects")
        uncalled = _uncalled_events(callback)
        if uncalled:
            logger.warning("callback %s defines %s, which a reinforge run never calls (it calls %s; validation "
                           "metrics reach on_log, checkpoints are written under output_dir/checkpoints)",
                           type(callback).__name__, ", ".join(uncalled), ", ".join(CALLBACK_EVENTS))
        made.append(callback)
    return made


def _uncalled_events(callback: Any) -> list[str]:
    """The ``on_*`` events of transformers' TrainerCallback that ``callback`` defines for itself and that a reinforge
    run does not call."""
    from transformers import TrainerCallback

    return [name for name in dir(TrainerCallback) if name.startswith("on_") and name not in CALLBACK_EVENTS
            and callable(getattr(callback, name, None))
            and getattr(type(callback), name, None) is not getattr(TrainerCallback, name)]


class CallbackHandler:
    """Calls each callback's events with TRL's arguments: (args, state, control, model=..., processing_class=...)."""

    def __init__(self, callbacks: list[Any], args: Any, state: Any) -> None:
        from transformers import TrainerControl

        self.callbacks, self.args, self.state = callbacks, args, state
        self.control = TrainerControl()

    def call(self, event: str, **kwargs: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, event, None)
            if method is None:
                continue
            returned = method(self.args, self.state, self.control, **kwargs)
            if returned is not None:
                self.control = returned

    def stop_requested(self) -> bool:
        """A callback set ``control.should_training_stop``: the run ends after the step in progress."""
        return bool(self.control.should_training_stop)


class CallbackBackend(TrackingBackend):
    """A tracker backend that puts each logged step into ``state.log_history`` and calls the callbacks: a trained
    step's ``on_step_end`` (one per optimizer step of it, ``updates``), then ``on_log`` for every row (a validation
    before training too)."""

    def __init__(self, handler: CallbackHandler, updates: int = 1,
                 epoch_now: Callable[[], float] | None = None) -> None:
        """``epoch_now``: the epochs of data the run has used (fractional, as TRL's ``state.epoch``); None: the
        logged ``training/epoch`` (whole epochs)."""
        self.handler = handler
        self.updates = updates
        self.epoch_now = epoch_now

    def log(self, metrics: dict[str, float], step: int) -> None:
        state = self.handler.state
        logs = trl_logs(metrics)
        if self.epoch_now is not None and step > 0:  # a trained step's row (a validation before training is step 0)
            logs["epoch"] = float(self.epoch_now())
        if "epoch" in logs:
            state.epoch = float(logs["epoch"])
        if "training/global_step" in metrics and not metrics.get("training/skipped_step"):
            for optimizer_step in range((step - 1) * self.updates + 1, step * self.updates + 1):
                state.global_step = optimizer_step
                self.handler.call("on_step_end")
        state.global_step = step * self.updates
        state.log_history.append(logs | {"step": state.global_step})
        self.handler.call("on_log", logs=logs)

    def truncate_after(self, step: int) -> None:
        state = self.handler.state
        state.log_history[:] = [row for row in state.log_history if row.get("step", 0) <= step * self.updates]
