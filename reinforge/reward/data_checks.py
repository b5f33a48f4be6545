"""The reward setup checked before any model loads: the user's function, then every row against its scorer.

``load_reward_function`` imports ``reward.custom_function`` and checks its signature and
``reward.kwargs`` (and function objects given in Python, with ``reward.weights``);
``check_rows_can_be_scored`` then makes sure every row of a dataset has a scorer (its
``data_source`` is registered, or a custom function or the given functions score everything) and supplies
each argument that scorer cannot do without: ``reward_model.ground_truth`` when it takes a
``ground_truth`` without a default, a column for any other such argument; a built-in scorer's
ground-truth check (``registry.GROUND_TRUTH_CHECKS``: an integer for arithmetic, a target and
numbers for countdown) sees every row's ground truth, and a package a built-in scorer imports
(``registry.SCORER_REQUIREMENTS``: math-verify for math) must be installed. Without these checks a
row that cannot be scored would only show up as a fallback score of 0 in the middle of a run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from reinforge.config.schema import RewardConfig
from reinforge.data.rl_dataset import RLDataset
from reinforge.reward.registry import (
    GROUND_TRUTH_CHECKS,
    SCORER_REQUIREMENTS,
    SCORERS,
    Requirement,
    Scorer,
    find_scorer,
)
from reinforge.reward.reward_functions import build_reward_functions
from reinforge.reward.scorer_calls import (
    SAMPLE_ARGUMENTS,
    TRL_ARGUMENTS,
    check_reward_options,
    file_function_specs,
    load_custom_scorer,
    parse_custom_function,
    required_arguments,
    takes_completions,
)


def load_reward_function(config: RewardConfig, functions: Sequence[Scorer] | None = None) -> Scorer | None:
    """The custom scorer of ``reward.custom_function`` (None without one), imported and checked with reward.kwargs.

    ``functions`` (reward function objects given in Python) are checked too: their signatures, and one weight each
    in ``reward.weights``.
    """
    if config.custom_function is not None and not isinstance(config.custom_function, str):
        raise ValueError(f"reward.custom_function is a {type(config.custom_function).__name__}, not a path; it takes "
                         "path/to/file.py[:function]. Give function objects as RLTrainer(config, "
                         "reward_functions=[fn, ...]) or reinforge.GRPOTrainer(reward_funcs=[fn, ...])")
    try:
        scorer = load_custom_scorer(config.custom_function) if config.custom_function else None
        files = [(spec, scorer if spec == config.custom_function else load_custom_scorer(spec))
                 for spec in file_function_specs(config)]
        built = build_reward_functions(functions, config.weights, files)
    except (AttributeError, TypeError, ImportError) as error:
        raise ValueError(str(error)) from error  # a setting to fix, reported in one line like the others
    given = [function.scorer for function in built if function.scorer is not None]
    check_reward_options(dict(config.kwargs), given or list(set(SCORERS.values())))
    return scorer


def _scorer_name(config: RewardConfig, data_source: str | None) -> str:
    if config.custom_function:
        path, function = parse_custom_function(config.custom_function)
        return f"reward.custom_function {function} in {path}"
    return f"the {data_source!r} scorer"


def is_installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it (math_verify would take a second)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a module left as None in sys.modules
        return False


def _missing_requirement(scorer: Scorer) -> Requirement | None:
    requirement = SCORER_REQUIREMENTS.get(scorer)
    return requirement if requirement is not None and not is_installed(requirement.module) else None


def check_rows_can_be_scored(dataset: RLDataset, config: RewardConfig, custom_scorer: Scorer | None,
                             functions: Sequence[Scorer] | None = None) -> None:
    """Raise one line naming the first row that no scorer can score, and why.

    ``functions``: reward function objects given in Python, which score every row instead of the scorers.
    """
    if not functions and config.functions:  # several functions from files (reward.functions)
        functions = [load_custom_scorer(spec) for spec in config.functions]
    if functions:
        for function in functions:
            _check_rows(dataset, config, function, given_function=True)
    else:
        _check_rows(dataset, config, custom_scorer, given_function=False)


def _check_rows(dataset: RLDataset, config: RewardConfig, custom_scorer: Scorer | None, given_function: bool) -> None:
    options = set(config.kwargs)
    needs: dict[Any, frozenset[str]] = {}
    in_some_row: set[str] = set()
    if custom_scorer is not None and takes_completions(custom_scorer):
        # TRL's kind gets a dataset's column for every row, None where a row has no value (it may return None there)
        in_some_row = {name for example in dataset.examples for name, value in example.columns.items()
                       if value is not None}
        if any(example.ground_truth is not None for example in dataset.examples):
            in_some_row.add("ground_truth")
    for example in dataset.examples:
        scorer = custom_scorer if custom_scorer is not None else find_scorer(example.data_source)
        where = dataset.where(example)
        if scorer is None:
            known = ", ".join(sorted(SCORERS))
            source = "no data_source" if example.data_source is None else f"data_source {example.data_source!r}"
            raise ValueError(f"{where} has {source}, which has no scorer (known: {known}); set "
                             "reward.custom_function=path/to/file.py[:function] or register a scorer for it")
        clashing = sorted(set(example.columns) & {*SAMPLE_ARGUMENTS, *TRL_ARGUMENTS, *options})
        if clashing:
            raise ValueError(f"{where} has a column {clashing[0]!r}, a name reinforge already passes to the scorer "
                             f"({'from reward.kwargs' if clashing[0] in options else 'for every sample'}); rename "
                             "the column (a ground truth belongs in reward_model.ground_truth)")
        if scorer not in needs:
            requirement = _missing_requirement(scorer) if custom_scorer is None else None
            if requirement is not None:
                raise ValueError(f"{where} has data_source {example.data_source!r}, whose scorer needs the package "
                                 f"{requirement.module}, which is not installed: {requirement.install}")
            needs[scorer] = required_arguments(scorer) - options - {*TRL_ARGUMENTS, "solution_str", "extra_info",
                                                                     "data_source"}
        given = {name for name, value in example.columns.items() if value is not None}  # parquet fills gaps with null
        if example.ground_truth is not None:
            given.add("ground_truth")
        given |= in_some_row
        missing = sorted(needs[scorer] - given)
        name = (f"reward function {getattr(scorer, '__name__', scorer)}" if given_function
                else _scorer_name(config, example.data_source))
        if "ground_truth" in missing:
            advice = (", or give the function's ground_truth a default if it can score without one"
                      if config.custom_function or given_function else "")
            raise ValueError(f"{where} has no reward_model.ground_truth, which {name} "
                             f"needs; add reward_model: {{ground_truth: ...}} to the row{advice}")
        ground_truth_check = GROUND_TRUTH_CHECKS.get(scorer) if custom_scorer is None else None
        problem = ground_truth_check(example.ground_truth) if ground_truth_check and "ground_truth" in given else None
        if problem:
            raise ValueError(f"{where} has a reward_model.ground_truth the {example.data_source!r} scorer cannot read "
                             f"({problem}), so each of its samples would fail; fix the row")
        if missing:
            kind = "TRL's kind: columns are passed by name" if takes_completions(scorer) else "columns are passed by name"
            raise ValueError(f"{where} has no column {missing[0]!r} (or it is null), which {name} "
                             f"takes ({kind}); the row's extra columns are: {', '.join(sorted(given - {'ground_truth'})) or 'none'}")
