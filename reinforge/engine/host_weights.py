"""A frozen model's weights parked on the host between calls, in one page-locked buffer of their exact size.

A frozen model that shares the device with the hybrid engine (the reward model) needs its weights
only while it scores. ``HostWeights`` copies its parameters' storages (FSDP2's local shards, or
plain tensors) once into a host buffer, page-locked where the device is CUDA (so copies back are
asynchronous and run at full speed); ``release`` then frees their device memory by resizing
the storages to nothing, and ``restore`` gives them their size back and copies the host bytes in.
The tensors themselves, and FSDP's views of them, stay the same objects throughout, which is why
the storages are resized rather than the module moved: nothing that holds a parameter notices.
The weights never change, so the host copy made once stays right.
"""

from __future__ import annotations

import mmap

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from reinforge.engine.fsdp import register_host_memory
from reinforge.engine.memory_plan import shard_aligned


def _as_bytes(storage: torch.UntypedStorage) -> Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostWeights:
    def __init__(self, model: nn.Module):
        storages: dict[int, torch.UntypedStorage] = {}
        for parameter in model.parameters():
            local = parameter._local_tensor if isinstance(parameter, DTensor) else parameter.data
            storage = local.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage)
        self.storages = [storage for storage in storages.values() if storage.nbytes() > 0]
        self.sizes = [storage.nbytes() for storage in self.storages]
        self.offsets, total = [], 0
        for size in self.sizes:
            self.offsets.append(total)
            total += shard_aligned(size)
        self.buffer = torch.frombuffer(mmap.mmap(-1, max(total, 1)), dtype=torch.uint8)
        self.pinned = bool(self.storages) and self.storages[0].device.type == "cuda" and register_host_memory(self.buffer)
        for storage, offset, size in zip(self.storages, self.offsets, self.sizes, strict=True):
            self.buffer[offset:offset + size].copy_(_as_bytes(storage))
        self.on_device = True

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def release(self) -> None:
        """Free the weights' device memory (after every kernel that reads them has run)."""
        if not self.on_device:
            return
        if self.storages and self.storages[0].device.type == "cuda":
            torch.cuda.synchronize(self.storages[0].device)
        for storage in self.storages:
            storage.resize_(0)
        self.on_device = False

    def restore(self) -> None:
        """Give the weights their device memory back, copied from the host (queued on the current stream)."""
        if self.on_device:
            return
        for storage, offset, size in zip(self.storages, self.offsets, self.sizes, strict=True):
            storage.resize_(size)
            _as_bytes(storage).copy_(self.buffer[offset:offset + size], non_blocking=self.pinned)
        self.on_device = True
