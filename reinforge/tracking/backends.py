"""The tracking backend interface and its registry.

A backend receives every step's metrics (already plain floats) from ``Tracker``; the optional
hooks default to doing nothing. Backends are built as ``backend_cls(run)`` from a ``RunInfo``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from rich.console import Console

from reinforge.atomic_files import replaced_atomically


@dataclass
class RunInfo:
    run_dir: Path
    project: str
    experiment: str
    config: Mapping[str, Any] | None
    """The resolved run config (nested dicts), for backends that store it (W&B, MLflow)."""
    console: Console
    """Shared with the progress bar, so that log lines print above it."""


class TrackingBackend:
    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Generations of this step (prompt, response, score, ...); ignored unless the backend stores them."""

    def truncate_after(self, step: int) -> None:
        """Forget what was logged after ``step``, when a run resumes from that step's checkpoint."""

    def close(self) -> None:
        pass


TRACKING_BACKENDS: dict[str, Callable[[RunInfo], TrackingBackend]] = {}

BACKEND_PACKAGES: dict[str, tuple[str, str]] = {}
"""A backend's name -> (the module it imports, the package that holds it), for backends that need one."""

BACKEND_CHECKS: dict[str, Callable[[], str | None]] = {}
"""A backend's name -> a check of its environment (one line naming what is wrong and the fix, or None)."""


def register_tracking_backend(name: str, needs: tuple[str, str] | None = None,
                              check: Callable[[], str | None] | None = None
                              ) -> Callable[[type[TrackingBackend]], type[TrackingBackend]]:
    """``needs``: (module, package) the backend imports when it starts, checked beforehand by ``missing_backend_package``;
    ``check``: what else it needs of the environment, asked by ``backend_problem`` before any model loads."""
    def add(backend_cls: type[TrackingBackend]) -> type[TrackingBackend]:
        if name in TRACKING_BACKENDS:
            raise ValueError(f"tracking backend {name!r} is registered twice")
        TRACKING_BACKENDS[name] = backend_cls
        if needs is not None:
            BACKEND_PACKAGES[name] = needs
        if check is not None:
            BACKEND_CHECKS[name] = check
        return backend_cls
    return add


def backend_problem(name: str) -> str | None:
    """Why backend ``name`` (its package installed) would fail to start here, in one line, or None."""
    check = BACKEND_CHECKS.get(name)
    return check() if check is not None else None


def missing_backend_package(name: str) -> str | None:
    """The package backend ``name`` needs and this environment lacks (without importing it), or None."""
    if name not in BACKEND_PACKAGES:
        return None
    module, package = BACKEND_PACKAGES[name]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing (torch.utils.tensorboard needs tensorboard itself)
        found = False
    return None if found else package


def import_optional(module: str, backend: str, package: str) -> ModuleType:
    """Import the package a backend needs, or say in one line how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"tracking backend {backend!r} needs the {package} package, which is not installed; "
                          f"pip install 'reinforge[tracking]' (or pip install {package})") from error


TRACKING_IDS_FILE = "tracking_ids.json"
"""In the run folder: the id of each external run (W&B, MLflow) that holds the run's metrics, by backend, so that a
resumed run continues the same external run: {"wandb": {"run_id": "...", "project": "..."}, ...}."""


def recorded_run(run_dir: Path, backend: str) -> dict[str, str] | None:
    """What ``record_run`` kept for ``backend`` in ``run_dir``, or None (a fresh run folder, or an unreadable file:
    the backend then starts a new external run and records that one)."""
    try:
        record = json.loads((run_dir / TRACKING_IDS_FILE).read_text(encoding="utf-8")).get(backend)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str) or not record["run_id"]:
        return None
    return {key: value for key, value in record.items() if isinstance(value, str)}


def record_run(run_dir: Path, backend: str, record: dict[str, str]) -> None:
    """Keep ``record`` (the external run's id and what it belongs to) for ``backend`` in ``RUN_DIR/tracking_ids.json``,
    replaced atomically: a crash leaves the old file or the new one."""
    path = run_dir / TRACKING_IDS_FILE
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        records = {}
    if not isinstance(records, dict):
        records = {}
    records[backend] = record
    with replaced_atomically(path) as temporary:
        temporary.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n", encoding="utf-8")
