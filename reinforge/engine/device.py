"""Which device a worker runs on, and the mixed-precision context of its forward passes.

Parameters and optimizer state stay in float32 (master weights); on CUDA the forward runs
under bfloat16 autocast unless model.dtype asks otherwise. On the CPU everything is float32.
"""

from __future__ import annotations

import contextlib

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=auto or cpu")
    return torch.device(name)


def compute_dtype(device: torch.device, dtype_name: str) -> torch.dtype:
    if dtype_name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]


def autocast_context(device: torch.device, dtype_name: str) -> contextlib.AbstractContextManager:
    dtype = compute_dtype(device, dtype_name)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {"perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30}
