"""WorkerGroup: the controller's handle on the members of one role.

``WorkerGroup(ActorRolloutWorker, config, name="actor_rollout")`` builds the members through a
backend and exposes each ``@register`` method of the worker class as a method of the group:
``group.generate(batch)`` splits, calls every member, waits and gathers as the method's
dispatch mode says (see ``dispatch.py``). Every call has a deadline (``timeout_s`` of the group,
or ``group.generate.with_timeout(seconds)``); ``group.generate.async_call(batch)`` returns a
``GroupFuture`` at once. A member's exception or a missed deadline raises in the controller
with the role, rank and method named.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any

from reinforge.controller.backends import Backend, build_backend
from reinforge.controller.dispatch import CallPlan, collect_results, plan_member_calls
from reinforge.controller.register import MethodSpec
from reinforge.controller.resource_pool import ResourcePool
from reinforge.controller.worker import Worker


class WorkerCallError(RuntimeError):
    """A member raised; the member's exception is the ``__cause__``."""


class WorkerTimeoutError(TimeoutError):
    """A call passed its deadline; the members that had not finished may still be running it."""


_GROUP_DEADLINE = object()


class GroupFuture:
    """The pending result of one group call. ``result()`` waits, gathers and raises like a blocking call."""

    def __init__(self, group: WorkerGroup, method_name: str, member_futures: list[Future],
                 finish: Callable[[list[Any]], Any], timeout_s: float | None):
        self._group = group
        self._method_name = method_name
        self._member_futures = member_futures
        self._finish = finish
        self._timeout_s = timeout_s
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._has_result = False
        self._result: Any = None

    def done(self) -> bool:
        return all(future.done() for future in self._member_futures)

    def result(self, timeout_s: Any = _GROUP_DEADLINE) -> Any:
        """Wait for every member, then gather.

        Without ``timeout_s`` the call's own deadline applies (counted from submission);
        ``timeout_s`` waits at most that many seconds from now, ``None`` waits without limit.
        """
        if self._has_result:
            return self._result
        if timeout_s is _GROUP_DEADLINE:
            deadline, limit = self._deadline, self._timeout_s
        else:
            deadline, limit = (None if timeout_s is None else time.monotonic() + timeout_s), timeout_s
        results = self._group._wait(self._method_name, self._member_futures, deadline, limit)
        self._result = self._finish(results)
        self._has_result = True
        self._member_futures = []
        return self._result


class GroupMethod:
    """A registered worker method as seen from the controller."""

    def __init__(self, group: WorkerGroup, name: str, spec: MethodSpec, timeout_s: float | None):
        self._group = group
        self.__name__ = name
        self.spec = spec
        self.timeout_s = timeout_s
        self.__doc__ = getattr(group.worker_cls, name).__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.async_call(*args, **kwargs).result()

    def async_call(self, *args: Any, **kwargs: Any) -> GroupFuture:
        """Submit to the members and return at once; ``.result()`` gives what the call would return."""
        return self._group._submit(self.__name__, self.spec, args, kwargs, self.timeout_s)

    def with_timeout(self, timeout_s: float | None) -> GroupMethod:
        """The same method with another deadline (``None``: none)."""
        return GroupMethod(self._group, self.__name__, self.spec, timeout_s)

    def __repr__(self) -> str:
        return f"<{self._group.name}.{self.__name__}: {self.spec.dispatch.name}, timeout_s={self.timeout_s}>"


class WorkerGroup:
    """The members of one role, driven as one object.

    ``init_args`` (positional, after the worker class) and ``init_kwargs`` go to every member's
    ``__init__``. ``num_members`` defaults to the resource pool's size, or 1. ``timeout_s`` is
    the deadline of construction and of every call (``None``: wait without limit).
    """

    def __init__(self, worker_cls: type[Worker], *init_args: Any, name: str | None = None,
                 num_members: int | None = None, backend: str = "local",
                 resource_pool: ResourcePool | None = None, timeout_s: float | None = None,
                 init_kwargs: dict[str, Any] | None = None):
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"WorkerGroup needs a subclass of reinforge.controller.Worker, got {worker_cls!r}")
        self.worker_cls = worker_cls
        self.name = name or worker_cls.__name__
        if num_members is None:
            num_members = resource_pool.world_size if resource_pool is not None else 1
        if num_members < 1:
            raise ValueError(f"worker group {self.name!r} needs at least one member, got num_members={num_members}")
        if resource_pool is not None and resource_pool.world_size != num_members:
            raise ValueError(f"worker group {self.name!r} has num_members={num_members} but resource pool "
                             f"{resource_pool.name!r} has {resource_pool.world_size} devices; give one or make them agree")
        self.num_members = num_members
        self.timeout_s = timeout_s
        self.methods = worker_cls.registered_methods()
        clashes = sorted(set(self.methods) & ({"backend", *vars(self), *dir(WorkerGroup)}))
        if clashes:
            raise TypeError(f"{worker_cls.__name__} registers {clashes}, which WorkerGroup uses itself; rename them")
        self.backend: Backend = build_backend(backend, self.name, num_members, resource_pool)
        try:
            self._wait("__init__", self.backend.start(worker_cls, init_args, dict(init_kwargs or {})),
                       None if timeout_s is None else time.monotonic() + timeout_s, timeout_s)
        except BaseException:
            self.backend.shutdown()
            raise
        for method_name, spec in self.methods.items():
            setattr(self, method_name, GroupMethod(self, method_name, spec, timeout_s))

    def shutdown(self, wait_s: float | None = 60.0) -> None:
        """Release the workers, waiting at most ``wait_s`` seconds for a call still running on a local member."""
        self.backend.shutdown(wait_s)

    def __repr__(self) -> str:
        return (f"WorkerGroup({self.worker_cls.__name__}, name={self.name!r}, num_members={self.num_members}, "
                f"methods={sorted(self.methods)})")

    # ---- one call ------------------------------------------------------------------------
    def _submit(self, method_name: str, spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any],
                timeout_s: float | None) -> GroupFuture:
        plan: CallPlan = plan_member_calls(spec, method_name, self.num_members, args, kwargs)
        futures = [self.backend.submit(rank, method_name, member_args, member_kwargs)
                   for rank, (member_args, member_kwargs) in enumerate(plan.member_arguments)]
        return GroupFuture(self, method_name, futures,
                           lambda results: collect_results(spec, plan, method_name, results), timeout_s)

    def _describe(self) -> str:
        if self.name == self.worker_cls.__name__:
            return f"worker group {self.name!r}"
        return f"worker group {self.name!r} ({self.worker_cls.__name__})"

    def _wait(self, method_name: str, futures: list[Future], deadline: float | None,
              timeout_s: float | None) -> list[Any]:
        """Results by rank; the first member error (lowest rank) or a missed deadline raises."""
        pending = set(futures)
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            _, pending = wait(pending, timeout=remaining, return_when=FIRST_EXCEPTION)
            for rank, future in enumerate(futures):
                if future.done() and future.exception() is not None:
                    error = future.exception()
                    raise WorkerCallError(
                        f"{self._describe()} rank {rank} of {self.num_members} raised in {method_name}: "
                        f"{type(error).__name__}: {error}") from error
            if pending and deadline is not None and time.monotonic() >= deadline:
                late = [rank for rank, future in enumerate(futures) if future in pending]
                raise WorkerTimeoutError(
                    f"{self._describe()}: {method_name} did not finish within {timeout_s:g} s on rank(s) {late} "
                    f"of {self.num_members} and may still be running there; if it is not hung, raise the deadline "
                    f"(timeout_s of the group, e.g. trainer.call_timeout_s, or .with_timeout(seconds) on the method)")
        return [future.result() for future in futures]
