"""Backends: where the members of a worker group live and how a call reaches one of them.

A backend builds the members (``start``) and runs one method on one member (``submit``),
answering with a ``concurrent.futures.Future`` in both cases. ``WorkerGroup`` does the
dispatching and waits on the futures with a deadline, so every backend behaves the same way.

``local`` keeps the members in the controller's process. Each member owns one thread that
builds the worker and then runs its calls one after the other, as a Ray actor would: calls to
different members overlap, and a hung member cannot block the controller past its deadline.
The threads are daemons, so a member stuck in a call does not keep the process alive.

``ray`` (``ray_backend.py``, which registers it when imported; its ``RayWorkerGroup`` is the
group to use) runs each member as a Ray actor process on its own device and adds the member's
node and log lines to errors. This module never imports it: Ray stays optional, and imports
point one way (ray_backend -> worker_group -> backends).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from reinforge.controller.resource_pool import ResourcePool
from reinforge.controller.worker import Worker, construct_worker


class Backend(Protocol):
    num_members: int

    def start(self, worker_cls: type[Worker], init_args: tuple[Any, ...], init_kwargs: dict[str, Any]) -> list[Future]:
        """Build one worker per member; one future per member, done when that worker is built."""
        ...

    def submit(self, member_index: int, method_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future:
        """Run ``worker.method_name(*args, **kwargs)`` on one member."""
        ...

    def shutdown(self, wait_s: float | None = 60.0) -> None:
        """Release the members; calls still running may finish in the background.

        ``wait_s``: how long to wait for a member's running call to end (local threads).
        """
        ...


BackendFactory = Callable[[str, int, "ResourcePool | None"], Backend]
BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    """Add a backend, built as ``factory(role, num_members, resource_pool)``."""
    def add(factory: BackendFactory) -> BackendFactory:
        if name in BACKENDS:
            raise ValueError(f"controller backend {name!r} is registered twice")
        BACKENDS[name] = factory
        return factory
    return add


def build_backend(name: str, role: str, num_members: int, resource_pool: ResourcePool | None) -> Backend:
    if name not in BACKENDS:
        hint = "; build the group with reinforge.controller.ray_backend.RayWorkerGroup" if name == "ray" else ""
        raise ValueError(f"unknown controller backend {name!r} for role {role!r}; known backends: "
                         f"{sorted(BACKENDS)}{hint}")
    return BACKENDS[name](role, num_members, resource_pool)


class _MemberThread:
    """One daemon thread running submitted functions in order."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue[tuple[Future, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, function: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._queue.put((future, function))
        return future

    def stop(self, timeout_s: float | None = 60.0) -> None:
        """Finish the queued calls, then end the thread (waiting at most ``timeout_s`` for it).

        Joining matters: a thread that ran torch code and is still alive when the interpreter
        exits can abort the process during teardown.
        """
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            self._run(*item)
            item = None  # drop the last call's arguments and result while waiting for the next one

    @staticmethod
    def _run(future: Future, function: Callable[[], Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = function()
        except BaseException as error:  # noqa: BLE001 - every failure belongs to the caller
            future.set_exception(error)
        else:
            future.set_result(result)


@register_backend("local")
class LocalBackend:
    def __init__(self, role: str, num_members: int, resource_pool: ResourcePool | None = None):
        self.role = role
        self.num_members = num_members
        self.resource_pool = resource_pool
        self._workers: list[Worker | None] = [None] * num_members
        self._threads = [_MemberThread(f"reinforge-{role}-rank{rank}") for rank in range(num_members)]
        self._stopped = False

    def start(self, worker_cls: type[Worker], init_args: tuple[Any, ...], init_kwargs: dict[str, Any]) -> list[Future]:
        def build(rank: int) -> None:
            self._workers[rank] = construct_worker(worker_cls, rank, self.num_members, init_args, init_kwargs)

        return [thread.submit(lambda rank=rank: build(rank)) for rank, thread in enumerate(self._threads)]

    def submit(self, member_index: int, method_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future:
        if self._stopped:
            raise RuntimeError(f"the local backend of role {self.role!r} is shut down; build a new WorkerGroup")

        def call() -> Any:
            worker = self._workers[member_index]
            if worker is None:
                raise RuntimeError(f"rank {member_index} of role {self.role!r} has no worker; its construction failed")
            return getattr(worker, method_name)(*args, **kwargs)

        return self._threads[member_index].submit(call)

    def shutdown(self, wait_s: float | None = 60.0) -> None:
        """Queued calls still run; then each member drops its worker and its thread ends.

        Each member's thread is waited for at most ``wait_s`` seconds (a stopped run passes a
        short wait: its process then ends with the thread, see ``reinforge.stop_signals``).
        """
        if self._stopped:
            return
        self._stopped = True

        def release(rank: int) -> None:
            self._workers[rank] = None

        for rank, thread in enumerate(self._threads):
            thread.submit(lambda rank=rank: release(rank))
            thread.stop(wait_s)
