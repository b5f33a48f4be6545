"""Compiling a timed choice's candidates together on threads (rollout/native/compile_ahead.py): on the CPU, the real
compile for sm_90 through the JIT's own path (Triton's driver answers for an H100 there; nothing can launch), and on
the GPU, kernels compiled ahead then run and give the reference's numbers.

Run the GPU one with ``pytest -q -m gpu tests/rollout/native/test_compile_ahead.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from compiled_outside_interpreter import compile_report  # noqa: E402  (tests/: conftest.py)

from reinforge.rollout.native import compile_ahead, moe_kernels  # noqa: E402
from reinforge.rollout.native.moe_kernels import DecodeTiles  # noqa: E402

COMPILE_WITHOUT_DEVICE = r"""
import json, logging, os, tempfile, threading
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import driver

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # compile, do not find last run's kernels on disk

class Hopper(CudaDriver):  # the JIT asks the driver for its target, device and stream; nothing here launches
    def __init__(self): self.utils = None
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_active_torch_device(self): return torch.device("cpu")
    @staticmethod
    def is_active(): return True

driver.set_active(Hopper())
torch.cuda.is_available = lambda: True
from reinforge.rollout.native import compile_ahead, dense_kernels, moe_kernels
from reinforge.rollout.native.dense_kernels import DenseTiles
from reinforge.rollout.native.moe_kernels import DecodeTiles

threads = set()
compile_fn = triton.compiler.compile
def noting_thread(*args, **kwargs):  # the JIT takes triton.compiler.compile when it first binds a kernel
    threads.add(threading.current_thread().name.rsplit("_", 1)[0])
    return compile_fn(*args, **kwargs)
triton.compiler.compile = noting_thread

experts, hidden, inter, tokens, top_k = 8, 256, 128, 4, 2
x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
gate_up = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16)
down = torch.randn(experts, hidden, inter, dtype=torch.bfloat16)
order = torch.zeros(tokens * top_k, dtype=torch.int64)
bounds = torch.zeros(experts + 1, dtype=torch.int32)
routing = torch.rand(tokens * top_k)
activated = torch.empty(tokens * top_k, inter, dtype=torch.bfloat16)
moe_tiles = [DecodeTiles(block_t=16), DecodeTiles(block_k=64)]
dense_tiles = [DenseTiles(block_t=16, block_n=64, block_k=128, split_k=2)]
runs = [lambda t=t: moe_kernels.expert_gate_up_silu(x, gate_up, bounds, order, top_k, t) for t in moe_tiles]
runs += [lambda t=t: moe_kernels.expert_down_scatter(activated, down, bounds, order, routing, t) for t in moe_tiles]
runs += [lambda t=t: dense_kernels.down(x, down[0].T.contiguous(), None, t) for t in dense_tiles]
runs += [lambda: 1 / 0]  # a candidate that cannot start is skipped
compile_ahead.compile_ahead(runs, "test", threads=3)
caches = {kernel.__name__: len(kernel.device_caches[0][0]) for kernel in (
    moe_kernels._gate_up_silu_kernel, moe_kernels._down_scatter_kernel, dense_kernels._down_kernel,
    dense_kernels._split_sum_kernel)}
print(json.dumps([{"caches": caches, "threads": sorted(threads)}]))
"""


def test_candidates_compile_together_for_hopper_on_threads_and_none_runs():
    """Each candidate's kernels compile for sm_90 on the pool's threads, through the JIT's asynchronous path, and
    land in the kernels' caches, where the timed runs find them; none is launched (the driver here can launch
    nothing), a run that raises is skipped."""
    report = compile_report(COMPILE_WITHOUT_DEVICE)[0]
    assert report["caches"] == {"_gate_up_silu_kernel": 2, "_down_scatter_kernel": 2, "_down_kernel": 1,
                                "_split_sum_kernel": 1}
    assert report["threads"] == ["triton-compile"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's case: no CUDA, Triton's interpreter")
def test_without_cuda_nothing_compiles_ahead_and_launch_runs_the_kernel():
    """Without CUDA compile_ahead starts none of the runs; ``launch`` runs the kernel (in Triton's interpreter)."""
    order = torch.tensor([2, 0, 1, 1, 0, 2], dtype=torch.int32)
    ran = []
    compile_ahead.compile_ahead([lambda: ran.append(1), lambda: ran.append(2)], "nothing")
    assert ran == []
    bounds, positions = moe_kernels.expert_order(order, 3)
    assert bounds.tolist() == [0, 2, 4, 6]
    assert positions.tolist() == [1, 4, 2, 3, 0, 5]


@pytest.mark.gpu
def test_kernels_compiled_ahead_run_and_give_the_reference_numbers(tmp_path, monkeypatch):
    """On the device: the swapped expert kernels of several tilings compiled ahead on threads, then run, equal the
    per-expert reference."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    experts, hidden, inter, tokens, top_k = 16, 512, 256, 32, 4
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=generator).bfloat16()
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=generator) * 0.05).bfloat16()
    expert_ids = torch.randint(0, experts, (tokens * top_k,), device="cuda", generator=generator)
    bounds, order = moe_kernels.expert_order(expert_ids, experts)
    tilings = [DecodeTiles(block_t=16, num_stages=2), DecodeTiles(block_t=32, block_k=64, num_stages=3),
               DecodeTiles(block_k=64, num_stages=4, num_warps=8)]
    compile_ahead.compile_ahead([lambda t=t: moe_kernels.expert_gate_up_silu(x, gate_up, bounds, order, top_k, t)
                                 for t in tilings], "test")
    cached = len(moe_kernels._gate_up_silu_kernel.device_caches[torch.cuda.current_device()][0])
    assert cached >= len(tilings)
    sorted_rows = x[order // top_k].float()
    sorted_experts = expert_ids[order]
    gate, up = torch.einsum("ah,aih->ai", sorted_rows, gate_up[sorted_experts].float()).chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    for tiles in tilings:
        out = moe_kernels.expert_gate_up_silu(x, gate_up, bounds, order, top_k, tiles)
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
