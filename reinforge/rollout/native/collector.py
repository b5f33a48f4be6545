"""Python's garbage collector paused while the engine steps: a collection in the middle of the steps walks every
live object while the device waits for the host's next launch.

One process may step several engines at once (a rollout engine beside a server's, sync ``generate`` beside an
async driver's thread). Each holds the pause while it steps; the first to take it records whether the collector
was on, and the last to let go restores that, so neither leaves the collector off for the other nor turns it back
on under the other's feet.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0
_was_enabled = False


def pause() -> None:
    """Take the pause (the collector is off until every holder has let go)."""
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1


def resume() -> None:
    """Let go of a pause taken with ``pause``; the last holder restores the collector as the first found it."""
    global _holders
    with _lock:
        if _holders == 0:
            raise RuntimeError("the garbage collector's pause was let go more times than it was taken")
        _holders -= 1
        if _holders == 0 and _was_enabled:
            gc.enable()


def holders() -> int:
    """How many pauses are held now."""
    return _holders


@contextmanager
def paused() -> Iterator[None]:
    pause()
    try:
        yield
    finally:
        resume()
