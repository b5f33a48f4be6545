"""What the engine's timed kernel choices share (``moe_choice.ExpertKernelChoice``, ``dense_choice.DenseMLPChoice``):
a candidate kernel is run once, checked against the reference's output, then timed; one that fails to compile or
run, or gives other numbers, is dropped for good in one log line."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import Tensor


class CheckedTimings:
    """Timing of candidates against a reference; subclasses give ``_time`` (milliseconds per run) and name the
    reference (``reference``), the candidates (``candidates``) and what runs without one (``fallback``)."""

    reference = "the reference's"
    candidates = "the Triton kernel"
    fallback = "another candidate runs"

    def __init__(self) -> None:
        self.failed: set[str] = set()
        """Candidates (their names) dropped for failing or differing from the reference."""

    def _time(self, run: Callable[[], Tensor]) -> float:
        raise NotImplementedError

    def _checked_time(self, name: str, run: Callable[[], Tensor], expected: Tensor | None) -> float | None:
        """Milliseconds per ``run()``, or None (dropped in one line) when it fails or its output is not ``expected``
        within bf16 rounding (None: not checked)."""
        try:
            out = run()
            if expected is not None:
                scale = expected.float().abs().max().clamp(min=1e-6)
                error = float((out.float() - expected.float()).abs().max() / scale)
                if not error <= 2e-2:
                    raise ValueError(f"its output differs from {self.reference} by {error:.2g} of the largest value")
            return self._time(run)
        except Exception as error:  # noqa: BLE001 (a kernel the device cannot compile or run: keep the reference)
            self.failed.add(name)  # said by the logger of the subclass's module
            logging.getLogger(type(self).__module__).warning(
                "%s %s is dropped (%s: %s); %s", self.candidates, name, type(error).__name__,
                str(error).splitlines()[0] if str(error) else "", self.fallback)
            return None
