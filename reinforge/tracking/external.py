"""Backends that hand metrics to other tools: TensorBoard, Weights & Biases, MLflow.

Each imports its package only when asked for, and says in one line how to install it when it
is missing (the ``reinforge[tracking]`` extra has all three).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import netrc
import os
import re
import time
from collections.abc import Mapping
from types import ModuleType
from typing import Any
from urllib.parse import urlparse

from reinforge.tracking.backends import (
    RunInfo,
    TrackingBackend,
    import_optional,
    record_run,
    recorded_run,
    register_tracking_backend,
)


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


WANDB_OFF_MODES = ("offline", "dryrun", "disabled")
"""WANDB_MODE values under which W&B needs no API key."""


def _netrc_has_password(host: str) -> bool:
    """``~/.netrc`` (or the file NETRC names) holds a password for ``host``: where ``wandb login`` keeps the key."""
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def _wandb_api_key_found(wandb: ModuleType) -> bool:
    """W&B has an API key here, asked without prompting: the run's settings (a ``wandb offline`` settings file needs
    none), the key in ``~/.netrc`` for W&B's host, then ``wandb.api.api_key`` (which also knows a key given to
    ``wandb.login`` in this process). Printing nothing ("Loading settings from ...", a deprecation line)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            settings: Any = wandb.sdk.wandb_setup.singleton().settings
        except Exception:  # another wandb version: ask it by its public attribute only
            settings = None
        if settings is not None and (getattr(settings, "_offline", False) or getattr(settings, "_noop", False)):
            return True
        host = urlparse(str(getattr(settings, "base_url", None) or "https://api.wandb.ai")).hostname or "api.wandb.ai"
        if _netrc_has_password(host) or getattr(settings, "api_key", None):
            return True
        return bool(wandb.api.api_key)


def wandb_login_problem() -> str | None:
    """One line when W&B would start online without an API key (it fails with 'No API key configured' only after the
    model has loaded), else None. Environment variables first: a key or an offline mode there imports nothing."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    disabled = os.environ.get("WANDB_DISABLED", "").strip().lower() in ("true", "1", "yes")
    if mode in WANDB_OFF_MODES or disabled or os.environ.get("WANDB_API_KEY", "").strip():
        return None
    try:
        if _wandb_api_key_found(importlib.import_module("wandb")):
            return None
    except Exception:  # wandb cannot tell here: it says so itself when the run starts
        return None
    return ("W&B has no API key here (no WANDB_API_KEY, none in ~/.netrc) and WANDB_MODE is "
            f"{mode or 'unset'}, so it would fail once the model has loaded; run `wandb login`, set WANDB_API_KEY, "
            "set WANDB_MODE=offline (and `wandb sync` the run folder later), or remove wandb from trainer.loggers")


@register_tracking_backend("wandb", needs=("wandb", "wandb"), check=wandb_login_problem)
class WandbBackend(TrackingBackend):
    """A W&B run of project ``project`` named ``experiment``, its files under ``RUN_DIR/wandb``.

    Its id is kept in ``RUN_DIR/tracking_ids.json``: a resumed run continues that W&B run (``resume="allow"``)
    instead of starting a second one; a run that starts over from step 0 in the folder, or a copy of the folder
    elsewhere (which would otherwise mix its steps into the original's run), starts a new W&B run.

    W&B keeps only steps above the last one it holds, so after a resume from an earlier checkpoint, the steps between
    that checkpoint and where the earlier try stopped keep the earlier try's values (W&B drops the resumed values,
    with a warning; ``metrics.jsonl`` has the resumed ones). W&B's rewind (``resume_from``) would replace them, but it
    is a preview W&B enables per account and it does not work offline, so it is not used.
    """

    def __init__(self, run: RunInfo):
        self._wandb = import_optional("wandb", "wandb", "wandb")
        self._info = run
        recorded = recorded_run(run.run_dir, "wandb")
        self._continued = (recorded is not None and recorded.get("project") == run.project
                           and recorded.get("run_dir") == str(run.run_dir.resolve()))  # a copy: a run of its own
        self._run = self._start(recorded["run_id"] if recorded is not None and self._continued else None)

    def _start(self, run_id: str | None) -> Any:
        run = self._info
        resume: dict[str, str] = {"id": run_id, "resume": "allow"} if run_id else {}
        started = self._wandb.init(project=run.project, name=run.experiment, dir=str(run.run_dir),
                                   config=dict(run.config or {}), **resume)
        try:
            record_run(run.run_dir, "wandb", {"run_id": started.id, "project": run.project,
                                              "run_dir": str(run.run_dir.resolve())})
        except BaseException:
            started.finish()
            raise
        return started

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        columns = list(dict.fromkeys(key for row in rows for key in row))
        table = self._wandb.Table(columns=["step", *columns],
                                  data=[[step, *(row.get(column) for column in columns)] for row in rows])
        self._run.log({"samples": table}, step=step)

    def truncate_after(self, step: int) -> None:
        """A run that starts over (``step`` -1) where an earlier try logged to a W&B run gets a new W&B run (the old
        one keeps what it has); a resume continues the run it has (see the class for the steps after ``step``)."""
        if step < 0 and self._continued:
            self._continued = False
            self._run.finish()
            self._run = self._start(None)

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

    Its id is kept in ``RUN_DIR/tracking_ids.json``: a resumed run continues that MLflow run (in the run folder's
    own database, wherever the folder is, or in the same chosen store from the same folder: a copy of the folder
    elsewhere starts a run of its own there), and a run that starts over from step 0 in the folder starts a new one.

    MLflow cannot delete a metric's points, so after a resume from an earlier checkpoint the steps between that
    checkpoint and where the earlier try stopped are logged again under the same step numbers: MLflow keeps both
    values (its history and charts show two points at such a step; a metric's latest value is the resumed one), while
    ``metrics.jsonl`` keeps only the resumed ones. A setting changed on resume keeps its first value among the
    parameters (MLflow refuses to change one).

    It goes through its own ``MlflowClient``, so a caller's active MLflow run and tracking URI are left alone.
    """

    def __init__(self, run: RunInfo):
        mlflow = import_optional("mlflow", "mlflow", "mlflow")
        self._mlflow = mlflow
        self._info = run
        self._chosen = chosen_tracking_uri(mlflow)
        self.tracking_uri = self._chosen or f"sqlite:///{run.run_dir.resolve() / MLFLOW_DATABASE}"
        self._client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        self._entities = mlflow.entities
        self._earlier_status: str | None = None
        """The status the continued run had before this try (it is set back there when the run starts over)."""
        earlier = self._recorded_run()
        if earlier is not None:
            self.run_id = earlier.info.run_id
            self._earlier_status = earlier.info.status
            self._client.update_run(self.run_id, status="RUNNING")
            self._log_params(set(earlier.data.params))
        else:
            self._start()

    def _store(self) -> str:
        return self._chosen or MLFLOW_DATABASE  # the run folder's own database, wherever the folder is

    def _recorded_run(self) -> Any:
        """The MLflow run that ``tracking_ids.json`` names, when it is in this store and experiment, else None."""
        recorded = recorded_run(self._info.run_dir, "mlflow")
        if recorded is None or recorded.get("store") != self._store() or recorded.get("project") != self._info.project:
            return None
        if self._chosen and recorded.get("run_dir") != str(self._info.run_dir.resolve()):
            return None  # a copy of the folder, logging to the same store: a run of its own
        try:
            earlier = self._client.get_run(recorded["run_id"])
            experiment = self._client.get_experiment(earlier.info.experiment_id)
        except self._mlflow.exceptions.MlflowException:  # deleted, or another database under the same name
            return None
        if earlier.info.lifecycle_stage != "active" or experiment.name != self._info.project:
            return None
        return earlier

    def _start(self) -> None:
        experiment = self._client.get_experiment_by_name(self._info.project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # in the run folder's own database, its artifacts go in the run folder too
            artifacts = None if self._chosen else (self._info.run_dir.resolve() / "mlflow-artifacts").as_uri()
            experiment_id = self._client.create_experiment(self._info.project, artifact_location=artifacts)
        self.run_id = self._client.create_run(experiment_id, run_name=self._info.experiment).info.run_id
        record_run(self._info.run_dir, "mlflow", {"run_id": self.run_id, "store": self._store(),
                                                  "project": self._info.project,
                                                  "run_dir": str(self._info.run_dir.resolve())})
        self._log_params(set())

    def _log_params(self, present: set[str]) -> None:
        params = [self._entities.Param(key, str(value)[:MLFLOW_PARAM_LIMIT])
                  for key, value in _flatten(self._info.config or {}).items() if key not in present]
        if params:
            self._client.log_batch(self.run_id, params=params)

    def log(self, metrics: dict[str, float], step: int) -> None:
        timestamp = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[
            self._entities.Metric(mlflow_metric_name(key), value, timestamp, step) for key, value in metrics.items()])

    def truncate_after(self, step: int) -> None:
        """A run that starts over (``step`` -1) in a folder whose earlier try logged to an MLflow run gets a new
        MLflow run, the earlier one set back to its status; a resume continues the run (see the class)."""
        if step < 0 and self._earlier_status is not None:
            earlier, status, self._earlier_status = self.run_id, self._earlier_status, None
            self._client.set_terminated(earlier, status=status if status != "RUNNING" else "KILLED")
            self._start()

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
