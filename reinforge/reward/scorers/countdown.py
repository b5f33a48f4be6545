"""Countdown scorer: an equation in ``<answer>...</answer>`` that reaches the target with the given numbers.

The ground truth is ``{"target": 24, "numbers": [3, 5, 8]}`` (``nums`` is accepted for
``numbers``, as in TinyZero's data). The equation may use + - * / and parentheses, and must
use every given number exactly once. We evaluate it by walking its syntax tree with exact
fractions, never with ``eval``, so a response cannot run code. An answer block that
misses (wrong value, numbers or syntax) earns ``format_score``.
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from fractions import Fraction
from typing import Any

from reinforge.reward.registry import register_scorer

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_EQUATION_CHARACTERS = re.compile(r"^[\d+\-*/().\s]+$")
_MAX_EQUATION_CHARACTERS = 200
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def extract_equation(solution_str: str) -> str | None:
    """The text of the last ``<answer>`` block, up to any '=' (so '3 * 8 = 24' gives '3 * 8')."""
    answers = _ANSWER.findall(solution_str)
    if not answers:
        return None
    return answers[-1].split("=")[0].strip()


def evaluate_equation(equation: str) -> tuple[Fraction, list[int]]:
    """The exact value of ``equation`` and the numbers it uses; ValueError when it is not a plain equation."""
    if len(equation) > _MAX_EQUATION_CHARACTERS or not _EQUATION_CHARACTERS.match(equation):
        raise ValueError(f"not an arithmetic equation: {equation[:50]!r}")
    try:
        tree = ast.parse(equation, mode="eval")
    except (SyntaxError, RecursionError):
        raise ValueError(f"not an arithmetic equation: {equation[:50]!r}") from None
    numbers: list[int] = []

    def value_of(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value_of(node.left), value_of(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"unsupported element in equation: {ast.dump(node)[:50]}")

    return value_of(tree.body), numbers


def _target_and_numbers(ground_truth: Any) -> tuple[int, list[int]]:
    if not isinstance(ground_truth, dict) or "target" not in ground_truth:
        raise ValueError(f"countdown ground truth must be a dict with 'target' and 'numbers', got {ground_truth!r}")
    numbers = ground_truth.get("numbers", ground_truth.get("nums"))
    if numbers is None:
        raise ValueError(f"countdown ground truth has no 'numbers': {ground_truth!r}")
    return int(ground_truth["target"]), [int(number) for number in numbers]


def _ground_truth_problem(ground_truth: Any) -> str | None:
    try:
        _target_and_numbers(ground_truth)
    except (ValueError, TypeError) as error:
        return str(error)
    return None


@register_scorer("countdown", check_ground_truth=_ground_truth_problem)
def score_countdown(solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                    format_score: float = 0.1) -> dict[str, Any]:
    """1 for an equation that uses each number once and equals the target; ``format_score`` for one that doesn't.

    >>> score_countdown("<answer>(8 - 5) * 8</answer>", {"target": 24, "numbers": [5, 8, 8]})["score"]
    1.0
    """
    target, available = _target_and_numbers(ground_truth)
    equation = extract_equation(solution_str)
    if equation is None:
        return {"score": 0.0, "acc": False, "pred": None}
    try:
        value, used = evaluate_equation(equation)
    except (ValueError, ZeroDivisionError):
        return {"score": format_score, "acc": False, "pred": equation}
    correct = Counter(used) == Counter(available) and value == target
    return {"score": 1.0 if correct else format_score, "acc": correct, "pred": equation}
