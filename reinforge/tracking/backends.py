"""The tracking backend interface and its registry.

A backend receives every step's metrics (already plain floats) from ``Tracker``; the optional
hooks default to doing nothing. Backends are built as ``backend_cls(run)`` from a ``RunInfo``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from rich.console import Console


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


def register_tracking_backend(name: str) -> Callable[[type[TrackingBackend]], type[TrackingBackend]]:
    def add(backend_cls: type[TrackingBackend]) -> type[TrackingBackend]:
        if name in TRACKING_BACKENDS:
            raise ValueError(f"tracking backend {name!r} is registered twice")
        TRACKING_BACKENDS[name] = backend_cls
        return backend_cls
    return add


def import_optional(module: str, backend: str, package: str) -> ModuleType:
    """Import the package a backend needs, or say in one line how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"tracking backend {backend!r} needs the {package} package, which is not installed; "
                          f"pip install 'reinforge[tracking]' (or pip install {package})") from error
