"""GSM8K scorer: the answer after ``####`` (strict) or the last number (flexible) against the ground truth.

Strict mode is the default because the prompt asks for ``#### N``; it rewards following the
format. Flexible mode accepts any response whose last number is right. A wrong number in the
expected format earns ``format_score`` (0 by default).
"""

from __future__ import annotations

import re
from typing import Any

from reinforge.reward.registry import register_scorer
from reinforge.reward.scorers.answer_numbers import NUMBER_PATTERN, last_number, numbers_equal

METHODS = ("strict", "flexible")
_STRICT_ANSWER = re.compile(r"####\s*\$?\s*(" + NUMBER_PATTERN + ")")


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The predicted number without thousands separators, or None when there is none."""
    if method == "strict":
        matches = _STRICT_ANSWER.findall(solution_str)
        return matches[-1].replace(",", "") if matches else None
    if method == "flexible":
        return last_number(solution_str)
    raise ValueError(f"reward.kwargs.method={method!r} is not a gsm8k method; use one of {', '.join(METHODS)}")


@register_scorer("openai/gsm8k", "gsm8k")
def score_gsm8k(solution_str: str, ground_truth: Any, extra_info: dict | None = None, method: str = "strict",
                format_score: float = 0.0) -> dict[str, Any]:
    """1 for the right number; ``format_score`` for a wrong one; 0 when no answer is found.

    >>> score_gsm8k("3 + 4 = 7 so #### 7", "7")["score"]
    1.0
    >>> score_gsm8k("The answer is 7.", "7")["score"], score_gsm8k("The answer is 7.", "7", method="flexible")["score"]
    (0.0, 1.0)
    """
    predicted = extract_gsm8k_answer(solution_str, method)
    correct = numbers_equal(predicted, ground_truth)
    score = 1.0 if correct else (format_score if predicted is not None else 0.0)
    return {"score": score, "acc": correct, "pred": predicted}
