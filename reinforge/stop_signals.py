"""Stopping a run from outside: SIGTERM or Ctrl-C stop it cleanly, a second one at once.

The first SIGINT or SIGTERM raises ``KeyboardInterrupt`` in the main thread, so the trainer's
``finally`` blocks run (worker groups and scorer processes stopped, logs closed, the run
folder unlocked) and the command prints one line. The latest checkpoint stays, so the same
command resumes; what the stop dropped unfinished (``note_abandoned``: a generation under way
that did not end within the stop's wait) is named in that line. A second signal ends the
process at once with ``os._exit``, which skips the interpreter's teardown: threads still
inside torch code then cannot abort it with a C++ ``terminate called`` message. A signal that arrives once the main thread has finished (the
interpreter joining threads, running atexit hooks, tearing modules down) has nothing left to stop
cleanly: it also exits at once, with the same 130, where a ``KeyboardInterrupt`` would print a
traceback from the teardown and the process would exit as if never stopped.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

INTERRUPTED_EXIT_CODE = 130
stop_signal: list[str] = []
"""The name of the signal that stopped the run (empty while none has)."""
abandoned: list[str] = []
"""What stopping the run dropped unfinished, a phrase each (``note_abandoned``), for the line ``stopped_message``."""


def _exit_now(signum: int, frame: FrameType | None, why: str = "again") -> None:
    try:
        sys.stderr.write(f"\n{signal.Signals(signum).name} {why}: exiting at once\n")
        sys.stdout.flush()
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # a stream already closed or gone (late in the teardown)
        pass
    _quiet_scorer_watch()
    os._exit(INTERRUPTED_EXIT_CODE)


def _quiet_scorer_watch() -> None:
    """An exit on purpose is no scorer's crash: the in-process scorers' sentinels stay silent. There are none unless
    their module was imported (importing it late in the interpreter's teardown would fail)."""
    if "reinforge.reward.in_process" in sys.modules:
        from reinforge.reward.in_process import quiet_sentinels

        quiet_sentinels()


def _stop(signum: int, frame: FrameType | None) -> None:
    if not threading.main_thread().is_alive():  # the interpreter is shutting down: no code left to interrupt
        _exit_now(signum, frame, "while exiting")
    stop_signal.append(signal.Signals(signum).name)
    signal.signal(signal.SIGINT, _exit_now)
    signal.signal(signal.SIGTERM, _exit_now)
    raise KeyboardInterrupt


def install_stop_handlers() -> None:
    """Route SIGINT and SIGTERM through ``_stop``; only the main thread can install signal handlers. A run starts
    with no stop noted: an earlier run of this process (a notebook, a script calling the CLI twice) stopped for
    itself."""
    stop_signal.clear()
    abandoned.clear()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)


def note_abandoned(what: str) -> None:
    """Name, in the run's last line, something the stop dropped unfinished (nothing of it is saved)."""
    abandoned.append(what)


def stopped_message() -> str:
    name = stop_signal[0] if stop_signal else "SIGINT"
    dropped = f" ({'; '.join(abandoned)}; nothing of it is saved)" if abandoned else ""
    return (f"stopped by {name}: the run keeps its latest checkpoint{dropped}; run the same command to resume "
            "(a second Ctrl-C exits at once)")


def exit_after_stop() -> int:
    """The exit code after a stop; ends the process at once if threads that may run torch code are still alive."""
    sys.stdout.flush()
    sys.stderr.flush()
    if any(thread.name.startswith("reinforge-") and thread.is_alive() for thread in threading.enumerate()):
        _quiet_scorer_watch()
        os._exit(INTERRUPTED_EXIT_CODE)
    return INTERRUPTED_EXIT_CODE
