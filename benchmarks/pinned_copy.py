"""Host-to-device copy speed from the kinds of page-locked host memory FSDP's CPU offload can read.

    python3 benchmarks/pinned_copy.py [OUT.json]

The tensors are one Qwen2.5-7B decoder layer's bf16 weights (466 MiB in 12 tensors), copied to the
device tensor by tensor with ``non_blocking=True`` as FSDP's all-gather input does, 28 layers a pass,
from: PyTorch's caching host allocator (``pin_memory=True``, each block a power of two: FSDP's own
pinning), one anonymous mapping page-locked with ``cudaHostRegister`` (``engine.fsdp.pin_offloaded_shards``),
the same mapping advised to use transparent huge pages first, and pageable memory for scale.
"""

from __future__ import annotations

import json
import mmap
import sys
import time

import torch

SHAPES = [(3584, 3584), (512, 3584), (512, 3584), (3584, 3584), (18944, 3584), (18944, 3584), (3584, 18944),
          (3584,), (512,), (512,), (3584,), (3584,)]
LAYERS, PASSES = 28, 3


def layer_bytes() -> int:
    return sum(torch.Size(shape).numel() * 2 for shape in SHAPES)


def views(buffer: torch.Tensor) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in SHAPES:
        size = torch.Size(shape).numel() * 2
        out.append(buffer[offset:offset + size].view(torch.bfloat16).view(shape))
        offset += -(-size // 512) * 512
    return out


REGISTERED: list[torch.Tensor] = []


def registered(hugepages: bool) -> list[list[torch.Tensor]]:
    layers = []
    cudart = torch.cuda.cudart()
    for _ in range(LAYERS):
        mapping = mmap.mmap(-1, layer_bytes() + 512 * len(SHAPES))
        if hugepages:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)
        buffer.fill_(1)
        assert cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0) == cudart.cudaError.success
        REGISTERED.append(buffer)
        layers.append(views(buffer))
    return layers


def timed(layers: list[list[torch.Tensor]], targets: list[torch.Tensor]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(PASSES):
        for layer in layers:
            for source, target in zip(layer, targets, strict=True):
                target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    return PASSES * LAYERS * layer_bytes() / (time.perf_counter() - start) / 1e9


def main() -> None:
    targets = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for shape in SHAPES]
    kinds = {
        "caching host allocator (FSDP's pinning)": lambda: [[torch.ones(s, dtype=torch.bfloat16, pin_memory=True)
                                                              for s in SHAPES] for _ in range(LAYERS)],
        "cudaHostRegister'd mapping": lambda: registered(False),
        "cudaHostRegister'd mapping, MADV_HUGEPAGE": lambda: registered(True),
        "pageable": lambda: [[torch.ones(s, dtype=torch.bfloat16) for s in SHAPES] for _ in range(LAYERS)],
    }
    results = {}
    for name, build in kinds.items():
        layers = build()
        timed(layers[:2], targets)  # warm-up
        results[name] = max(timed(layers, targets) for _ in range(2))
        del layers
        for buffer in REGISTERED:  # before the mappings go
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
        REGISTERED.clear()
    for name, rate in results.items():
        print(f"{name:45} {rate:6.1f} GB/s host to device")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
