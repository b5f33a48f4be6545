"""Scoring in worker processes with a hard per-sample time limit.

A scorer is user code: it may loop forever (a regex that backtracks, a sympy call that never
returns) or crash its interpreter. Threads cannot be stopped, so each worker is a process of
its own with a private pipe. The pool hands one job at a time to an idle worker and notes its
deadline; a worker still busy at the deadline is killed and replaced, and its job reported as
timed out. Because every worker has its own pipe, killing one never corrupts a shared queue.

Workers start with ``forkserver`` (``spawn`` where that is missing), never plain ``fork``: the
trainer may hold CUDA state and threads that a forked child must not inherit. A worker never imports the
trainer's ``__main__`` (multiprocessing would, to find the target by name): the main module is hidden while
a worker starts, so a script or notebook without an ``if __name__ == "__main__":`` guard does not train
again inside each worker. A reward function defined there travels by value (``PickledFunction``,
cloudpickle). No worker
outlives the trainer, even one killed with SIGKILL: the forkserver exits once every copy of
its "alive" pipe's write end is closed, so each worker closes the copy it inherits (the
trainer's is then the last) and asks Linux (``PR_SET_PDEATHSIG``) for a SIGKILL when its
parent, the forkserver, ends. A worker imports only ``reinforge.reward`` (no torch), and
its time limit starts when it reports ready, so start-up never counts against a job. A batch call (TRL's kind
of reward function, ``ScoringJob.num_samples`` set) gets the per-sample limit times its number of samples.

``max_memory_mb`` caps each worker's heap (``RLIMIT_DATA``, set in the worker before it imports
anything): a scorer that allocates past it gets a ``MemoryError``, its worker exits at once (its
heap may hold the leak) and is replaced, and its job is reported as ``memory_exceeded``.

An ``async def`` scorer is awaited on one event loop per process, kept from call to call (``await_on_scorer_loop``):
a client it keeps (an AsyncOpenAI client, an aiohttp session) stays bound to the loop it was made on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import inspect
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

_STARTUP_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 1.0
MEMORY_EXCEEDED_EXIT_CODE = 75
"""The exit code of a worker whose scorer ran out of memory (a MemoryError under ``max_memory_mb``)."""


@dataclass(frozen=True)
class PickledFunction:
    """A reward function pickled by value (cloudpickle): one defined in ``__main__`` or a notebook cell, which a
    worker process could not import by name."""

    data: bytes
    name: str

    @classmethod
    def of(cls, function: Callable[..., Any]) -> PickledFunction:
        name = getattr(function, "__qualname__", None) or type(function).__name__
        try:
            import cloudpickle
        except ImportError:  # plain pickle sends an importable module's function by name; not one of __main__
            import pickle

            if getattr(function, "__module__", None) in (None, "__main__") or "<locals>" in name:
                raise ImportError(f"reward function {name} is defined in the script or a notebook, so it reaches the "
                                  "scorer processes with cloudpickle, which is not installed: pip install cloudpickle, "
                                  "or set reward.num_workers=0 to score in this process") from None
            return cls(pickle.dumps(function), name)
        try:
            return cls(cloudpickle.dumps(function), name)
        except Exception as error:
            raise TypeError(f"reward function {name} cannot be pickled for the scorer processes ({type(error).__name__}: "
                            f"{error}); make it picklable, or set reward.num_workers=0 to score in this process") from error


@dataclass
class ScoringJob:
    scorer: Callable[..., Any] | str | PickledFunction
    """A scorer function (sent to the worker by its import path), a 'path/to/file.py:function' spec, or a
    function pickled by value."""
    kwargs: dict[str, Any]
    num_samples: int | None = None
    """None: one sample, the scorer returns its score. A number: a batch call (TRL's kind), the scorer returns a
    list of that many scores (None in it: the function does not apply to that sample)."""
    log: Any = None
    """A batch call's ``RewardLog``, which the scorer writes to through ``kwargs`` (log_metric, log_extra): the
    job's value is then ``(scores, log)``, the log as the scorer's process left it."""

    @property
    def time_units(self) -> int:
        """How many per-sample time limits the job may take."""
        return max(1, self.num_samples or 1)


@dataclass
class JobResult:
    value: Any = None
    error: str | None = None
    """The traceback (or reason) when the scorer raised or its process died."""
    timed_out: bool = False
    memory_exceeded: bool = False
    """The scorer ran out of memory (past the pool's ``max_memory_mb``); its worker was replaced."""


_loaded_custom_scorers: dict[str | bytes, Callable[..., Any]] = {}


def run_job(job: ScoringJob) -> Any:
    """Call the job's scorer; a custom-function spec or a pickled function is loaded once per process."""
    scorer = job.scorer
    if isinstance(scorer, str):
        if scorer not in _loaded_custom_scorers:
            from reinforge.reward.scorer_calls import load_custom_scorer

            _loaded_custom_scorers[scorer] = load_custom_scorer(scorer)
        scorer = _loaded_custom_scorers[scorer]
    elif isinstance(scorer, PickledFunction):
        if scorer.data not in _loaded_custom_scorers:
            import pickle

            _loaded_custom_scorers[scorer.data] = pickle.loads(scorer.data)
        scorer = _loaded_custom_scorers[scorer.data]
    value = scorer(**job.kwargs)
    if inspect.isawaitable(value):  # an ``async def`` scorer (one that awaits a judge or a service): run it here
        value = await_on_scorer_loop(value)
    if job.num_samples is not None:
        if getattr(value, "ndim", None) == 1 and hasattr(value, "tolist"):  # a numpy array or torch tensor, as TRL
            value = value.tolist()                                          # takes any sequence of scores
        if not isinstance(value, list | tuple) or len(value) != job.num_samples:
            shown = repr(value) if len(repr(value)) < 80 else repr(value)[:77] + "..."
            raise TypeError(f"a reward function taking 'completions' (TRL's kind) returned {shown} for "
                            f"{job.num_samples} completions; return a list with one score (or None) per completion")
        value = list(value)
    return value if job.log is None else (value, job.log)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


_scorer_loop: tuple[int, asyncio.AbstractEventLoop] | None = None
"""(the process id, the loop) of the event loop that awaits this process's async scorers."""
_scorer_loop_lock = threading.Lock()


def await_on_scorer_loop(awaitable: Any) -> Any:
    """``awaitable``'s value, awaited on the process's scorer loop (started here, in a daemon thread, on first use).

    One loop for every call: a loop per call (``asyncio.run``) would close the loop that the clients a scorer kept
    were bound to, and its next call would fail on them. A caller stopped while waiting (the in-process time limit)
    cancels the awaitable."""
    global _scorer_loop
    with _scorer_loop_lock:
        if _scorer_loop is None or _scorer_loop[0] != os.getpid():  # a forked child has not the parent's thread
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="async-scorers", daemon=True).start()
            _scorer_loop = (os.getpid(), loop)
        loop = _scorer_loop[1]
    future = asyncio.run_coroutine_threadsafe(_awaited(awaitable), loop)
    try:
        while not future.done():  # short waits: the in-process time limit's exception reaches this thread between them
            concurrent.futures.wait([future], timeout=0.1)
        return future.result()
    except BaseException:
        future.cancel()
        raise


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """On Linux, have the kernel SIGKILL this process when its parent process ends (however it ends).

    A forkserver child also closes its copy of the forkserver's "alive" fd, which would otherwise keep
    the forkserver (its parent) running after the trainer died, and so this process too.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(alive_fd)
        server._forkserver_alive_fd = None
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def limit_memory(max_memory_mb: int | None) -> None:
    """Cap this process's heap (RLIMIT_DATA: private writable memory) at ``max_memory_mb``; None leaves it."""
    if max_memory_mb is None:
        return
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = max_memory_mb * 1024 * 1024
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def _worker_loop(connection: Connection, custom_function: str | None, max_memory_mb: int | None = None) -> None:
    die_with_parent()
    limit_memory(max_memory_mb)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops us via close().
    try:
        import reinforge.reward  # noqa: F401  (registers the built-in scorers before we report ready)
    except BaseException:  # noqa: B036  (the trainer must learn why, not only that we died)
        connection.send(("startup_error", traceback.format_exc()))
        return

    if custom_function is not None:
        try:
            run_job(ScoringJob(custom_function, {}))
        except Exception:
            pass  # loading is all we wanted; a broken file reports its error on every job
    connection.send(("ready", None))
    while True:
        try:
            job = connection.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        try:
            reply = ("ok", run_job(job))
        except MemoryError:
            os._exit(MEMORY_EXCEEDED_EXIT_CODE)  # the leak may still be referenced: only a new process is clean
        except BaseException:  # noqa: B036  (a scorer calling sys.exit must not kill the worker silently)
            reply = ("error", traceback.format_exc())
        try:
            connection.send(reply)
        except Exception:
            connection.send(("error", f"the scorer's result could not be sent back:\n{traceback.format_exc()}"))


@contextlib.contextmanager
def main_module_hidden() -> Any:
    """While a worker starts, hide where ``__main__`` came from: multiprocessing would have the worker import it
    again, running an unguarded script's training inside the worker."""
    main = sys.modules.get("__main__")
    saved = {key: main.__dict__[key] for key in ("__file__", "__spec__") if main is not None and key in main.__dict__}
    try:
        for key in saved:
            if key == "__spec__":
                main.__spec__ = None
            else:
                del main.__dict__[key]
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


class _Worker:
    def __init__(self, context: Any, custom_function: str | None, max_memory_mb: int | None = None) -> None:
        self.connection, child_connection = context.Pipe(duplex=True)
        self.process = context.Process(target=_worker_loop, args=(child_connection, custom_function, max_memory_mb),
                                       daemon=True, name="reinforge-scorer")
        with main_module_hidden():
            self.process.start()
        child_connection.close()
        self.ready = False
        self.job_index: int | None = None
        self.deadline = 0.0
        self.started_at = time.monotonic()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(_STOP_TIMEOUT_S)
        self.connection.close()


def _stop_workers(workers: list[_Worker]) -> None:
    for worker in workers:
        try:
            worker.connection.send(None)
        except (OSError, ValueError):
            pass
    for worker in workers:
        worker.process.join(_STOP_TIMEOUT_S)
        worker.kill()


def _preload_in_forkserver() -> None:
    """Add this module to what multiprocessing's forkserver imports when it starts (the first pool of the process
    starts it), after whatever the process asked for already: each worker is then a fork of an interpreter that
    has ``reinforge.reward`` imported, instead of importing it again (0.1 s of CPU a pool of four, every run). A
    forkserver already running keeps what it has; its workers import the module themselves, as before."""
    from multiprocessing import forkserver

    preload = list(getattr(getattr(forkserver, "_forkserver", None), "_preload_modules", None) or ["__main__"])
    if __name__ not in preload:
        forkserver.set_forkserver_preload([*preload, __name__])


class ScoringPool:
    """``num_workers`` scorer processes; ``run`` gives each job at most ``timeout_s`` seconds (and each worker
    at most ``max_memory_mb`` of heap; None: no cap)."""

    def __init__(self, num_workers: int, timeout_s: float, custom_function: str | None = None,
                 max_memory_mb: int | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"a scoring pool needs at least one worker, got reward.num_workers={num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"reward.timeout_s={timeout_s} must be positive")
        methods = multiprocessing.get_all_start_methods()
        self._context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if "forkserver" in methods:
            _preload_in_forkserver()
        self.timeout_s = timeout_s
        self.custom_function = custom_function
        self.max_memory_mb = max_memory_mb
        self._workers = [_Worker(self._context, custom_function, max_memory_mb) for _ in range(num_workers)]
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    def close(self) -> None:
        self._finalizer()

    def run(self, jobs: list[ScoringJob]) -> list[JobResult]:
        """One result per job, in order; never raises for a scorer's error or timeout."""
        if not self._finalizer.alive:
            raise RuntimeError("this ScoringPool is closed")
        results: list[JobResult | None] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        while pending or any(worker.job_index is not None for worker in self._workers):
            for worker in self._workers:
                if worker.ready and worker.job_index is None and pending:
                    self._dispatch(worker, pending.popleft(), jobs, results)
            busy = [worker for worker in self._workers if worker.job_index is not None]
            starting = [worker for worker in self._workers if not worker.ready]
            if not busy and not starting:
                continue
            wait_s = max(0.0, min(worker.deadline for worker in busy) - time.monotonic()) if busy else None
            by_connection = {worker.connection: worker for worker in busy + starting}
            for connection in wait(list(by_connection), timeout=wait_s if wait_s is not None else 1.0):
                self._receive(by_connection[connection], results)
            self._enforce_deadlines(results)
        return [result if result is not None else JobResult(error="no result") for result in results]

    def _dispatch(self, worker: _Worker, job_index: int, jobs: list[ScoringJob], results: list) -> None:
        try:
            worker.connection.send(jobs[job_index])
        except Exception:
            results[job_index] = JobResult(error="the job could not be sent to a scorer process; a scorer must be "
                                                 "a module-level function (not a lambda or closure) and its inputs "
                                                 f"picklable:\n{traceback.format_exc()}")
            return
        worker.job_index = job_index
        worker.deadline = time.monotonic() + self.timeout_s * jobs[job_index].time_units

    def _receive(self, worker: _Worker, results: list) -> None:
        try:
            status, payload = worker.connection.recv()
        except (EOFError, OSError):
            worker.process.join(_STOP_TIMEOUT_S)
            reason = f"the scorer process died (exit code {worker.process.exitcode})"
            if worker.job_index is not None and worker.process.exitcode == MEMORY_EXCEEDED_EXIT_CODE:
                results[worker.job_index] = JobResult(memory_exceeded=True)
            elif worker.job_index is not None:
                results[worker.job_index] = JobResult(error=reason)
            elif not worker.ready:
                raise RuntimeError(
                    f"a scorer process failed to start ({reason}); its traceback is on stderr above. Scorer "
                    "processes are fresh interpreters that import reinforge.reward; set reward.num_workers=0 to "
                    "score in the trainer's process") from None
            self._replace(worker)
            return
        if status == "ready":
            worker.ready = True
            return
        if status == "startup_error":
            last_line = payload.strip().splitlines()[-1]
            raise RuntimeError(f"a scorer process failed to start: {last_line}; scorer processes are fresh Python "
                               "interpreters that import reinforge.reward, so it must import there too (check the "
                               "environment: PYTHONPATH, installed packages), or set reward.num_workers=0 to score "
                               "in the trainer's process")
        assert worker.job_index is not None, f"a scorer process answered {status!r} without a job"
        results[worker.job_index] = JobResult(value=payload) if status == "ok" else JobResult(error=payload)
        worker.job_index = None

    def _enforce_deadlines(self, results: list) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.job_index is not None and now >= worker.deadline:
                results[worker.job_index] = JobResult(timed_out=True)
                self._replace(worker)
            elif not worker.ready and now - worker.started_at > _STARTUP_TIMEOUT_S:
                raise RuntimeError(f"a scorer process did not start within {_STARTUP_TIMEOUT_S:.0f} s")

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        position = self._workers.index(worker)
        self._workers[position] = _Worker(self._context, self.custom_function, self.max_memory_mb)
