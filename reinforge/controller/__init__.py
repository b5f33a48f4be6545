"""The single controller's side of HybridFlow: registered worker methods, worker groups, backends.

The trainer builds one ``WorkerGroup`` per role and calls its methods like plain functions on
``Batch`` objects; ``@register`` on the worker says how each call is spread over the members.
The Ray backend (``RayWorkerGroup`` in ``ray_backend``) is imported on first use, as Ray is optional.
"""

from reinforge.controller.backends import BACKENDS, Backend, LocalBackend, register_backend
from reinforge.controller.dispatch import average_metrics
from reinforge.controller.register import Dispatch, Execute, MethodSpec, register, registered_methods
from reinforge.controller.resource_pool import LOCAL_POOL, ResourcePool, RolePlacement
from reinforge.controller.worker import Worker, construct_worker
from reinforge.controller.worker_group import (
    GroupFuture,
    GroupMethod,
    WorkerCallError,
    WorkerGroup,
    WorkerTimeoutError,
)

__all__ = [
    "BACKENDS", "Backend", "Dispatch", "Execute", "GroupFuture", "GroupMethod", "LOCAL_POOL", "LocalBackend",
    "MethodSpec", "ResourcePool", "RolePlacement", "Worker", "WorkerCallError", "WorkerGroup",
    "WorkerTimeoutError", "average_metrics", "construct_worker", "register", "register_backend",
    "registered_methods",
]
