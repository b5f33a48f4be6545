"""Time-slicing one device between the rollouter and the trainer: one at a time, the trainer first.

On one device (the hybrid actor-rollout worker) a generation segment and an update cannot run
together; each side takes a turn around its device work. A waiting trainer goes before the
rollouter's next segment, so updates are never starved by a busy rollouter.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class DeviceTurns:
    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._busy = False
        self._trainer_waiting = 0

    @contextmanager
    def trainer(self) -> Iterator[None]:
        with self._condition:
            self._trainer_waiting += 1
            self._condition.wait_for(lambda: not self._busy)
            self._trainer_waiting -= 1
            self._busy = True
        try:
            yield
        finally:
            self._release()

    @contextmanager
    def rollouter(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: not self._busy and self._trainer_waiting == 0)
            self._busy = True
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        with self._condition:
            self._busy = False
            self._condition.notify_all()
