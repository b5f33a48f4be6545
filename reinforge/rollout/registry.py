"""Rollout engines by ``rollout.name``: the two built in, and any a package adds through an entry point.

A package adds an engine without editing reinforge by naming its class in the entry point group
``reinforge.rollout_engines`` of its ``pyproject.toml``::

    [project.entry-points."reinforge.rollout_engines"]
    my_engine = "my_package.engine:MyEngine"

after which ``rollout.name=my_engine`` generates with it. The class implements ``RolloutEngine`` (``base.py``:
``generate``, ``sync_weights``, ``wake_up``, ``sleep`` and ``reads_model_in_place``) and is built by the
actor-rollout worker as ``MyEngine.from_config(config, model=model, tokenizer=tokenizer, device=device)``, with the
run's ``Config``, the policy model (in the compute dtype), its tokenizer and the device. ``register_rollout_engine``
adds one from Python code instead (a test, a script), in the process that builds it. ``hf`` and ``native`` are built
by the worker itself, since their settings come from ``rollout`` keys of their own.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from typing import Any

ENTRY_POINT_GROUP = "reinforge.rollout_engines"

ROLLOUT_ENGINES: dict[str, Any] = {"hf": "reinforge.rollout.hf:HFEngine",
                                   "native": "reinforge.rollout.native:NativeEngine"}
"""rollout.name -> the engine class, or "module:Class" until it is first asked for."""


def register_rollout_engine(name: str) -> Callable[[type], type]:
    def add(engine_class: type) -> type:
        if name in ROLLOUT_ENGINES:
            raise ValueError(f"rollout engine {name!r} is registered twice")
        ROLLOUT_ENGINES[name] = engine_class
        return engine_class
    return add


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {entry.name: entry for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def rollout_engine_names() -> list[str]:
    """Every name rollout.name may take: the registered engines and the installed entry points."""
    return sorted({*ROLLOUT_ENGINES, *_entry_points()})


def get_rollout_engine(name: str) -> type:
    """The engine class of ``rollout.name``, imported on first use."""
    if name not in ROLLOUT_ENGINES:
        entry = _entry_points().get(name)
        if entry is None:
            raise ValueError(f"rollout.name={name!r} is not a rollout engine; known: {', '.join(rollout_engine_names())} "
                             f"(a package adds one through the entry point group {ENTRY_POINT_GROUP!r})")
        try:
            ROLLOUT_ENGINES[name] = entry.load()
        except Exception as error:
            raise ValueError(f"rollout.name={name!r}: loading {entry.value!r} from the entry point group "
                             f"{ENTRY_POINT_GROUP!r} failed ({type(error).__name__}: {error}); fix or reinstall the "
                             f"package that provides it") from None
    engine = ROLLOUT_ENGINES[name]
    if isinstance(engine, str):
        module, _, attribute = engine.partition(":")
        engine = ROLLOUT_ENGINES[name] = getattr(importlib.import_module(module), attribute)
    return engine


def check_plugin_engine(name: str) -> None:
    """Raise one line when ``rollout.name`` names no engine, or a plugin engine that lacks a part of the contract."""
    engine = get_rollout_engine(name)
    if name in ("hf", "native"):
        return
    missing = [part for part in ("from_config", "generate", "sync_weights", "wake_up", "sleep") if
               not callable(getattr(engine, part, None))]
    if not hasattr(engine, "reads_model_in_place"):
        missing.append("reads_model_in_place")
    if missing:
        raise ValueError(f"rollout.name={name!r}: {engine.__module__}.{engine.__qualname__} lacks "
                         f"{', '.join(missing)} of the RolloutEngine contract (reinforge.rollout.registry); add them")
