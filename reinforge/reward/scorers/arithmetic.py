"""Scorer of the built-in arithmetic task: the last integer of the response must equal the answer.

Taking the last integer accepts both "432" and "47 + 385 = 432", and fails a response that
rambles on to another number after the answer, which teaches a small model to stop.
"""

from __future__ import annotations

import re
from typing import Any

from reinforge.reward.registry import register_scorer

_INTEGER = re.compile(r"-?\d+(?:,\d{3})*")


@register_scorer("arithmetic")
def score_arithmetic(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict[str, Any]:
    """1 when the last integer in the response equals ``ground_truth``, else 0.

    >>> score_arithmetic("432", "432")["score"], score_arithmetic("47 + 385 = 422", "432")["score"]
    (1.0, 0.0)
    """
    integers = _INTEGER.findall(solution_str)
    predicted = integers[-1].replace(",", "") if integers else None
    correct = predicted is not None and int(predicted) == int(str(ground_truth).strip())
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": predicted}
