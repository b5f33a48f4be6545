"""Loading a user's scorer from ``path/to/file.py[:function]`` and building the keyword arguments of a call.

Two kinds of scorer are called, both by keyword:

- verl's kind, ``fn(data_source, solution_str, ground_truth, extra_info)`` (or ours,
  ``fn(solution_str, ground_truth, extra_info=None)``), called once per sample. It receives
  ``data_source``, ``extra_info``, each option of ``reward.kwargs`` and each extra column of the
  row (beside verl's prompt, data_source, ability, reward_model and extra_info) only if it names
  them or takes ``**kwargs``.
- TRL's kind, ``fn(completions, **columns) -> list[float | None]``, recognised by its ``completions``
  (or ``prompts``, ``completion_ids``) argument. It is called once per batch (``reward_functions``), with lists: ``completions`` (each
  response as a string, or as ``[{"role": "assistant", "content": ...}]`` for a chat prompt),
  ``prompts``, ``completion_ids``, ``ground_truth``, ``data_source``, ``extra_info`` and each extra
  column, plus ``trainer_state``, ``log_metric`` and ``log_extra`` (``reward_functions``); ``reward.kwargs``
  options come as they are.

Either kind may be ``async def`` (a scorer that awaits a judge model's server): each call is run to
completion on its own event loop, in the scoring process or thread, within the same time limit.

Which arguments a row must supply is checked when the data loads (``reward.data_checks``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any

from reinforge.reward.registry import Scorer

SAMPLE_ARGUMENTS = ("solution_str", "ground_truth", "extra_info", "data_source")
TRL_ARGUMENTS = ("completions", "prompts", "completion_ids", "trainer_state", "log_metric", "log_extra")
DEFAULT_FUNCTION_NAME = "compute_score"
"""The function of ``reward.custom_function=path.py`` without ``:name``, as in verl."""


def parse_custom_function(spec: str) -> tuple[str, str]:
    """``path/to/file.py:function`` -> (path, function); a bare path names ``compute_score``."""
    path_text, separator, function_name = spec.rpartition(":")
    if separator and not function_name.isidentifier() and Path(path_text).is_file() and not Path(spec).exists():
        raise ValueError(f"reward.custom_function={spec!r}: {function_name!r} is not a Python function name; "
                         f"write {path_text}:function_name, or {path_text} alone for {DEFAULT_FUNCTION_NAME}")
    if not separator or not function_name.isidentifier():
        path_text, function_name = spec, DEFAULT_FUNCTION_NAME
    if not path_text:
        raise ValueError(f"reward.custom_function={spec!r} must look like path/to/file.py or "
                         "path/to/file.py:function_name")
    return path_text, function_name


def file_function_specs(config: Any) -> list[str]:
    """The ``path.py:function`` specs of a RewardConfig: ``custom_function``, or ``functions``; both set is refused."""
    if config.custom_function and config.functions:
        raise ValueError(f"reward.custom_function={config.custom_function} and reward.functions={list(config.functions)} "
                         "are both set; list every function in reward.functions")
    return [config.custom_function] if config.custom_function else [str(spec) for spec in config.functions]


def load_custom_scorer(spec: str) -> Scorer:
    """The function named by ``reward.custom_function='path/to/file.py[:function]'``, signature checked."""
    path_text, function_name = parse_custom_function(spec)
    path = Path(path_text)
    if path.is_dir():
        raise FileNotFoundError(f"reward.custom_function: {path_text!r} is a folder; give the Python file that defines "
                                f"the function, e.g. {path_text.rstrip('/')}/reward.py[:function]")
    if not path.is_file():
        raise FileNotFoundError(f"reward.custom_function: file {path_text!r} does not exist (looked for "
                                f"{path.resolve()}); give a path relative to the working directory or absolute")
    module_name = "reinforge_custom_scorer_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"reward.custom_function: {path_text!r} is not a Python file; give a path to a .py file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:  # sys.exit()/argparse at module level must not end the run with 0
        raise ImportError(f"reward.custom_function: importing {path_text} failed: {type(error).__name__}: "
                          f"{error}") from error
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


def check_reward_options(options: dict[str, Any], scorers: list[Scorer]) -> None:
    """Raise when ``reward.kwargs`` sets an argument we pass per sample or one that none of ``scorers`` takes."""
    clashing = sorted(set(options) & {*SAMPLE_ARGUMENTS, *TRL_ARGUMENTS})
    if clashing:
        raise ValueError(f"reward.kwargs sets {', '.join(clashing)}, which the reward manager passes for "
                         "each sample; remove them from reward.kwargs")
    accepted = [accepted_keywords(scorer) for scorer in scorers]
    if any(names is None for names in accepted):
        return
    known = set().union(*accepted) - {*SAMPLE_ARGUMENTS, *TRL_ARGUMENTS}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"reward.kwargs has {', '.join(unknown)}, which no scorer accepts; "
                         f"the scorers' options are: {', '.join(sorted(known)) or 'none'}")


def takes_completions(fn: Scorer) -> bool:
    """Whether ``fn`` is TRL's kind of reward function: it names ``completions``, ``prompts`` or ``completion_ids``
    (and not verl's ``solution_str``)."""
    names = inspect.signature(fn).parameters
    return "solution_str" not in names and any(name in names for name in ("completions", "prompts", "completion_ids"))


def required_arguments(fn: Scorer) -> frozenset[str]:
    """Names ``fn`` cannot be called without (keyword parameters with no default)."""
    return frozenset(parameter.name for parameter in inspect.signature(fn).parameters.values()
                     if parameter.default is inspect.Parameter.empty
                     and parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))


def accepted_keywords(fn: Scorer) -> frozenset[str] | None:
    """Names ``fn`` accepts as keyword arguments; None when it takes ``**kwargs`` (any name)."""
    parameters = inspect.signature(fn).parameters.values()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return None
    return frozenset(parameter.name for parameter in parameters
                     if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))


def check_scorer_signature(fn: Scorer, name: str) -> None:
    """Raise unless ``fn`` is one of the two kinds we call; the arguments a row supplies are checked with the data."""
    for parameter in inspect.signature(fn).parameters.values():
        if parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise TypeError(f"scorer {name} takes {parameter.name!r} by position only; reinforge passes every "
                            "argument by keyword, so remove the '/' from its signature")
    if takes_completions(fn):
        return
    accepted = accepted_keywords(fn)
    if accepted is not None and "solution_str" not in accepted:
        raise TypeError(f"scorer {name} takes neither 'solution_str' (verl's fn(data_source, solution_str, "
                        "ground_truth, extra_info)) nor 'completions' (TRL's fn(completions, **kwargs)); name the "
                        "argument that receives the response one of these")


def completion_of(text: str, prompt: Any) -> Any:
    """A response as TRL passes it: the text, or one assistant message when the prompt is a chat (after the
    prompt's own final assistant message, which the response continues, as TRL's bootstrap)."""
    if not isinstance(prompt, list):
        return text
    last = prompt[-1] if prompt else {}
    started = last.get("content") if isinstance(last, dict) and last.get("role") == "assistant" else None
    return [{"role": "assistant", "content": (started if isinstance(started, str) else "") + text}]


def build_call_kwargs(accepted: frozenset[str] | None, solution_str: str, ground_truth: Any,
                      extra_info: dict[str, Any] | None, data_source: str | None,
                      options: dict[str, Any], *, columns: dict[str, Any] | None = None) -> dict[str, Any]:
    """The keyword arguments for one per-sample call of a scorer that accepts ``accepted`` (None: anything).

    ``columns`` are the row's extra columns.
    """
    arguments = {"solution_str": solution_str, "ground_truth": ground_truth, "extra_info": extra_info,
                 "data_source": data_source, **(columns or {}), **options}
    if accepted is None:
        return arguments
    return {name: value for name, value in arguments.items() if name in accepted}
