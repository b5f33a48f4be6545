"""The reward functions of a run, the calls made to them and how their scores combine (TRL's reward contract).

A run's reward comes from one of three places:

- the built-in scorer of each sample's ``data_source`` (``registry.SCORERS``), when nothing else is given;
- ``reward.custom_function=path/to/file.py[:function]``, or several in ``reward.functions``, weighted by
  ``reward.weights``;
- function objects given in Python (``reinforge.GRPOTrainer(reward_funcs=[...])``,
  ``RLTrainer(config, reward_functions=[...])``), several of them, weighted by ``reward.weights``.

A function of TRL's kind (it names ``completions``) is called once per batch, in chunks (one per scoring
process), with lists by keyword: ``prompts``, ``completions``, ``completion_ids``, ``ground_truth``,
``data_source``, ``extra_info``, each extra column of the rows, ``trainer_state`` (``TrainerState``: TRL's
global_step, max_steps, epoch, log_history...), and TRL's ``log_metric(name, value)`` (the step's mean of the values
logged, in metrics.jsonl under ``name``) and ``log_extra(column, values)`` (one value per completion, kept as the
samples' reward extra ``column``); it returns one score per sample, or None where it does not apply. A function of verl's kind (``solution_str``) is called once per
sample, as before. A sample's total is ``nansum_i(w_i * r_i)`` as in TRL: a function that returned None for
it is left out (a sample no function applies to scores 0). Each named function's scores are kept per sample
(``rewards/<name>``, NaN where it did not apply), from which the trainer logs ``rewards/<name>/mean|std``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from reinforge.reward.registry import Scorer
from reinforge.reward.scorer_calls import accepted_keywords, check_scorer_signature, completion_of, takes_completions
from reinforge.reward.scoring_pool import PickledFunction

FUNCTION_SCORES_PREFIX = "rewards/"
"""The batch column of a function's per-sample scores is ``rewards/<name>``; its metrics ``rewards/<name>/mean``."""
LOGGED_METRICS_PREFIX = "logged_metric/"
"""The batch column of a value a function logged (``log_metric(name, value)``) is ``logged_metric/<name>``: each
sample of the call that logged it holds it (NaN elsewhere); the step's metric ``name`` is their mean."""


@dataclass(frozen=True)
class TrainerState:
    """What TRL's ``trainer_state`` (transformers' ``TrainerState``) gives a reward function, for rewards that
    change over training."""

    global_step: int = 0
    """Optimizer steps finished before this batch was generated (TRL's count: a training step that makes several,
    mini-batches or ppo_epochs, counts each)."""
    max_steps: int = 0
    """Optimizer steps of the whole run (0: unknown)."""
    epoch: float = 0.0
    """Passes over the training data finished, with the fraction of the current one."""
    num_train_epochs: int = 0
    """trainer.total_epochs."""
    metrics_file: str | None = None
    """The run's metrics.jsonl, which ``log_history`` reads."""
    optimizer_steps_per_step: int = 1
    """Optimizer steps of one training step: a logged row's ``step`` in ``log_history`` counts them, as TRL's."""
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True

    @property
    def log_history(self) -> list[dict[str, Any]]:
        """The metrics the run has logged, one dict per logged row with its ``step`` (optimizer steps), read from
        metrics.jsonl when asked (reinforge's metric names: ``critic/score/mean``, ``actor/pg_loss``...)."""
        if self.metrics_file is None or not Path(self.metrics_file).is_file():
            return []
        from reinforge.tracking.jsonl import read_json_lines

        return [row | {"step": row.get("step", 0) * self.optimizer_steps_per_step}
                for row in read_json_lines(Path(self.metrics_file))]


class RewardLog:
    """What a TRL-kind function logs during one batch call through TRL's ``log_metric`` and ``log_extra``; it goes
    to the scoring process inside the call's arguments and comes back with the scores (``ScoringJob.log``)."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples
        self.metrics: dict[str, list[float]] = {}
        self.extras: dict[str, list[Any]] = {}

    def log_metric(self, name: str, value: float) -> None:
        """TRL's: a scalar for this batch, logged as the step's metric ``name`` (the mean of what was logged)."""
        self.metrics.setdefault(str(name), []).append(float(value))

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        """TRL's: one value per completion of the call, kept as the samples' reward extra ``column``."""
        values = list(values)
        if len(values) != self.num_samples:
            raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for a call of {self.num_samples} "
                             "completions; give one value per completion")
        self.extras[str(column)] = values


@dataclass
class RewardFunction:
    """One function of the run's reward and its weight."""

    name: str
    scorer: Scorer | None
    """None: each sample's built-in scorer, picked by its data_source."""
    weight: float = 1.0
    spec: str | None = None
    """``path/to/file.py:function``: worker processes load the function from the file."""
    batched: bool = False
    """TRL's kind: called once per batch with lists."""
    accepted: frozenset[str] | None = None
    """The keyword arguments it takes (None: any, it has ``**kwargs``)."""
    _pickled: PickledFunction | None = None

    @classmethod
    def of(cls, scorer: Scorer, weight: float = 1.0, spec: str | None = None, name: str | None = None) -> RewardFunction:
        function_name = name or getattr(scorer, "__name__", None) or type(scorer).__name__
        check_scorer_signature(scorer, function_name)
        return cls(function_name, scorer, float(weight), spec, takes_completions(scorer), accepted_keywords(scorer))

    def for_workers(self) -> Callable[..., Any] | str | PickledFunction:
        """What a scoring process is sent: the file spec, or the function pickled by value."""
        if self.spec is not None:
            return self.spec
        if self._pickled is None:
            self._pickled = PickledFunction.of(self.scorer)
        return self._pickled


def build_reward_functions(functions: Sequence[Scorer] | None, weights: Sequence[float] | None,
                           files: Sequence[tuple[str, Scorer]] = ()) -> list[RewardFunction]:
    """The run's functions with their weights; one line naming the fix when they do not fit together.

    ``functions``: function objects given in Python; ``files``: (spec, function) of ``reward.custom_function`` or
    ``reward.functions``, loaded from their files.
    """
    if functions and files:
        raise ValueError(f"reward.custom_function/reward.functions name {', '.join(spec for spec, _ in files)} and "
                         "reward functions are given as objects; use one of the two")
    if functions:
        for function in functions:
            if not callable(function):
                raise TypeError(f"a reward function must be callable; got a {type(function).__name__} ({function!r}). "
                                "Pass functions, or set reward.custom_function=path/to/file.py:function")
        scorers, specs = list(functions), [None] * len(functions)
    elif files:
        scorers, specs = [scorer for _, scorer in files], [spec for spec, _ in files]
    else:
        if weights is not None and len(weights) != 1:
            raise ValueError(f"reward.weights={list(weights)} has {len(weights)} weights, but the reward is the "
                             "built-in scorer of each data_source (one function); give one weight or none")
        return [RewardFunction("data_source", None, float(weights[0]) if weights else 1.0)]
    if weights is not None and len(weights) != len(scorers):
        raise ValueError(f"reward.weights={list(weights)} has {len(weights)} weights for {len(scorers)} reward "
                         "functions; give one weight per function, in the same order")
    built = [RewardFunction.of(scorer, weights[index] if weights is not None else 1.0, specs[index])
             for index, scorer in enumerate(scorers)]
    names = [function.name for function in built]
    for index, function in enumerate(built):  # two functions of one name would share one metric: number them
        if names.count(function.name) > 1:
            function.name = f"{function.name}_{index}"
    return built


def chunks_of(num_samples: int, num_chunks: int) -> list[range]:
    """``range(num_samples)`` in at most ``num_chunks`` consecutive chunks of near-equal size."""
    num_chunks = max(1, min(num_chunks, num_samples))
    bounds = np.linspace(0, num_samples, num_chunks + 1).round().astype(int)
    return [range(int(start), int(end)) for start, end in zip(bounds[:-1], bounds[1:], strict=True) if end > start]


def batch_call_kwargs(function: RewardFunction, indices: range, samples: dict[str, Any], options: dict[str, Any],
                      trainer_state: TrainerState, log: RewardLog | None = None) -> dict[str, Any]:
    """The keyword arguments of one batch call of a TRL-kind function over the samples at ``indices``.

    ``samples`` holds per-sample lists: texts, completion_ids, prompts, ground_truths, extra_infos, data_sources,
    columns (each a dict of the row's extra columns). ``log`` receives the call's ``log_metric``/``log_extra``.
    """
    columns = [samples["columns"][index] or {} for index in indices]
    column_names = sorted({name for row in columns for name in row})
    arguments = {
        "prompts": [samples["prompts"][index] for index in indices],
        "completions": [completion_of(samples["texts"][index], samples["prompts"][index]) for index in indices],
        "completion_ids": [samples["completion_ids"][index] for index in indices],
        "ground_truth": [samples["ground_truths"][index] for index in indices],
        "data_source": [samples["data_sources"][index] for index in indices],
        "extra_info": [samples["extra_infos"][index] for index in indices],
        **{name: [row.get(name) for row in columns] for name in column_names},
        "trainer_state": trainer_state,
        **({"log_metric": log.log_metric, "log_extra": log.log_extra} if log is not None else {}),
        **options,
    }
    if function.accepted is None:
        return arguments
    return {name: value for name, value in arguments.items() if name in function.accepted}


def batch_scores(value: list[Any], function_name: str) -> list[float]:
    """A batch call's return value as floats, NaN for None; raises on anything that is not a number."""
    scores = []
    for item in value:
        if item is None:
            scores.append(math.nan)
            continue
        try:
            if isinstance(item, str | bytes):  # float("42") would take an extracted answer for its score
                raise TypeError
            score = float(item)
        except (TypeError, ValueError):
            raise TypeError(f"reward function {function_name} returned a {type(item).__name__} in its list; return "
                            "one float (or None) per completion") from None
        if not math.isfinite(score):
            raise ValueError(f"reward function {function_name} returned a non-finite score {score}; return None for "
                             "a completion it does not apply to")
        scores.append(score)
    return scores


def combine(function_scores: np.ndarray, weights: Sequence[float]) -> np.ndarray:
    """``nansum_i(w_i * r_i)`` per sample. function_scores: (num_functions, batch), NaN = not applicable."""
    weighted = function_scores * np.asarray(weights, dtype=np.float64)[:, None]
    return np.nansum(weighted, axis=0)


def logged_metric_columns(logs: Sequence[tuple[range, RewardLog]], num_samples: int) -> dict[str, list[float]]:
    """``logged_metric/<name>`` -> per sample, the mean of what the call that scored it logged as ``name`` (NaN
    where its call logged none)."""
    columns: dict[str, list[float]] = {}
    for indices, log in logs:
        for name, values in log.metrics.items():
            column = columns.setdefault(f"{LOGGED_METRICS_PREFIX}{name}", [math.nan] * num_samples)
            for index in indices:
                column[index] = sum(values) / len(values)
    return columns


def function_metrics(columns: dict[str, Sequence[Any]]) -> dict[str, float]:
    """``rewards/<name>/mean`` and ``/std`` of each function's per-sample scores (NaN = not applicable, left out),
    and each value the functions logged (``logged_metric/<name>``) as ``name``: its mean over the samples."""
    metrics = {}
    for key, values in columns.items():
        if not key.startswith((FUNCTION_SCORES_PREFIX, LOGGED_METRICS_PREFIX)):
            continue
        scores = np.asarray([float(value) for value in values], dtype=np.float64)
        scores = scores[~np.isnan(scores)]
        if not scores.size:
            continue
        if key.startswith(LOGGED_METRICS_PREFIX):
            metrics[key.removeprefix(LOGGED_METRICS_PREFIX)] = float(scores.mean())
            continue
        metrics[f"{key}/mean"] = float(scores.mean())
        metrics[f"{key}/std"] = float(scores.std(ddof=1)) if scores.size > 1 else 0.0
    return metrics
