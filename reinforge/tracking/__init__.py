"""Where a run's numbers go: the console, ``metrics.jsonl``, TensorBoard, W&B, MLflow; and plots of runs.

``Tracker`` is what the trainer uses; ``reinforge.tracking.plots`` (matplotlib, imported on
demand) draws a run's ``metrics.jsonl``.
"""

from reinforge.tracking.backends import (
    TRACKING_BACKENDS,
    RunInfo,
    TrackingBackend,
    backend_problem,
    missing_backend_package,
    register_tracking_backend,
)
from reinforge.tracking.console import StepProgress
from reinforge.tracking.jsonl import METRICS_FILE, SAMPLES_FILE, read_json_lines, truncate_after_step
from reinforge.tracking.tracker import Tracker, to_float

__all__ = [
    "METRICS_FILE", "SAMPLES_FILE", "TRACKING_BACKENDS", "RunInfo", "StepProgress", "Tracker", "TrackingBackend",
    "backend_problem", "missing_backend_package", "read_json_lines", "register_tracking_backend", "to_float", "truncate_after_step",
]
