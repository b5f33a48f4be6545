"""Tracker: the trainer's one place to send metrics, samples and progress.

``Tracker(run_dir, ["console", "wandb"])`` builds the named backends, and jsonl whatever the list says
(``metrics.jsonl`` is the run folder's own record, read by plots, resume and ``reinforge bench``), and fans
every ``log(metrics, step)`` out to them, after turning values (Python numbers, numpy scalars,
one-element tensors) into floats. A backend that fails to start stops the run at once with the
reason, rather than losing metrics silently later.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch
from rich.console import Console

# The modules below register their backends on import.
from reinforge.tracking import console as _console  # noqa: F401
from reinforge.tracking import external as _external  # noqa: F401
from reinforge.tracking import jsonl as _jsonl  # noqa: F401
from reinforge.tracking import plots as _plots  # noqa: F401
from reinforge.tracking.backends import TRACKING_BACKENDS, RunInfo, TrackingBackend
from reinforge.tracking.console import StepProgress
from reinforge.tracking.jsonl import write_failure


def to_float(key: str, value: Any) -> float:
    """A metric value as a float; a value that is not one number raises, naming the key."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {key!r} is a tensor of shape {tuple(value.shape)}; log one number per key "
                             f"(for example its mean)")
        return float(value.item())
    if isinstance(value, np.ndarray) and value.size == 1:
        return float(value.reshape(()))
    if isinstance(value, bool | numbers.Real | np.number | np.bool_):
        return float(value)
    raise ValueError(f"metric {key!r} has a {type(value).__name__} value ({value!r:.60}); metrics are numbers")


class Tracker:
    """Metrics of a run, sent to every backend in ``backends`` (console, jsonl, plots, tensorboard, wandb, mlflow)."""

    def __init__(self, run_dir: str | Path, backends: Sequence[str] = ("console", "jsonl", "plots"), *,
                 project: str = "reinforge", experiment: str = "default",
                 config: Mapping[str, Any] | None = None, console: Console | None = None):
        unknown = [name for name in backends if name not in TRACKING_BACKENDS]
        if unknown:
            raise ValueError(f"unknown tracking backend(s) {unknown} in trainer.loggers; "
                             f"known backends: {sorted(TRACKING_BACKENDS)}")
        self.run_dir = Path(run_dir)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise write_failure(self.run_dir, error, "the run folder, trainer.output_dir") from None
        self.console = console or Console()
        self.backend_names = list(dict.fromkeys([*backends, "jsonl"]))  # metrics.jsonl: the run folder's own record
        run = RunInfo(self.run_dir, project, experiment, config, self.console)
        self.backends: dict[str, TrackingBackend] = {}
        name = ""
        try:
            for name in self.backend_names:
                self.backends[name] = TRACKING_BACKENDS[name](run)
        except OSError as error:  # a file or folder the backend makes in the run folder
            self.close()
            path = Path(error.filename) if isinstance(error.filename, str) and error.filename else self.run_dir
            raise write_failure(path, error, f"a file of the {name} logger, trainer.loggers") from None
        except BaseException:
            self.close()
            raise

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        values = {key: to_float(key, value) for key, value in metrics.items()}
        for backend in self.backends.values():
            backend.log(values, int(step))

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Generations of this step; the jsonl backend appends them to ``RUN_DIR/samples.jsonl``."""
        for backend in self.backends.values():
            backend.log_samples(int(step), rows)

    def truncate_after(self, step: int) -> None:
        """Call after resuming from the checkpoint of ``step``: drops what was logged after it."""
        for backend in self.backends.values():
            backend.truncate_after(int(step))

    def progress(self, total_steps: int, initial: int = 0) -> StepProgress:
        """A progress bar over steps, drawn when the console backend is on (a silent counter otherwise)."""
        return StepProgress(self.console, total_steps, initial, enabled="console" in self.backends)

    def close(self) -> None:
        """Close every backend, the charts last (they read the whole ``metrics.jsonl``): one that fails, or a Ctrl-C
        while the charts draw, still leaves the others closed (W&B and MLflow finish their runs)."""
        backends, self.backends = self.backends, {}
        _close_each(sorted(backends.values(), key=lambda backend: isinstance(backend, _plots.PlotsBackend)))

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def _close_each(backends: list[TrackingBackend]) -> None:
    """``close()`` each of ``backends`` in order, every one of them whatever the others raise (the first error
    raised after all have closed)."""
    if not backends:
        return
    try:
        backends[0].close()
    finally:
        _close_each(backends[1:])
