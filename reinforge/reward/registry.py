"""The scorer registry: which function scores the responses of each ``data_source``.

A scorer is a plain function

    fn(solution_str: str, ground_truth, extra_info: dict | None = None, **options) -> float | dict

returning the score, or a dict with ``score`` and extras such as ``acc`` and ``pred``. Its
keyword options (e.g. gsm8k's ``method``) are filled from ``reward.kwargs``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Scorer = Callable[..., float | dict[str, Any]]

SCORERS: dict[str, Scorer] = {}

GroundTruthCheck = Callable[[Any], "str | None"]
GROUND_TRUTH_CHECKS: dict[Scorer, GroundTruthCheck] = {}
"""A scorer -> a cheap check of one row's ground truth (the problem in words, or None), run on every row before any
model loads (``reward.data_checks``): a ground truth the scorer cannot read fails each of its samples."""


@dataclass(frozen=True)
class Requirement:
    """A package a scorer imports when it runs, checked before any model loads (``reward.data_checks``)."""

    module: str
    """The name it is imported by, e.g. ``math_verify``."""
    install: str
    """The command that installs it, e.g. ``pip install math-verify (or reinforge[math])``."""


SCORER_REQUIREMENTS: dict[Scorer, Requirement] = {}


def register_scorer(*data_sources: str, check_ground_truth: GroundTruthCheck | None = None,
                    requires: Requirement | None = None) -> Callable[[Scorer], Scorer]:
    """Register the decorated function as the scorer of each of ``data_sources``.

    A name ending in ``*`` covers every data source it begins (``aime*``: aime24, aime_2025, ...).

    ``check_ground_truth`` checks each row's ground truth, ``requires`` names a package the scorer imports.
    """
    if not data_sources:
        raise ValueError("register_scorer needs at least one data source name")

    def add(fn: Scorer) -> Scorer:
        for data_source in data_sources:
            if data_source in SCORERS:
                raise ValueError(f"a scorer for data source {data_source!r} is registered twice")
            SCORERS[data_source] = fn
        if check_ground_truth is not None:
            GROUND_TRUTH_CHECKS[fn] = check_ground_truth
        if requires is not None:
            SCORER_REQUIREMENTS[fn] = requires
        return fn
    return add


def find_scorer(data_source: str | None) -> Scorer | None:
    """The scorer of ``data_source``: its own name first, then the longest ``prefix*`` that begins it."""
    if data_source in SCORERS:
        return SCORERS[data_source]
    if data_source is None:
        return None
    prefixes = [name for name in SCORERS if name.endswith("*") and data_source.startswith(name[:-1])]
    return SCORERS[max(prefixes, key=len)] if prefixes else None


def get_scorer(data_source: str | None) -> Scorer:
    """The scorer registered for ``data_source``; an unknown name lists the known ones."""
    scorer = find_scorer(data_source)
    if scorer is not None:
        return scorer
    known = ", ".join(sorted(SCORERS))
    if data_source is None:
        raise ValueError(f"a sample has no data_source, which picks its scorer; add data_source to the rows "
                       f"(one of: {known}) or set reward.custom_function")
    raise ValueError(f"no scorer for data_source {data_source!r}; known data sources: {known}. "
                   "Register one with @register_scorer or set reward.custom_function=path/to/file.py:function")
