"""Answers in ``\\boxed{}``: the last boxed expression of the response against the ground truth.

The ReTool recipe asks for the final answer in ``\\boxed{}`` and counts only that: a response
without a boxed answer scores 0, like a wrong one (``reward.retool_wrong_answer`` then turns
both into ReTool's negative reward). Numbers compare by value (``72.0`` equals ``72``,
``1,000`` equals ``1000``); anything else by its text without spaces and ``$``.
"""

from __future__ import annotations

import re
from typing import Any

from reinforge.reward.registry import register_scorer
from reinforge.reward.scorers.answer_numbers import numbers_equal

_BOXED = "\\boxed{"
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def last_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{...}`` (nested braces kept), or None."""
    start, limit = text.rfind(_BOXED), len(text)
    while start != -1:
        # a box that is still open where a later unclosed box starts stays open (the later one's suffix never
        # returns to its depth), so each scan stops there: linear, not quadratic, in the text's length
        depth, position = 1, start + len(_BOXED)
        while position < limit and depth:
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            position += 1
        if depth == 0:
            return text[start + len(_BOXED):position - 1]
        start, limit = text.rfind(_BOXED, 0, start), start
    return None


def _normalize(answer: str) -> str:
    answer = answer.replace("$", "").replace("\\!", "").replace(" ", "").strip()
    answer = _THOUSANDS.sub("", answer)
    return answer[:-1] if answer.endswith(".") else answer


@register_scorer("gsm8k_boxed", "boxed")
def score_boxed(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict[str, Any]:
    """1 when the last boxed answer equals ``ground_truth``, else 0.

    >>> score_boxed("so 3 * 4 = 12 and the answer is \\\\boxed{12}.", "12")["score"]
    1.0
    >>> score_boxed("the answer is 12", "12")["score"]
    0.0
    """
    boxed = last_boxed(solution_str)
    predicted = None if boxed is None else _normalize(boxed)
    correct = predicted is not None and numbers_equal(predicted, _normalize(str(ground_truth)))
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": predicted}
