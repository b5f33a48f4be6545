"""Scorer of the built-in arithmetic task: the last integer of the response must equal the answer.

Taking the last integer accepts both "432" and "47 + 385 = 432", and fails a response that
rambles on to another number after the answer, which teaches a small model to stop.
"""

from __future__ import annotations

import re
from typing import Any

from reinforge.reward.registry import register_scorer

_INTEGER = re.compile(r"-?\d+(?:,\d{3})*")


def integer_answer(ground_truth: Any) -> int:
    """The ground truth as an integer: 432, "432", or 432.0 (a parquet column of integers with a gap is float)."""
    if isinstance(ground_truth, float) and ground_truth.is_integer():
        return int(ground_truth)
    try:
        if isinstance(ground_truth, bool | float):
            raise ValueError
        return int(str(ground_truth).strip().replace(",", ""))
    except ValueError:
        raise ValueError(f"the arithmetic ground truth must be an integer, got {ground_truth!r}") from None


def _ground_truth_problem(ground_truth: Any) -> str | None:
    try:
        integer_answer(ground_truth)
    except ValueError as error:
        return str(error)
    return None


@register_scorer("arithmetic", check_ground_truth=_ground_truth_problem)
def score_arithmetic(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict[str, Any]:
    """1 when the last integer in the response equals ``ground_truth``, else 0.

    >>> score_arithmetic("432", "432")["score"], score_arithmetic("47 + 385 = 422", "432")["score"]
    (1.0, 0.0)
    """
    integers = _INTEGER.findall(solution_str)
    predicted = integers[-1].replace(",", "") if integers else None
    answer = integer_answer(ground_truth)
    correct = predicted is not None and int(predicted) == answer
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": predicted}
