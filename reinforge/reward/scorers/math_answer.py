"""Competition-math scorer: the response's final answer must equal the ground truth, checked by math-verify.

math-verify (``pip install 'reinforge[math]'``) extracts the answer (``\\boxed{}`` first, then
the last LaTeX or plain expression) and compares it symbolically, so ``\\frac{1}{2}``, ``0.5``
and ``1/2`` agree (verl compares the boxed answer's normalised text for these sources, so it may
score an equivalent form 0 where this scorer gives 1). verl's ``math`` source is DAPO's scorer
(``math_dapo.py``). Its own signal-based time limit works only on a main thread; elsewhere we
rely on the reward manager's per-sample timeout instead.
"""

from __future__ import annotations

import threading
from typing import Any

from reinforge.reward.registry import Requirement, register_scorer

_MATH_VERIFY_TIMEOUT_S = 5


def _ground_truth_problem(ground_truth: Any) -> str | None:
    """Only what is cheap to see: parsing every row's answer with math-verify would take seconds per thousand rows."""
    if not str(ground_truth).strip():
        return "the math ground truth is empty"
    return None


@register_scorer("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
                 check_ground_truth=_ground_truth_problem,
                 requires=Requirement("math_verify", "pip install math-verify (or pip install 'reinforge[math]')"))
def score_math(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict[str, Any]:
    """1 when math-verify finds the response's answer equal to ``ground_truth``, else 0.

    >>> score_math("so the answer is $\\\\boxed{0.5}$", "\\\\frac{1}{2}")["score"]
    1.0
    """
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError("the math scorer needs math-verify: pip install 'reinforge[math]'") from None
    on_main_thread = threading.current_thread() is threading.main_thread()
    timeout = _MATH_VERIFY_TIMEOUT_S if on_main_thread else None
    gold_text = str(ground_truth)
    if "$" not in gold_text and "\\boxed" not in gold_text:
        gold_text = f"${gold_text}$"
    gold = parse(gold_text, parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {ground_truth!r}")
    predicted = parse(solution_str, parsing_timeout=timeout)
    correct = bool(predicted) and verify(gold, predicted, timeout_seconds=timeout)
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": str(predicted[-1]) if predicted else None}
