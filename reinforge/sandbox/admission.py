"""Load control in front of the runner: a token-bucket rate limit, then a bounded queue for slots.

A request first takes a token (none left: 429 with the seconds until the next one), then a
slot, one of ``max_concurrent``; while all are busy it waits in a queue of at most
``max_queued`` requests (full: 503 at once; waited too long: 503). verl's own sandbox tool
only bounds concurrency with a semaphore, which lets a burst of requests pile up without limit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class TokenBucket:
    """``rate`` tokens per second refill a bucket of ``capacity``; each admitted request takes one."""

    def __init__(self, rate: float, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or capacity < 1:
            raise ValueError(f"a token bucket needs rate > 0 and capacity >= 1, got rate={rate}, capacity={capacity}")
        self.rate, self.capacity, self._clock = rate, float(capacity), clock
        self._tokens, self._updated = float(capacity), clock()
        self._lock = threading.Lock()

    def take(self) -> float:
        """0.0 if a token was taken, else the seconds until one will be there (nothing is taken)."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.capacity, self._tokens + (now - self._updated) * self.rate)
            self._updated = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return 0.0
            return (1.0 - self._tokens) / self.rate


class QueueFull(Exception):
    """Every slot is busy and the queue holds ``max_queued`` requests already."""


class QueueTimeout(Exception):
    """A queued request did not get a slot in time."""


class SlotPool:
    """``num_slots`` numbered slots handed out one per running program, with a bounded first-come wait queue.

    A freed slot goes to the request that has waited longest: one that arrives while others wait queues behind
    them, even when a slot is free at that moment (its waiter has not woken yet).
    """

    def __init__(self, num_slots: int, max_queued: int) -> None:
        self._free = list(range(num_slots - 1, -1, -1))
        self._max_queued = max_queued
        self._waiting: list[object] = []
        self._condition = threading.Condition()

    def acquire(self, timeout_s: float) -> int:
        """A free slot's number; QueueFull or QueueTimeout when there is none to have."""
        with self._condition:
            if not self._free or self._waiting:
                if self._queue_is_full():
                    raise QueueFull()
                ticket = object()
                self._waiting.append(ticket)
                try:
                    if not self._condition.wait_for(lambda: bool(self._free) and self._waiting[0] is ticket,
                                                    timeout=timeout_s):
                        raise QueueTimeout()
                finally:
                    self._waiting.remove(ticket)
                    self._condition.notify_all()  # the next in line may be first now
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._condition:
            self._free.append(slot)
            self._condition.notify_all()  # only the first in line takes it; the others wait on

    def full(self) -> bool:
        """Whether ``acquire`` would raise QueueFull now: every slot busy, or waited for, and the queue full."""
        with self._condition:
            return (not self._free or bool(self._waiting)) and self._queue_is_full()

    def _queue_is_full(self) -> bool:
        """Under the lock: no room for another waiter."""
        return len(self._waiting) >= self._max_queued

    def stats(self) -> dict[str, int]:
        with self._condition:
            return {"free_slots": len(self._free), "queued": len(self._waiting)}
