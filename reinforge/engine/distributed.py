"""torch.distributed for the engine: one code path for one process or many.

``init_distributed`` joins the process group that a backend prepared through the usual
environment variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; the Ray backend sets them
before it builds a worker), or, when they are absent, makes a group of one from an in-memory
store, so that FSDP2 and the collectives below run the same way on a single device.
"""

from __future__ import annotations

import atexit
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def init_distributed(backend: str = "auto", device_type: str | None = None) -> tuple[int, int]:
    """Join (or create) the default process group; returns (rank, world_size).

    backend: auto (nccl when CUDA is visible and the workers use it, else gloo), nccl or gloo.
    A group that already exists is reused as it is.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise RuntimeError(f"RANK and WORLD_SIZE are set but {name} is not; the backend that starts the "
                                   "workers must set MASTER_ADDR and MASTER_PORT too")
        dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(minutes=30))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    atexit.register(_destroy_group)
    return dist.get_rank(), dist.get_world_size()


GLOO_EXIT_GRACE_S = 0.2
"""How long a gloo rank waits at exit, before the interpreter's teardown, for gloo's threads to let go of the
collectives they finished (see ``_destroy_group``)."""


def _destroy_group() -> None:
    """At exit, the group made here is torn down before the interpreter's own teardown.

    A gloo worker thread drops its reference to a collective a moment after completing it. When that is
    the last reference and the collective's tensors are Python objects, the thread needs the GIL to free
    them; once the interpreter is finalizing, Python ends such a thread instead, and the unwinding through
    gloo's loop aborts the whole process ("terminate called without an active exception", exit -6) after
    all its work succeeded: about one two-rank run in 30 did so on a 2-core machine. Atexit handlers run
    before finalization, while threads may still take the GIL, so a short wait here lets them finish.
    """
    if dist.is_initialized():
        if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
            time.sleep(GLOO_EXIT_GRACE_S)
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(values: list[float], device: torch.device | None = None, op: str = "sum") -> list[float]:
    """Element-wise sum (or max) of ``values`` over all ranks; the values themselves in a group of one."""
    if world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device(device))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor.tolist()


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def _collective_device(device: torch.device) -> torch.device:
    # gloo reduces CPU tensors only; nccl needs CUDA ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
