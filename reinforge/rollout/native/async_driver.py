"""The native engine's async entry point: requests submitted one at a time from an event loop.

``AsyncDriver.generate`` submits a request with callbacks that complete its future on the event
loop, and makes sure a background task is stepping the engine: in a worker thread, step after
step until nothing is left to run, while anything is pending. Agent loops thus submit requests
one at a time and none waits for another; the steps batch arrivals (``max_admission_wait``,
``admission_fraction``; see scheduler.py), so requests arriving while others decode join a few
at a time. The driver reaches the engine only through the callables it is given.

Requests may come from one event loop after another (``asyncio.run`` per call, a server's loop stopped
and a new one started). A task of a loop that stopped before it ended never runs again, so a request
from another loop starts a driver of its own loop; the steps take a lock, so the worker thread of a
loop that was stopped (or cancelled its driver mid-step) finishes its step before another steps. A request of a
loop that has closed meanwhile still finishes in the engine; its completions are dropped (no one is left to await
them), and the step goes on to deliver the others.

A caller that stops waiting (its task cancelled: a timeout, a client that hung up, its event loop shutting down)
aborts its request: the engine drops it wherever it stands and frees its KV blocks, rather than generating it to its
``max_tokens`` for no one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from reinforge.rollout.base import Completion, GenerationRequest
from reinforge.rollout.native import collector

Submit = Callable[..., object]
"""Hands a request to the engine with the callbacks for its completions and for an error, and, for a streamed
request, a fourth: ``on_token(sample_index, token_id, log_prob, top_log_probs)`` for each token as a step samples
it (``top_log_probs``: the token's (id, log-prob) alternatives when the request asks for them, else None). Returns
the request's handle for ``Abort``."""

Abort = Callable[[object], None]
"""Drops a submitted request (its handle from ``Submit``) whose caller stopped waiting; callable from any thread."""

OnToken = Callable[[int, int, float, "list[tuple[int, float]] | None"], None]


class AsyncDriver:
    def __init__(self, submit: Submit, step: Callable[[], bool], has_work: Callable[[], bool],
                 fail_pending: Callable[[BaseException], None], measure: Callable[[], Callable[[], None]],
                 abort: Abort):
        """submit: see ``Submit``; step: one engine step batching arrivals, False when there was nothing to run;
        has_work: whether any request is pending or a step in flight; fail_pending: hand an error to every request
        the engine holds and drop them; measure: start the rollout metrics' span, returning what ends it; abort:
        see ``Abort``."""
        self._submit = submit
        self._step = step
        self._has_work = has_work
        self._fail_pending = fail_pending
        self._measure = measure
        self._abort = abort
        self._task: asyncio.Task | None = None
        self._stepping = threading.Lock()

    async def generate(self, request: GenerationRequest, on_token: OnToken | None = None) -> list[Completion]:
        """The request's n completions; requests submitted concurrently are batched together. ``on_token`` (a
        streamed request) is called on the event loop with each token as it is sampled, all before this returns.
        Cancelled while it waits, it aborts the request (see the module docstring)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Completion]] = loop.create_future()

        def deliver(completions: list[Completion]) -> None:
            call_on_loop(loop, lambda: future.done() or future.set_result(completions))

        def fail(error: BaseException) -> None:
            call_on_loop(loop, lambda: future.done() or future.set_exception(error))

        if on_token is None:
            handle = self._submit(request, deliver, fail)
        else:
            handle = self._submit(request, deliver, fail, lambda *token: call_on_loop(loop, on_token, *token))
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._drive())
        try:
            return await future
        except asyncio.CancelledError:
            self._abort(handle)
            raise

    async def _drive(self) -> None:
        """Step in a worker thread while anything is pending (a request submitted as the thread stops is seen by
        the check here, which runs on the event loop, as ``generate`` does)."""
        finish_metrics = self._measure()
        stop = threading.Event()
        try:
            while self._has_work():
                await asyncio.to_thread(self._run_steps, stop)
        except Exception as error:  # every request waiting for this driver fails with it, not yet admitted ones too
            self._fail_pending(error)
            raise
        finally:  # also when the event loop cancels this task on its way out: the thread stops after its step
            stop.set()
            finish_metrics()

    def _run_steps(self, stop: threading.Event) -> None:
        """Step until nothing is left to run or ``stop`` is set; never beside another driver's thread. Python's
        garbage collector is paused meanwhile, as in ``NativeEngine.generate``: by the thread, which always ends (a
        task of a loop that stopped never does)."""
        with self._stepping, collector.paused():
            while not stop.is_set() and self._step():
                pass


def call_on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object) -> None:
    """Call ``callback(*args)`` on ``loop`` from any thread; nothing once the loop has closed (raising there would
    stop the engine's step midway, and the requests it finished beside this one would never hear back)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise
