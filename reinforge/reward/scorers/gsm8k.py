"""GSM8K scorer, as verl scores ``openai/gsm8k``: the answer after ``#### `` (strict) or the last number (flexible).

Both methods look only at the response's last ``CLIP_CHARACTERS`` characters and compare the
extracted text with the ground truth as text, exactly as verl does, so a run scored here and one
scored by verl agree on every response:

- strict takes the last ``#### N`` where one space follows ``####`` and N is made of digits,
  ``-``, ``.`` and ``,`` (commas are dropped); ``#### $72`` and ``####72`` have no answer,
  and ``#### 72.0`` or ``#### 72.`` is a wrong one against ``72``;
- flexible takes the last such run of characters anywhere that is not just ``.``, commas kept
  (``1,234`` is wrong against ``1234``, as is the ``72.`` that ends a sentence).

Strict mode is the default because the prompt asks for ``#### N``. A wrong answer earns
``format_score`` (0 by default); no answer at all earns 0.
"""

from __future__ import annotations

import re
from typing import Any

from reinforge.reward.registry import register_scorer

METHODS = ("strict", "flexible")
CLIP_CHARACTERS = 300
"""Only the response's tail is searched: the final answer is at the end, and regexes over long texts are slow."""

_NUMBER_CHARACTERS = r"-?[0-9.,]+"
_STRICT_ANSWER = re.compile("#### (" + _NUMBER_CHARACTERS + ")")
_ANY_NUMBER = re.compile(_NUMBER_CHARACTERS)


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The predicted answer as text (strict drops commas, flexible keeps them), or None when there is none."""
    if method not in METHODS:
        raise ValueError(f"reward.kwargs.method={method!r} is not a gsm8k method; use one of {', '.join(METHODS)}")
    tail = solution_str[-CLIP_CHARACTERS:]
    if method == "strict":
        answers = _STRICT_ANSWER.findall(tail)
        return answers[-1].replace(",", "") if answers else None
    candidates = _ANY_NUMBER.findall(tail)
    if not candidates:
        return None
    meaningful = [candidate for candidate in candidates if candidate != "."]
    # with nothing but dots, the first one stands as the (wrong) answer: it still earns format_score
    return meaningful[-1] if meaningful else candidates[0]


@register_scorer("openai/gsm8k", "gsm8k")
def score_gsm8k(solution_str: str, ground_truth: Any, extra_info: dict | None = None, method: str = "strict",
                format_score: float = 0.0, score: float = 1.0) -> dict[str, Any]:
    """``score`` when the answer's text equals ``ground_truth``; ``format_score`` for another one; 0 for none.

    >>> score_gsm8k("3 + 4 = 7 so #### 7", "7")["score"]
    1.0
    >>> score_gsm8k("The answer is 7", "7")["score"], score_gsm8k("The answer is 7", "7", method="flexible")["score"]
    (0.0, 1.0)
    """
    predicted = extract_gsm8k_answer(solution_str, method)
    correct = predicted is not None and predicted == str(ground_truth)
    if predicted is None:
        value = 0.0
    else:
        value = float(score) if correct else float(format_score)
    return {"score": value, "acc": correct, "pred": predicted}
