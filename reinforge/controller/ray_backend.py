"""The Ray backend: each member of a worker group is a Ray actor process on its own device.

``connect_ray`` joins a cluster (``trainer.ray_address`` or ``RAY_ADDRESS``) or starts a local
Ray instance, and says where members write their logs. ``RayWorkerGroup`` is a ``WorkerGroup``
on this backend: the same registered methods and dispatch modes as the local backend, with

- one member process per device of the group's resource pool (``ray_pool``), shared by every
  role placed on that pool, with ``torch.distributed`` set up across the members;
- Batches sent through the object store as numpy buffers (``ray_transport``): a ONE_TO_ALL
  Batch is stored once per call, whatever the number of members, and read without copies;
- errors that name the role, rank, node and pid of the member and quote the last lines of
  its log file, when a member raises, dies, or misses the call's deadline.

The controller stays in the driver process and needs no device of its own.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import ray
except ImportError as error:  # Ray is an optional dependency
    raise ImportError(f"trainer.backend=ray needs Ray, which does not import ({error}); "
                      "install it with pip install 'reinforge[ray]'") from error

from reinforge.controller.backends import register_backend
from reinforge.controller.dispatch import Arguments
from reinforge.controller.ray_pool import (
    MemberInfo,
    PlacedPool,
    PoolSettings,
    acquire_pool,
    check_pools_fit,
    release_pool,
)
from reinforge.controller.ray_transport import WireBatch
from reinforge.controller.register import Dispatch, MethodSpec
from reinforge.controller.resource_pool import ResourcePool
from reinforge.controller.worker import Worker
from reinforge.controller.worker_group import GroupFuture, WorkerCallError, WorkerGroup, WorkerTimeoutError
from reinforge.protocol import Batch

LOG_LINES_IN_ERRORS = 20
_ANSI_CODES = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class RaySettings:
    log_dir: Path = Path("reinforge_member_logs")
    """Folder of the members' log files: ``<pool>_rank<N>.log``. The trainer uses RUN/logs."""
    device: str = "auto"
    """cuda: one GPU per member; cpu: one CPU slot per member; auto: cuda when the cluster has GPUs."""
    num_cpus_per_member: float = 1.0
    startup_timeout_s: float = 600.0
    """Deadline for placing a pool, starting its members and forming their process group."""
    collective_timeout_s: float = 1800.0
    """How long a member waits in one torch.distributed collective before it fails."""


_settings = RaySettings()


def connect_ray(address: str | None = None, **settings: Any) -> None:
    """Join a Ray cluster, or start a local one, and apply ``settings``.

    Ray looks for a cluster at ``RAY_ADDRESS``, then ``address`` (trainer.ray_address), then the
    latest ``ray start`` on this machine, and otherwise starts a Ray instance in this process.

    ``settings`` are fields of ``RaySettings``; they apply to pools placed from now on. When Ray
    is already initialised in this process, it is used as it is.
    """
    global _settings
    _settings = RaySettings(**{**_settings.__dict__, **settings})
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            check_reachable(os.environ["RAY_ADDRESS"], "RAY_ADDRESS")
        elif address:
            check_reachable(address, "trainer.ray_address")
        settings = {"address": address or None, "include_dashboard": False, "logging_level": "WARNING"}
        try:
            ray.init(**settings, _system_config=RAY_SYSTEM_CONFIG)
        except ValueError as error:  # a cluster was found to join (RAY_ADDRESS, the address, a `ray start`)
            if "_system_config must not be provided" not in str(error):
                raise
            ray.init(**settings)


RAY_SYSTEM_CONFIG = {"worker_niceness": 0}
"""The settings of a Ray instance this process starts. Ray starts its worker processes at niceness 15, behind every
other process of the machine; a run's members are the training itself, so they run at the driver's priority (beside
two busy processes on a 2-core machine, a CPU run's members took 16 times as long at 15). A cluster started with
``ray start`` keeps its own settings (``RAY_worker_niceness=0 ray start ...`` gives it this one)."""


CONNECT_TIMEOUT_S = 10.0
"""How long joining a cluster waits for its address to answer; Ray itself retries for minutes, silently."""


def check_reachable(address: str, source: str) -> None:
    """Refuse in one line (ConnectionError) a cluster address (``host:port`` or ``ray://host:port``) where nothing
    listens; ``source`` names the setting that gave it. ``auto`` and ``local`` pass: Ray resolves those."""
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise ConnectionError(f"{source}={address}: no Ray cluster answers at {host}:{port} ({error}); start one "
                              f"there (ray start --head --port={port}), fix the address, or leave it unset to start "
                              "Ray in this process") from None


def check_cluster_holds(pools: list[ResourcePool]) -> None:
    """Refuse at once, in one line (ValueError), pools the cluster cannot hold together beside the pools placed
    already: a run checks every pool of its roles before its first group loads a model."""
    if not ray.is_initialized():
        connect_ray()
    check_pools_fit(pools, _pool_settings())


def check_sendable(value: Any, what: str) -> None:
    """Refuse in one line (ValueError) a value that Ray cannot send to the member processes: a function that holds a
    lock, an open file or a client, say. ``what`` names it, e.g. ``reward_functions[0] (my_reward)``."""
    try:
        ray.cloudpickle.dumps(value)
    except Exception as error:  # noqa: BLE001 - pickling raises TypeError, PicklingError, AttributeError, ...
        reason = (str(error).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{what} cannot be sent to the Ray members ({type(error).__name__}: {reason}); create "
                         "what it holds (locks, files, clients) inside the function, or use trainer.backend=local, "
                         "which runs it in this process") from None


def _pool_settings() -> PoolSettings:
    uses_gpu = _settings.device == "cuda" or (_settings.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    return PoolSettings(Path(_settings.log_dir).absolute(), uses_gpu, _settings.num_cpus_per_member,
                        _settings.startup_timeout_s, _settings.collective_timeout_s)


class MemberDiedError(RuntimeError):
    """A member process ended (crash, out of memory, killed, node lost) while its group still needed it."""


@register_backend("ray")
class RayBackend:
    def __init__(self, role: str, num_members: int, resource_pool: ResourcePool | None = None):
        if not ray.is_initialized():
            connect_ray()
        self.role = role
        self.num_members = num_members
        pool = resource_pool or ResourcePool(role, [num_members])
        self.placed: PlacedPool | None = acquire_pool(pool, role, _pool_settings())
        self.members: list[MemberInfo] = self.placed.members

    def start(self, worker_cls: type[Worker], init_args: tuple[Any, ...], init_kwargs: dict[str, Any]) -> list[Future]:
        spec = ray.put((worker_cls, init_args, init_kwargs))
        return [self._future(rank, "__init__", host.build.remote(self.role, spec))
                for rank, host in enumerate(self._hosts())]

    def submit(self, member_index: int, method_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future:
        values = [WireBatch(value) if isinstance(value, Batch) else value for value in (*args, *kwargs.values())]
        ref = self._hosts()[member_index].call.remote(self.role, method_name, tuple(kwargs), *values)
        return self._future(member_index, method_name, ref)

    def shutdown(self, wait_s: float | None = 60.0) -> None:
        """Drop this role's workers on their hosts (``wait_s`` is for local threads; Ray does not wait)."""
        if self.placed is None:
            return
        placed, self.placed = self.placed, None
        for host in placed.hosts:
            host.drop.remote(self.role)
        release_pool(placed, self.role)

    def _hosts(self) -> list[Any]:
        if self.placed is None:
            raise RuntimeError(f"the ray backend of role {self.role!r} is shut down; build a new worker group")
        return self.placed.hosts

    # ---- what went wrong where ------------------------------------------------------
    def describe_member(self, rank: int, with_log: bool = True) -> str:
        """Where rank ``rank`` runs, and (``with_log``) the last lines of its log file."""
        member = self.members[rank]
        where = f"rank {rank} of role {self.role!r} runs on {member.where()}"
        if not with_log:
            return f"{where}; log: {member.log_path}"
        return f"{where}; last lines of {member.log_path}:\n{_log_tail(member.log_path)}"

    def describe_late_members(self, ranks: list[int], max_logs: int = 2) -> str:
        """``describe_member`` of each rank, after asking those on this node to log their stacks."""
        this_node = ray.get_runtime_context().get_node_id()
        signalled = False
        for rank in ranks[:max_logs]:
            member = self.members[rank]
            if member.node_id == this_node:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member.pid, signal.SIGUSR1)  # the member's faulthandler logs every thread's stack
                    signalled = True
        if signalled:
            time.sleep(0.3)
        return "\n".join(self.describe_member(rank, with_log=index < max_logs) for index, rank in enumerate(ranks))

    def _future(self, rank: int, method_name: str, ref: Any) -> Future:
        """A future of ``ref``'s value whose errors say which member failed and how."""
        answer: Future = Future()

        def settle(ray_future: Future) -> None:
            error = ray_future.exception()
            if error is None:
                answer.set_result(ray_future.result())
                return
            try:
                answer.set_exception(self._explain(rank, method_name, error))
            except BaseException as explaining_error:  # noqa: BLE001 - the caller must hear of the failure
                error.add_note(f"(reinforge could not describe the member: {explaining_error!r})")
                answer.set_exception(error)

        ref.future().add_done_callback(settle)
        return answer

    def _explain(self, rank: int, method_name: str, error: BaseException) -> BaseException:
        if isinstance(error, ray.exceptions.RayTaskError):
            # Ray's error is also an instance of the member's exception; hand on that exception itself.
            cause = error.cause if isinstance(error.cause, BaseException) else error
            member = self.members[rank]
            remote_traceback = _ANSI_CODES.sub("", str(error)).strip()
            cause.add_note(f"raised by rank {rank} of role {self.role!r} on {member.where()} "
                           f"(log: {member.log_path}):\n{remote_traceback}")
            return cause
        if isinstance(error, ray.exceptions.RayActorError):
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            return MemberDiedError(f"the member process died during {method_name} ({first_line}); "
                                   f"{self.describe_member(rank)}")
        return error


def _log_tail(path: Path, num_lines: int = LOG_LINES_IN_ERRORS) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 64 * 1024))
            lines = log.read().decode(errors="replace").splitlines()[-num_lines:]
    except OSError as error:
        return f"    (cannot read it from the controller's machine: {error}; look on the member's node)"
    return "\n".join(f"    | {line}" for line in lines) or "    (empty)"


class RayWorkerGroup(WorkerGroup):
    """A ``WorkerGroup`` whose members are Ray actors; ``backend`` may only be ``"ray"``.

    Calls are the same as on any group; a member's failure, death or missed deadline raises
    ``WorkerCallError`` / ``WorkerTimeoutError`` with the member's node, pid and last log lines.
    """

    backend: RayBackend

    def __init__(self, worker_cls: type[Worker], *init_args: Any, name: str | None = None,
                 num_members: int | None = None, backend: str = "ray", resource_pool: ResourcePool | None = None,
                 timeout_s: float | None = None, init_kwargs: dict[str, Any] | None = None):
        if backend != "ray":
            raise ValueError(f"RayWorkerGroup runs on the ray backend, not {backend!r}; use WorkerGroup for it")
        super().__init__(worker_cls, *init_args, name=name, num_members=num_members, backend="ray",
                         resource_pool=resource_pool, timeout_s=timeout_s, init_kwargs=init_kwargs)

    def _submit(self, method_name: str, spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any],
                timeout_s: float | None) -> GroupFuture:
        if spec.dispatch is Dispatch.ONE_TO_ALL and not spec.runs_on_rank_zero_only and self.num_members > 1:
            args, kwargs = _store_batches_once((args, kwargs))
        return super()._submit(method_name, spec, args, kwargs, timeout_s)

    def _wait(self, method_name: str, futures: list[Future], deadline: float | None,
              timeout_s: float | None) -> list[Any]:
        try:
            return super()._wait(method_name, futures, deadline, timeout_s)
        except WorkerTimeoutError as error:
            late = [rank for rank, future in enumerate(futures) if not future.done()]
            raise WorkerTimeoutError(f"{error}\n{self.backend.describe_late_members(late)}") from None
        except WorkerCallError as error:
            dead = self._dead_member(futures)
            if dead is None or error.__cause__ is dead[1]:
                raise
            rank, death = dead
            raise WorkerCallError(f"{self._describe()} rank {rank} of {self.num_members} raised in {method_name}: "
                                  f"{type(death).__name__}: {death}") from death

    @staticmethod
    def _dead_member(futures: list[Future], grace_s: float = 2.0) -> tuple[int, MemberDiedError] | None:
        """The first member that died, if any did; a death is the root cause of its peers' failed collectives."""
        wait([future for future in futures if not future.done()], timeout=grace_s)
        for rank, future in enumerate(futures):
            if future.done() and isinstance(future.exception(), MemberDiedError):
                return rank, future.exception()
        return None


def _store_batches_once(arguments: Arguments) -> Arguments:
    """Each Batch argument put in the object store once, to reach every member as the same object."""
    def store(value: Any) -> Any:
        return ray.put(WireBatch(value)) if isinstance(value, Batch) else value

    args, kwargs = arguments
    return tuple(store(value) for value in args), {key: store(value) for key, value in kwargs.items()}
