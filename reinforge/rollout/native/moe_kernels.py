"""A Triton grouped GEMM for the experts of a decode step, and the timing that picks it over torch's.

A decode step of B sequences sends B * top_k rows to the experts, a few dozen each, so the expert products are
bound by reading every expert's weights once. ``expert_matmul`` runs ``rows_e @ W_e^T`` for every expert e over
the rows sorted by expert: one program per (expert, block of output columns) streams that block of W_e once
and multiplies every row of the expert with it (more than ``BLOCK_M`` rows read it again per block of rows).
Its bounds are read on the device, so a CUDA graph captures it.

torch's grouped GEMM (CUTLASS) is the default. ``ExpertKernelChoice`` times it and a few tilings of the Triton
kernel once per shape and row count, outside graph capture (the decode graph's warm-up forward runs first), and
keeps the fastest; a kernel that fails to compile or run leaves torch's in place, said in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

logger = logging.getLogger(__name__)



@triton.jit
def _expert_matmul_kernel(rows_ptr, weight_ptr, out_ptr, bounds_ptr, stride_row, stride_expert, stride_n, stride_k,
                          stride_out, num_cols, NUM_INNER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, STATIC_LOOP_END: tl.constexpr):
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    start = tl.load(bounds_ptr + expert)
    end = tl.load(bounds_ptr + expert + 1)
    weight = weight_ptr + expert.to(tl.int64) * stride_expert
    # STATIC_LOOP_END is 0 when compiled; Triton's interpreter loops only to Python ints (see the launcher)
    for offset in range(0, STATIC_LOOP_END if STATIC_LOOP_END else end - start, BLOCK_M):
        rows = start + offset + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, NUM_INNER, BLOCK_K):
            ks = k + inner
            a = tl.load(rows_ptr + rows[:, None].to(tl.int64) * stride_row + ks[None, :],
                        mask=row_mask[:, None] & (ks[None, :] < NUM_INNER), other=0.0)
            w = tl.load(weight + cols[None, :] * stride_n + ks[:, None] * stride_k,
                        mask=(cols[None, :] < num_cols) & (ks[:, None] < NUM_INNER), other=0.0)
            acc += tl.dot(a, w)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & (cols[None, :] < num_cols))


_INTERPRETED = isinstance(_expert_matmul_kernel, InterpretedFunction)


@dataclass(frozen=True)
class TileConfig:
    block_m: int = 64
    """Rows per block: an expert with more reads its weight block again per block of rows."""
    block_n: int = 64
    block_k: int = 128
    num_stages: int = 3
    num_warps: int = 4


TILE_CONFIGS = (TileConfig(), TileConfig(block_n=128, block_k=64, num_stages=4), TileConfig(block_k=64, num_stages=4))
"""The tilings ``ExpertKernelChoice`` times: the shared memory they take sets how many programs an SM keeps busy
streaming weights."""


def expert_matmul(rows: Tensor, weight: Tensor, bounds: Tensor, config: TileConfig = TileConfig()) -> Tensor:
    """rows[bounds[e]:bounds[e + 1]] @ weight[e]^T for every expert e, in rows' dtype.

    rows: (assignments, inner), rows contiguous, sorted by expert; weight: (experts, cols, inner), any strides;
    bounds: (experts + 1,) int32, 0 then each expert's cumulative end. Returns (assignments, cols).
    """
    num_experts, num_cols, num_inner = weight.shape
    out = torch.empty(rows.shape[0], num_cols, dtype=rows.dtype, device=rows.device)
    grid = (num_experts, triton.cdiv(num_cols, config.block_n))
    # compiled, each program loops over its expert's rows; Triton's interpreter cannot loop to a loaded value, so
    # there every program loops over all rows (those past its expert's end are masked)
    static_loop_end = max(rows.shape[0], 1) if _INTERPRETED else 0
    _expert_matmul_kernel[grid](rows, weight, out, bounds, rows.stride(0), weight.stride(0), weight.stride(1),
                                weight.stride(2), out.stride(0), num_cols, NUM_INNER=num_inner,
                                BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                                STATIC_LOOP_END=static_loop_end, num_warps=config.num_warps,
                                num_stages=config.num_stages)
    return out


MAX_ROWS_PER_EXPERT = 64
"""The Triton kernel is a candidate while the rows average at most this many per expert (decode steps); longer
batches (prefill) are compute-bound, where torch's grouped GEMM is the one to run."""


class ExpertKernelChoice:
    """Which grouped GEMM runs the experts, per (rows rounded up to a power of two, experts, cols, inner, dtype):
    torch's unless a tiling of Triton's (``TILE_CONFIGS``) was timed faster. Timing needs a stream that is not
    capturing; inside a capture an untimed shape runs torch's."""

    def __init__(self, repeats: int = 5):
        self.repeats = repeats
        self.picked: dict[tuple, TileConfig | None] = {}
        """key -> the Triton tiling that runs it, or None for torch's grouped GEMM."""
        self.failed = False

    def __call__(self, rows: Tensor, weight: Tensor, bounds: Tensor,
                 torch_matmul: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """``torch_matmul(rows, weight)``, or ``expert_matmul`` where it was timed faster."""
        config = self._config_for(rows, weight, bounds, torch_matmul)
        return torch_matmul(rows, weight) if config is None else expert_matmul(rows, weight, bounds, config)

    def _config_for(self, rows: Tensor, weight: Tensor, bounds: Tensor,
                    torch_matmul: Callable[[Tensor, Tensor], Tensor]) -> TileConfig | None:
        if self.failed or rows.shape[0] > MAX_ROWS_PER_EXPERT * weight.shape[0]:
            return None
        key = (triton.next_power_of_2(rows.shape[0]), *weight.shape, rows.dtype)  # prefills vary: rows by octave
        if key not in self.picked:
            if torch.cuda.is_current_stream_capturing():
                return None
            timings: dict[TileConfig | None, float] = {None: self._time(lambda: torch_matmul(rows, weight))}
            try:
                for config in TILE_CONFIGS:
                    timings[config] = self._time(lambda config=config: expert_matmul(rows, weight, bounds, config))
            except Exception as error:  # noqa: BLE001 (a kernel the device cannot compile or run: keep torch's)
                self.failed = True
                logger.warning("the Triton expert kernel failed (%s: %s); the experts run torch's grouped GEMM",
                               type(error).__name__, str(error).splitlines()[0] if str(error) else "")
                return None
            self.picked[key] = min(timings, key=timings.__getitem__)
            logger.info("experts of %d rows x %s: torch's grouped GEMM %.3f ms, Triton's tilings %s ms; running %s",
                        rows.shape[0], tuple(weight.shape), timings[None],
                        "/".join(f"{timings[config]:.3f}" for config in TILE_CONFIGS), self.picked[key] or "torch's")
        return self.picked[key]

    def _time(self, run: Callable[[], Tensor]) -> float:
        run()  # compiles, picks its kernels
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.repeats):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / self.repeats
