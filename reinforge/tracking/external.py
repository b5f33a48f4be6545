"""Backends that hand metrics to other tools: TensorBoard, Weights & Biases, MLflow.

Each imports its package only when asked for, and says in one line how to install it when it
is missing (the ``reinforge[tracking]`` extra has all three).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from types import ModuleType
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


MLFLOW_DATABASE = "mlflow.db"
"""The SQLite database in the run folder that holds the run's MLflow metrics, unless MLFLOW_TRACKING_URI says otherwise."""


def _file_store_path(uri: str) -> str | None:
    """The folder of MLflow's file store that ``uri`` names (a path or a file: URI), else None (a database, a server)."""
    scheme = uri.split("://", 1)[0] if "://" in uri else ("file" if uri.startswith("file:") else "")
    if scheme == "file":
        return uri.removeprefix("file://").removeprefix("file:")
    return uri if not scheme and not uri.startswith(("databricks", "uc")) else None  # databricks: a named store


def mlflow_store_problem() -> str | None:
    """One line when MLFLOW_TRACKING_URI names a file store that the installed MLflow refuses, else None.

    MLflow 3 keeps its file store in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE=true;
    asked before any model loads (MLflow itself is imported only for such a URI)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    folder = _file_store_path(uri) if uri else None
    if folder is None:
        return None
    from mlflow import environment_variables

    allowed = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)
    if allowed is None or allowed.get():
        return None
    return (f"MLFLOW_TRACKING_URI={uri} (environment) is MLflow's file store, which this MLflow refuses (maintenance "
            "mode); unset MLFLOW_TRACKING_URI to keep the metrics in RUN_DIR/mlflow.db, point it at a database "
            f"(sqlite:///{folder.rstrip('/')}.db) or a server, or set MLFLOW_ALLOW_FILE_STORE=true")


def chosen_tracking_uri(mlflow: ModuleType) -> str | None:
    """The MLflow store a user chose (MLFLOW_TRACKING_URI, or ``mlflow.set_tracking_uri`` in this process), else None."""
    is_set = getattr(mlflow, "is_tracking_uri_set", None)
    if os.environ.get("MLFLOW_TRACKING_URI", "").strip() or (is_set is not None and is_set()):
        return mlflow.get_tracking_uri()
    return None


@register_tracking_backend("mlflow", needs=("mlflow", "mlflow"), check=mlflow_store_problem)
class MlflowBackend(TrackingBackend):
    """A run of experiment ``project`` named ``experiment``: in the store a user chose (``chosen_tracking_uri``),
    else in ``RUN_DIR/mlflow.db`` (``mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db``); metrics under
    ``mlflow_metric_name``'s names (see there why), the config as parameters.

    It goes through its own ``MlflowClient``, so a caller's active MLflow run and tracking URI are left alone.
    """

    def __init__(self, run: RunInfo):
        mlflow = import_optional("mlflow", "mlflow", "mlflow")
        chosen = chosen_tracking_uri(mlflow)
        run_dir = run.run_dir.resolve()
        self.tracking_uri = chosen or f"sqlite:///{run_dir / MLFLOW_DATABASE}"
        self._client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        experiment = self._client.get_experiment_by_name(run.project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # in the run folder's own database, its artifacts go in the run folder too
            artifacts = None if chosen else (run_dir / "mlflow-artifacts").as_uri()
            experiment_id = self._client.create_experiment(run.project, artifact_location=artifacts)
        self.run_id = self._client.create_run(experiment_id, run_name=run.experiment).info.run_id
        self._entities = mlflow.entities
        params = [self._entities.Param(key, str(value)[:MLFLOW_PARAM_LIMIT])
                  for key, value in _flatten(run.config or {}).items()]
        if params:
            self._client.log_batch(self.run_id, params=params)

    def log(self, metrics: dict[str, float], step: int) -> None:
        timestamp = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[
            self._entities.Metric(mlflow_metric_name(key), value, timestamp, step) for key, value in metrics.items()])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
