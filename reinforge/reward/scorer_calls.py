"""Loading a user's scorer from ``path/to/file.py:function`` and building the keyword arguments of a call.

Scorers are called by keyword, so both our order ``(solution_str, ground_truth, extra_info)``
and verl's ``(data_source, solution_str, ground_truth, extra_info)`` work. A scorer receives
``data_source`` and ``extra_info`` only if it names them (or takes ``**kwargs``), and each
option of ``reward.kwargs`` only if it accepts that name.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any

from reinforge.reward.registry import Scorer

SAMPLE_ARGUMENTS = ("solution_str", "ground_truth", "extra_info", "data_source")


def load_custom_scorer(spec: str) -> Scorer:
    """The function named by ``reward.custom_function='path/to/file.py:function'``."""
    path_text, separator, function_name = spec.rpartition(":")
    if not separator or not path_text or not function_name:
        raise ValueError(f"reward.custom_function={spec!r} must look like path/to/file.py:function_name")
    path = Path(path_text)
    if not path.is_file():
        raise FileNotFoundError(f"reward.custom_function: file {path_text!r} does not exist (looked for "
                                f"{path.resolve()}); give a path relative to the working directory or absolute")
    module_name = "reinforge_custom_scorer_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"reward.custom_function: {path_text!r} is not a Python file; give a path to a .py file")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, function_name, None)
    if fn is None:
        defined = sorted(name for name, value in vars(module).items()
                         if inspect.isfunction(value) and value.__module__ == module_name)
        raise AttributeError(f"reward.custom_function: {path_text} has no function {function_name!r}; "
                             f"it defines: {', '.join(defined) or 'no functions'}")
    if not callable(fn):
        raise TypeError(f"reward.custom_function: {function_name!r} in {path_text} is a "
                        f"{type(fn).__name__}, not a function")
    check_scorer_signature(fn, f"{function_name} in {path_text}")
    return fn


def accepted_keywords(fn: Scorer) -> frozenset[str] | None:
    """Names ``fn`` accepts as keyword arguments; None when it takes ``**kwargs`` (any name)."""
    parameters = inspect.signature(fn).parameters.values()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return None
    return frozenset(parameter.name for parameter in parameters
                     if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))


def check_scorer_signature(fn: Scorer, name: str, options: dict[str, Any] | None = None) -> None:
    """Raise unless every call we make can fill ``fn``'s required parameters."""
    parameters = inspect.signature(fn).parameters.values()
    fillable = {*SAMPLE_ARGUMENTS, *(options or {})}
    for parameter in parameters:
        if parameter.kind is inspect.Parameter.POSITIONAL_ONLY or (
                parameter.default is inspect.Parameter.empty and parameter.name not in fillable
                and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)):
            raise TypeError(f"scorer {name} takes an argument {parameter.name!r} that reinforge cannot pass; "
                            f"it passes {', '.join(SAMPLE_ARGUMENTS)} and reward.kwargs by keyword, so write "
                            "fn(solution_str, ground_truth, extra_info=None, **kwargs)")
    accepted = accepted_keywords(fn)
    if accepted is not None and not {"solution_str", "ground_truth"} <= accepted:
        raise TypeError(f"scorer {name} must accept 'solution_str' and 'ground_truth' "
                        "(fn(solution_str, ground_truth, extra_info=None, **kwargs))")


def build_call_kwargs(accepted: frozenset[str] | None, solution_str: str, ground_truth: Any,
                      extra_info: dict[str, Any] | None, data_source: str | None,
                      options: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments for one call of a scorer that accepts ``accepted`` (None: anything)."""
    arguments = {"solution_str": solution_str, "ground_truth": ground_truth, "extra_info": extra_info,
                 "data_source": data_source, **options}
    if accepted is None:
        return arguments
    return {name: value for name, value in arguments.items() if name in accepted}
