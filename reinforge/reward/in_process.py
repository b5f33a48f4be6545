"""Scoring in the trainer's own process (``reward.num_workers=0``): a thread per call, and a watch on the process.

``run_job_in_thread`` calls the scorer in a daemon thread, stopped at its time limit. A scorer's
``sys.exit`` raises ``SystemExit`` there, and its ``os._exit`` is intercepted while it runs: both
become that sample's error (fallback score, counted), not the end of the run. What cannot be
caught, a segfault in a C extension or an exit from C code, ends the process at once, without
a word: so ``ScorerSentinel``, a small process started with the first in-process call, is told
"start <what>" before each call and "done" after it. When its pipe closes (the trainer ended)
with a call open, it writes one line to stderr that names the scorer and the sample and says
that ``reward.num_workers>0`` isolates them, then exits; being written after the trainer died,
it is the run's last line. The run's exit code stays the trainer's. Closing the watch (the reward
manager's ``close``, its garbage collection, Python's own shutdown, or ``quiet_sentinels`` before a
stop signal's ``os._exit`` with a call still in flight) tells it "quit" first, so it stays silent.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import subprocess
import sys
import threading
import traceback
import weakref
from typing import Any

from reinforge.reward.scoring_pool import JobResult, ScoringJob, run_job

logger = logging.getLogger(__name__)

_in_scorer = threading.local()
_process_exit = os._exit


class ScorerCalledExit(BaseException):
    """A scorer called ``os._exit`` on a thread of the trainer: raised there instead of ending the process."""


def _exit_unless_scoring(code: int) -> None:
    # a process the scorer forked inherits the thread's mark: its exit (multiprocessing's children end with
    # os._exit) must end it, so the mark counts only in the process that set it
    if getattr(_in_scorer, "pid", None) == os.getpid():
        raise ScorerCalledExit(f"the scorer called os._exit({code}), which would have ended the trainer")
    _process_exit(code)


def intercept_scorer_exits() -> None:
    """Make ``os._exit`` raise ``ScorerCalledExit`` on a scorer's thread (it still ends the process elsewhere)."""
    os._exit = _exit_unless_scoring


def run_job_in_thread(job: ScoringJob, timeout_s: float) -> JobResult:
    """The job in a thread of this process, stopped at ``timeout_s``.

    At the deadline the job is reported as timed out and a ``TimeoutError`` is raised inside its
    thread, which stops Python code at once; code stuck inside a C extension keeps its (daemon)
    thread until it returns to Python.
    """
    outcome: list[JobResult] = []

    def call() -> None:
        _in_scorer.pid = os.getpid()
        try:
            outcome.append(JobResult(value=run_job(job)))
        except BaseException:  # noqa: B036 - the scorer's failure (sys.exit, os._exit, our TimeoutError) is the caller's
            outcome.append(JobResult(error=traceback.format_exc()))

    thread = threading.Thread(target=call, name="reinforge-scorer", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not thread.is_alive():
        return outcome[0]
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(TimeoutError))
        thread.join(0.1)
    return JobResult(timed_out=True)


_SENTINEL = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
current = None
for line in sys.stdin.buffer:
    text = line.decode(errors="replace").rstrip("\\n")
    if text.startswith("start "):
        current = text[len("start "):]
    elif text == "done":
        current = None
    elif text == "quit":  # the trainer closes the watch on purpose: nothing to report
        current = None
        break
if current:
    os.write(2, ("error: " + current + "\\n").encode())
"""


_live_sentinels: weakref.WeakSet[ScorerSentinel] = weakref.WeakSet()


def quiet_sentinels() -> None:
    """Tell every sentinel of this process that it is about to end on purpose (a stop signal that ends it with
    ``os._exit`` while a call is in flight): they exit without a word."""
    for sentinel in list(_live_sentinels):
        sentinel._send("quit")


class ScorerSentinel:
    """A process that reports the call in flight when this one ends in the middle of it."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        try:
            self._process = subprocess.Popen([sys.executable, "-I", "-S", "-c", _SENTINEL], stdin=subprocess.PIPE,
                                             stdout=subprocess.DEVNULL, close_fds=True, start_new_session=True)
        except OSError as error:  # scoring goes on; only the report of a crash is lost
            logger.warning("the watch on in-process scoring did not start (%s); a scorer that crashes the trainer "
                           "will end it without naming itself", error)
        self._finalizer = weakref.finalize(self, _stop, self._process)
        _live_sentinels.add(self)

    def begin(self, description: str) -> None:
        """A call starts; ``description`` (one line) is what the sentinel writes if the process ends during it."""
        self._send("start " + " ".join(description.split()))

    def end(self) -> None:
        self._send("done")

    def close(self) -> None:
        self._finalizer()

    def _send(self, line: str) -> None:
        if self._process is None or self._process.stdin is None:
            return
        try:
            self._process.stdin.write(line.encode() + b"\n")
            self._process.stdin.flush()
        except (OSError, ValueError):  # the sentinel is gone: scoring goes on without it
            self._process = None


def _stop(process: subprocess.Popen[Any] | None) -> None:
    if process is None:
        return
    with contextlib.suppress(OSError, ValueError):
        if process.stdin is not None:
            process.stdin.write(b"quit\n")  # a deliberate close, even with a call open: it exits without a word
            process.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)
