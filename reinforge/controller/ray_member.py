"""One member process of the Ray backend: the workers of every role placed on one device.

Roles that share a resource pool share these processes, one per device (GPU, or CPU slot):
the hybrid actor, the reference policy and the reward worker then live in one process per
GPU and see one ``torch.distributed`` group, the colocated layout of HybridFlow. The class is
plain Python; ``ray_pool`` turns it into a Ray actor.

Each member writes its own log file (stdout, stderr, Python logging, and the stack of every
thread on a crash or on SIGUSR1), so the controller can quote its last lines when it fails.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from reinforge.controller.ray_transport import to_wire
from reinforge.controller.worker import Worker, construct_worker

logger = logging.getLogger(__name__)


class _Tee:
    """A text stream that writes to the stream Ray captures and to the member's log file."""

    def __init__(self, stream: TextIO, log_file: TextIO):
        self._stream, self._log_file = stream, log_file

    def write(self, text: str) -> int:
        self._log_file.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._log_file.flush()
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class MemberHost:
    """Rank ``rank`` of the ``world_size`` members of resource pool ``pool_name``."""

    def __init__(self, pool_name: str, rank: int, world_size: int, local_rank: int, log_path: str, uses_gpu: bool,
                 working_dir: str):
        self.pool_name, self.rank, self.world_size, self.uses_gpu = pool_name, rank, world_size, uses_gpu
        if os.path.isdir(working_dir):  # relative paths (trainer.output_dir=runs/x) then mean what they mean to the controller
            os.chdir(working_dir)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "a", buffering=1)  # noqa: SIM115 - open for the process's lifetime
        sys.stdout = _Tee(sys.stdout, self._log_file)
        sys.stderr = _Tee(sys.stderr, self._log_file)
        handler = logging.StreamHandler(self._log_file)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        faulthandler.enable(file=self._log_file, all_threads=True)
        faulthandler.register(signal.SIGUSR1, file=self._log_file, all_threads=True)
        # Ray shows each member one GPU (CUDA_VISIBLE_DEVICES), so its device is cuda:0 whatever its local rank.
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0" if uses_gpu else str(local_rank))
        self.workers: dict[str, Worker] = {}
        logger.info("member rank %d of %d of pool %r started (pid %d, host %s)", rank, world_size, pool_name,
                    os.getpid(), socket.gethostname())

    def describe(self) -> dict[str, Any]:
        import ray

        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "hostname": socket.gethostname(), "pid": os.getpid()}

    def free_port(self) -> int:
        with socket.socket() as probe:
            probe.bind(("", 0))
            return probe.getsockname()[1]

    def init_distributed(self, master_addr: str, master_port: int, timeout_s: float) -> str:
        """Join the pool's process group (NCCL on GPUs, gloo on CPUs); returns the backend's name.

        ``timeout_s`` bounds every collective of the group, not only this rendezvous.
        """
        import torch
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        backend = "nccl" if self.uses_gpu else "gloo"
        if self.uses_gpu:
            torch.cuda.set_device(0)
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=timeout_s))
        logger.info("joined %s process group at %s:%d as rank %d of %d", backend, master_addr, master_port,
                    self.rank, self.world_size)
        return backend

    def build(self, role: str, worker_spec: tuple[type[Worker], tuple[Any, ...], dict[str, Any]]) -> None:
        worker_cls, init_args, init_kwargs = worker_spec
        if role in self.workers:
            raise RuntimeError(f"role {role!r} already has a worker in member {self.rank} of pool {self.pool_name!r}")
        logger.info("building %s for role %r", worker_cls.__name__, role)
        self.workers[role] = self._logged(role, "__init__", construct_worker, worker_cls, self.rank,
                                          self.world_size, init_args, init_kwargs)

    def call(self, role: str, method_name: str, kwarg_names: tuple[str, ...], *values: Any) -> Any:
        """``worker.method_name(*args, **kwargs)``; ``values`` holds the positional then the keyword values.

        Values travel as top-level arguments so that Ray resolves object references among them.
        """
        worker = self.workers.get(role)
        if worker is None:
            raise RuntimeError(f"member {self.rank} of pool {self.pool_name!r} has no worker for role {role!r}; "
                               f"it was never built or has been dropped")
        num_positional = len(values) - len(kwarg_names)
        kwargs = dict(zip(kwarg_names, values[num_positional:], strict=True))
        method = getattr(worker, method_name)
        return to_wire(self._logged(role, method_name, method, *values[:num_positional], **kwargs))

    def drop(self, role: str) -> None:
        self.workers.pop(role, None)

    def _logged(self, role: str, method_name: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except BaseException:
            logger.error("role %r: %s raised\n%s", role, method_name, traceback.format_exc().rstrip())
            raise
