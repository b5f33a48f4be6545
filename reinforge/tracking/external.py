"""Backends that hand metrics to other tools: TensorBoard, Weights & Biases, MLflow.

Each imports its package only when asked for, and says in one line how to install it when it
is missing (the ``reinforge[tracking]`` extra has all three).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from reinforge.tracking.backends import RunInfo, TrackingBackend, import_optional, register_tracking_backend


@register_tracking_backend("tensorboard", needs=("tensorboard", "tensorboard"))
class TensorBoardBackend(TrackingBackend):
    """Event files under ``RUN_DIR/tensorboard``."""

    def __init__(self, run: RunInfo):
        self._writer_cls = import_optional("torch.utils.tensorboard", "tensorboard", "tensorboard").SummaryWriter
        self.log_dir = run.run_dir / "tensorboard"
        self._writer = self._writer_cls(log_dir=str(self.log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def truncate_after(self, step: int) -> None:
        self._writer.close()
        self._writer = self._writer_cls(log_dir=str(self.log_dir), purge_step=step + 1)

    def close(self) -> None:
        self._writer.close()


@register_tracking_backend("wandb", needs=("wandb", "wandb"))
class WandbBackend(TrackingBackend):
    def __init__(self, run: RunInfo):
        self._wandb = import_optional("wandb", "wandb", "wandb")
        self._run = self._wandb.init(project=run.project, name=run.experiment, dir=str(run.run_dir),
                                     config=dict(run.config or {}))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        columns = list(dict.fromkeys(key for row in rows for key in row))
        table = self._wandb.Table(columns=["step", *columns],
                                  data=[[step, *(row.get(column) for column in columns)] for row in rows])
        self._run.log({"samples": table}, step=step)

    def close(self) -> None:
        self._run.finish()


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= _flatten(value, f"{name}.")
        else:
            flat[name] = value
    return flat


MLFLOW_PARAM_LIMIT = 500
"""MLflow refuses parameter values longer than this (characters)."""


def mlflow_metric_name(key: str) -> str:
    """The name a metric gets in MLflow: ``timing_s/gen/gc`` -> ``timing_s/gen.gc``, ``acc/mean@4`` -> ``acc/mean_at_4``.

    MLflow's file store keeps each metric in a file named by the metric, so ``timing_s/gen`` (a
    file) and ``timing_s/gen/gc`` (a file in a folder ``timing_s/gen``) cannot both be logged: the
    second crashes the run. The first ``/`` is kept, since MLflow's UI groups charts by it, and
    later ones become ``.``; a section is then one folder of files and no name is another's folder
    (our only metric without a ``/`` is none of the sections). The same names go to every MLflow
    store. Characters MLflow refuses become ``_`` ('@' becomes '_at_').
    """
    section, slash, rest = key.replace("@", "_at_").partition("/")
    return re.sub(r"[^\w\-./ ]", "_", section + slash + rest.replace("/", "."))


@register_tracking_backend("mlflow", needs=("mlflow", "mlflow"))
class MlflowBackend(TrackingBackend):
    """Metrics under ``mlflow_metric_name``'s names (see there why), the config as parameters."""

    def __init__(self, run: RunInfo):
        self._mlflow = import_optional("mlflow", "mlflow", "mlflow")
        self._mlflow.set_experiment(run.project)
        self._mlflow.start_run(run_name=run.experiment)
        params = {key: str(value)[:MLFLOW_PARAM_LIMIT] for key, value in _flatten(run.config or {}).items()}
        if params:
            self._mlflow.log_params(params)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._mlflow.log_metrics({mlflow_metric_name(key): value for key, value in metrics.items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()
