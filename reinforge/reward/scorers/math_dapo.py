"""DAPO's math scorer, as verl scores ``math_dapo``, ``math``, ``math_dapo_reasoning`` and every ``aime*`` source.

The answer is the text after the last ``Answer:`` (any case) up to the end of its line, found in
the response's last ``WINDOW_CHARACTERS`` characters; a response without one has the answer
``[INVALID]``. Answer and ground truth are both normalised (``normalize_final_answer``: the part
after the last ``=``, units and filler words dropped, ``\\text{}``, ``\\boxed{}`` and ``$`` removed,
``\\frac12`` written out, ``1,000`` as ``1000``) and compared as text. A right answer scores 1,
anything else -1, so a missing answer costs as much as a wrong one.

``strict_box_verify=True`` (``reward.kwargs``) instead takes the last ``\\boxed{}`` of the
response's last 100 characters and compares it with the ground truth unnormalised.
"""

from __future__ import annotations

import re
from typing import Any

from reinforge.reward.registry import register_scorer

WINDOW_CHARACTERS = 300
"""The longest final answer of MATH-500 has 159 characters; the response's tail is enough."""
BOX_WINDOW_CHARACTERS = 100
NO_ANSWER = "[INVALID]"

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Applied in this order; the order matters ("an " goes before spaces do).
_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_UNITS_AND_FILLER: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)
_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(pattern), replacement) for pattern, replacement in (
    (r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$"),  # the first $...$ span only
    (r"(\\text\{)(.*?)(\})", r"\2"),
    (r"(\\textbf\{)(.*?)(\})", r"\2"),
    (r"(\\overline\{)(.*?)(\})", r"\2"),
    (r"(\\boxed\{)(.*)(\})", r"\2"),
    (r"(frac)([^{])(.)", r"frac{\2}{\3}"),  # \frac12 -> \frac{1}{2}
    (r"(sqrt)([^{])", r"sqrt{\2}"),  # \sqrt2 -> \sqrt{2}
))


def normalize_final_answer(answer: str) -> str:
    """A final answer in the form DAPO compares: '\\\\text{5 dollars}' -> '5', '$1,000$' -> '1000'."""
    answer = answer.split("=")[-1]
    for old, new in _REPLACEMENTS:
        answer = answer.replace(old, new)
    for unit in _UNITS_AND_FILLER:
        answer = answer.replace(unit, "")
    for pattern, replacement in _REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def last_boxed_expression(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` when its braces close, else None (a later box is not searched)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for position in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if text[position] == "}" and depth == 0:
            return text[start + len("\\boxed{"):position]
    return None


def answer_after_label(solution_str: str) -> str:
    """The text after the last ``Answer:`` up to the line's end, or ``NO_ANSWER``."""
    answers = _ANSWER_LINE.findall(solution_str)
    return answers[-1] if answers else NO_ANSWER


def _ground_truth_problem(ground_truth: Any) -> str | None:
    return None if str(ground_truth).strip() else "the math_dapo ground truth is empty"


@register_scorer("math_dapo", "math", "math_dapo_reasoning", "aime*", check_ground_truth=_ground_truth_problem)
def score_math_dapo(solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                    strict_box_verify: bool = False) -> dict[str, Any]:
    """1 when the final answer after ``Answer:`` matches ``ground_truth`` once both are normalised, else -1.

    >>> score_math_dapo("6 * 7 = 42, so\\nAnswer: $42$", "42")["score"]
    1.0
    >>> score_math_dapo("the answer is 42", "42")["score"]
    -1.0
    """
    window = solution_str[-WINDOW_CHARACTERS:]
    if strict_box_verify:
        predicted = last_boxed_expression(window[-BOX_WINDOW_CHARACTERS:])
        correct = predicted == str(ground_truth)
    else:
        predicted = normalize_final_answer(answer_after_label(window))
        correct = predicted == normalize_final_answer(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": predicted}
