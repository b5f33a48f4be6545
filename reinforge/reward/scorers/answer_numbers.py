"""Finding and comparing numbers in model answers (shared by the gsm8k and arithmetic scorers)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

NUMBER_PATTERN = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER = re.compile(NUMBER_PATTERN)


def find_numbers(text: str) -> list[str]:
    """Every number in ``text``, thousands separators removed: '1,234.5 and -7' -> ['1234.5', '-7']."""
    return [match.replace(",", "") for match in _NUMBER.findall(text)]


def last_number(text: str) -> str | None:
    numbers = find_numbers(text)
    return numbers[-1] if numbers else None


def numbers_equal(predicted: str | None, ground_truth: object) -> bool:
    """Numeric equality of two number strings ('72.0' equals '72'); text equality when one is not a number."""
    if predicted is None or ground_truth is None:
        return False
    expected = str(ground_truth).strip().replace(",", "")
    try:
        return Decimal(predicted) == Decimal(expected)
    except InvalidOperation:
        return predicted == expected
