"""Triton grouped GEMMs for the experts of a decode step, and the timing that picks them over torch's.

A decode step of B sequences sends B * top_k rows to the experts, a few dozen each, so the expert products are
bound by reading every expert's weights once. Two kernel families run over the assignments sorted by expert, their
bounds read on the device, so a CUDA graph captures them:

- the swapped kernels compute ``W_e @ x^T``: the weight's output columns fill the MMA's M side and the expert's few
  rows its N side (16 to 64 slots), each program streaming one block of W_e's rows along K. ``expert_gate_up_silu``
  gathers each slot's hidden row itself and applies silu(gate) * up in its epilogue (gate and up columns in one
  program); ``expert_down_scatter`` weights each row by its routing weight and writes it at its assignment's row.
  A layer's experts are then three launches (``expert_order``'s counting sort and the two products) where torch's
  path has the sort, the gather, the histogram and its sum, two grouped GEMMs, the activation, the weighting and
  the un-permute.
- ``expert_matmul`` runs ``rows_e @ W_e^T`` one product at a time, one program per (expert, block of output
  columns), the rows gathered, activated, weighted and put back by torch.

torch's grouped GEMM (CUTLASS) is the default. ``ExpertKernelChoice`` times it, the tilings of each swapped
product and those of the tiled kernel once per shape and row count, outside graph capture (the decode graph's
warm-up forward runs first), on that many assignments spread over the experts (the warm-up's padding tokens all
pick the same experts), and keeps the fastest; a candidate that fails to compile or run, or gives other
numbers than torch's, is dropped in one line and the others (torch's at least) stay.
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


@triton.jit
def _rounded(x, like_ptr, BITWISE: tl.constexpr):
    """float32 x rounded to the element type of ``like_ptr`` (to nearest, ties to even), as float32. ``BITWISE``
    rounds to bf16 on the float32 bits: Triton's interpreter truncates its bf16 casts."""
    if BITWISE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _rotated(step, expert, first_col, NUM_INNER: tl.constexpr, BLOCK_K: tl.constexpr, ROTATE_K: tl.constexpr):
    """The K offset of a program's ``step``: with ``ROTATE_K`` (NUM_INNER a multiple of BLOCK_K) each program starts
    at its own block of K and wraps around, so programs running together read different columns of their weight rows
    (rows a power of two bytes apart would otherwise send them all to the same DRAM channels at once)."""
    if ROTATE_K:
        num_blocks: tl.constexpr = NUM_INNER // BLOCK_K
        return ((step // BLOCK_K + expert * 5 + first_col // 16) % num_blocks) * BLOCK_K
    return step


@triton.jit
def _gate_up_silu_block(hidden_ptr, weight_ptr, out_ptr, order_ptr, gate_rows, up_rows, expert, first_col, cols,
                        col_mask, start, end, offset, stride_hidden, stride_k, stride_out, num_inter,
                        TOP_K: tl.constexpr, NUM_INNER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, WEIGHT_TMA: tl.constexpr,
                        ROTATE_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One block of BLOCK_T slots from ``start + offset`` of ``_gate_up_silu_kernel``."""
    inner = tl.arange(0, BLOCK_K)
    slots = start + offset + tl.arange(0, BLOCK_T)
    slot_mask = slots < end
    tokens = tl.load(order_ptr + slots, mask=slot_mask, other=0) // TOP_K
    x_rows = hidden_ptr + tokens[:, None].to(tl.int64) * stride_hidden
    gate = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for step in range(0, NUM_INNER, BLOCK_K):
        k = _rotated(step, expert, first_col, NUM_INNER, BLOCK_K, ROTATE_K)
        ks = k + inner
        if EVEN_K:  # masks constant along K: 16-byte loads
            x_mask = slot_mask[:, None]
            w_mask = col_mask[:, None]
        else:
            x_mask = slot_mask[:, None] & (ks[None, :] < NUM_INNER)
            w_mask = col_mask[:, None] & (ks[None, :] < NUM_INNER)
        # the weights first: their loads need nothing the slots' loads wait for
        if WEIGHT_TMA:
            gate_w = weight_ptr.load([expert, first_col, k]).reshape(BLOCK_N, BLOCK_K)
            up_w = weight_ptr.load([expert, first_col + num_inter, k]).reshape(BLOCK_N, BLOCK_K)
        else:
            # each weight byte is read once: keep the rows (read by every program of the expert) in L2 instead
            gate_w = tl.load(gate_rows + ks[None, :] * stride_k, mask=w_mask, other=0.0,
                             eviction_policy="evict_first")
            up_w = tl.load(up_rows + ks[None, :] * stride_k, mask=w_mask, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
        if UPCAST:
            x, gate_w, up_w = x.to(tl.float32), gate_w.to(tl.float32), up_w.to(tl.float32)
        gate = tl.dot(gate_w, tl.trans(x), gate, input_precision=PRECISION)
        up = tl.dot(up_w, tl.trans(x), up, input_precision=PRECISION)
    # rounded as torch's products and the activation kernel round them (triton_kernels.act_and_mul)
    gate = _rounded(gate, out_ptr, UPCAST)
    activated = _rounded(gate / (1.0 + tl.exp(-gate)), out_ptr, UPCAST) * _rounded(up, out_ptr, UPCAST)
    tl.store(out_ptr + slots[None, :].to(tl.int64) * stride_out + cols[:, None],
             _rounded(activated, out_ptr, UPCAST).to(out_ptr.dtype.element_ty),
             mask=slot_mask[None, :] & col_mask[:, None])


@triton.jit
def _gate_up_silu_kernel(hidden_ptr, weight_ptr, out_ptr, bounds_ptr, order_ptr, stride_hidden, stride_expert,
                         stride_n, stride_k, stride_out, num_inter, TOP_K: tl.constexpr, NUM_INNER: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, WEIGHT_TMA: tl.constexpr, EAGER: tl.constexpr,
                         ROTATE_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                         STATIC_LOOP_END: tl.constexpr):
    """out[s, j] = silu(gate_e(x)) * up_e(x) for the expert e of sorted slot s and the inter columns j of this program;
    x is the hidden row of the slot's token (order[s] // TOP_K), gathered here. Products are W @ x^T: the weight's
    columns fill the MMA's M side, the expert's few slots its N side. ``WEIGHT_TMA``: weight_ptr is a
    (experts, 2 * inter, hidden) tensor descriptor of (1, BLOCK_N, BLOCK_K) blocks (gate columns past inter read up
    rows, which only masked outputs use). ``EAGER``: the first block of slots runs whatever the expert's bounds,
    so its weight loads start before the bounds arrive (an expert without rows reads its weights for nothing)."""
    expert = tl.program_id(0)
    first_col = tl.program_id(1) * BLOCK_N
    cols = first_col + tl.arange(0, BLOCK_N)
    col_mask = cols < num_inter
    start = tl.load(bounds_ptr + expert)
    end = tl.load(bounds_ptr + expert + 1)
    gate_rows = weight_ptr
    up_rows = weight_ptr
    if not WEIGHT_TMA:
        weight = weight_ptr + expert.to(tl.int64) * stride_expert
        gate_rows = weight + cols[:, None].to(tl.int64) * stride_n
        up_rows = weight + (cols[:, None] + num_inter).to(tl.int64) * stride_n
    first_loop_offset: tl.constexpr = BLOCK_T if EAGER else 0
    if EAGER:
        _gate_up_silu_block(hidden_ptr, weight_ptr, out_ptr, order_ptr, gate_rows, up_rows, expert, first_col, cols,
                            col_mask, start, end, 0, stride_hidden, stride_k, stride_out, num_inter, TOP_K,
                            NUM_INNER, BLOCK_T, BLOCK_N, BLOCK_K, EVEN_K, WEIGHT_TMA, ROTATE_K, PRECISION,
                            UPCAST)
    # STATIC_LOOP_END is 0 when compiled; Triton's interpreter loops only to Python ints (see the launcher)
    for offset in range(first_loop_offset, STATIC_LOOP_END if STATIC_LOOP_END else end - start, BLOCK_T):
        _gate_up_silu_block(hidden_ptr, weight_ptr, out_ptr, order_ptr, gate_rows, up_rows, expert, first_col, cols,
                            col_mask, start, end, offset, stride_hidden, stride_k, stride_out, num_inter, TOP_K,
                            NUM_INNER, BLOCK_T, BLOCK_N, BLOCK_K, EVEN_K, WEIGHT_TMA, ROTATE_K, PRECISION,
                            UPCAST)


@triton.jit
def _down_scatter_block(rows_ptr, weight_ptr, out_ptr, order_ptr, routing_ptr, weight_rows, expert, first_col, cols,
                        col_mask, start, end, offset, stride_row, stride_k, stride_out, NUM_INNER: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                        WEIGHT_TMA: tl.constexpr, ROTATE_K: tl.constexpr, PRECISION: tl.constexpr,
                        UPCAST: tl.constexpr):
    """One block of BLOCK_T slots from ``start + offset`` of ``_down_scatter_kernel``."""
    inner = tl.arange(0, BLOCK_K)
    slots = start + offset + tl.arange(0, BLOCK_T)
    slot_mask = slots < end
    x_rows = rows_ptr + slots[:, None].to(tl.int64) * stride_row
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for step in range(0, NUM_INNER, BLOCK_K):
        k = _rotated(step, expert, first_col, NUM_INNER, BLOCK_K, ROTATE_K)
        ks = k + inner
        if EVEN_K:
            x_mask = slot_mask[:, None]
            w_mask = col_mask[:, None]
        else:
            x_mask = slot_mask[:, None] & (ks[None, :] < NUM_INNER)
            w_mask = col_mask[:, None] & (ks[None, :] < NUM_INNER)
        if WEIGHT_TMA:
            w = weight_ptr.load([expert, first_col, k]).reshape(BLOCK_N, BLOCK_K)
        else:
            w = tl.load(weight_rows + ks[None, :] * stride_k, mask=w_mask, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    assignments = tl.load(order_ptr + slots, mask=slot_mask, other=0)
    routing = tl.load(routing_ptr + assignments, mask=slot_mask, other=0.0).to(tl.float32)
    # the product rounded to the rows' dtype, then weighted in the output's dtype, as torch computes it
    weighted = _rounded(acc, rows_ptr, UPCAST) * routing[None, :]
    if out_ptr.dtype.element_ty != tl.float32:
        weighted = _rounded(weighted, out_ptr, UPCAST)
    tl.store(out_ptr + assignments[None, :].to(tl.int64) * stride_out + cols[:, None],
             weighted.to(out_ptr.dtype.element_ty), mask=slot_mask[None, :] & col_mask[:, None])


@triton.jit
def _down_scatter_kernel(rows_ptr, weight_ptr, out_ptr, bounds_ptr, order_ptr, routing_ptr, stride_row,
                         stride_expert, stride_n, stride_k, stride_out, num_cols, NUM_INNER: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, WEIGHT_TMA: tl.constexpr, EAGER: tl.constexpr,
                         ROTATE_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                         STATIC_LOOP_END: tl.constexpr):
    """out[order[s], n] = routing[order[s]] * (rows[s] @ W_e^T)[n] for the expert e of sorted slot s: the down
    product, weighted by the assignment's routing weight and put back in assignment order. ``WEIGHT_TMA``:
    weight_ptr is a (experts, hidden, inter) tensor descriptor of (1, BLOCK_N, BLOCK_K) blocks; ``EAGER`` as in
    ``_gate_up_silu_kernel``."""
    expert = tl.program_id(0)
    first_col = tl.program_id(1) * BLOCK_N
    cols = first_col + tl.arange(0, BLOCK_N)
    col_mask = cols < num_cols
    start = tl.load(bounds_ptr + expert)
    end = tl.load(bounds_ptr + expert + 1)
    weight_rows = weight_ptr
    if not WEIGHT_TMA:
        weight_rows = weight_ptr + expert.to(tl.int64) * stride_expert + cols[:, None].to(tl.int64) * stride_n
    first_loop_offset: tl.constexpr = BLOCK_T if EAGER else 0
    if EAGER:
        _down_scatter_block(rows_ptr, weight_ptr, out_ptr, order_ptr, routing_ptr, weight_rows, expert, first_col,
                            cols, col_mask, start, end, 0, stride_row, stride_k, stride_out, NUM_INNER, BLOCK_T,
                            BLOCK_N, BLOCK_K, EVEN_K, WEIGHT_TMA, ROTATE_K, PRECISION, UPCAST)
    for offset in range(first_loop_offset, STATIC_LOOP_END if STATIC_LOOP_END else end - start, BLOCK_T):
        _down_scatter_block(rows_ptr, weight_ptr, out_ptr, order_ptr, routing_ptr, weight_rows, expert, first_col,
                            cols, col_mask, start, end, offset, stride_row, stride_k, stride_out, NUM_INNER, BLOCK_T,
                            BLOCK_N, BLOCK_K, EVEN_K, WEIGHT_TMA, ROTATE_K, PRECISION, UPCAST)


_INTERPRETED = isinstance(_expert_matmul_kernel, InterpretedFunction)


@dataclass(frozen=True)
class TileConfig:
    block_m: int = 64
    """Rows per block: an expert with more reads its weight block again per block of rows."""
    block_n: int = 64
    block_k: int = 128
    num_stages: int = 3
    num_warps: int = 4

    def __str__(self) -> str:
        return (f"tiled m{self.block_m} n{self.block_n} k{self.block_k} stages {self.num_stages} "
                f"warps {self.num_warps}")


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


@dataclass(frozen=True)
class DecodeTiles:
    """A tiling of the swapped products (``expert_gate_up_silu``, ``expert_down_scatter``)."""

    block_t: int = 64
    """Slots per block (the MMA's N side): an expert with more reads its weight block again per block of slots."""
    block_n: int = 64
    """Weight columns per program (the MMA's M side)."""
    block_k: int = 128
    num_stages: int = 4
    num_warps: int = 4
    weight_tma: bool = False
    """Load the weight blocks by TMA (Hopper's tensor memory accelerator) instead of through pointers; needs the
    weight's inner dimension contiguous and 16-byte aligned rows."""
    eager: bool = False
    """Run the first block of slots whatever the expert's bounds, so its weight loads do not wait for them (an
    expert without rows reads its weights for nothing: for steps that give every expert rows)."""

    rotate_k: bool = False
    """Start each program's K loop at its own block of K (``_rotated``); needs the inner size a multiple of block_k
    (otherwise the loop starts at 0)."""

    def __str__(self) -> str:
        return (f"t{self.block_t} n{self.block_n} k{self.block_k} stages {self.num_stages} warps {self.num_warps}"
                + (" tma" if self.weight_tma else "") + (" eager" if self.eager else "")
                + (" rotated" if self.rotate_k else ""))


DECODE_TILES = (
    DecodeTiles(block_k=64),
    DecodeTiles(num_stages=3),
    DecodeTiles(block_n=128, block_k=64, num_stages=3, num_warps=8),
    DecodeTiles(block_t=32, block_k=64, num_stages=5),
    DecodeTiles(block_t=32),
    DecodeTiles(block_t=32, block_n=128, block_k=64, num_warps=8),
    DecodeTiles(block_t=16),
    DecodeTiles(block_t=16, block_n=128, block_k=64, num_warps=8),
    DecodeTiles(block_k=64, weight_tma=True),
    DecodeTiles(num_stages=3, weight_tma=True),
    DecodeTiles(block_n=128, block_k=64, num_stages=3, num_warps=8, weight_tma=True),
    DecodeTiles(block_t=32, weight_tma=True),
    DecodeTiles(block_t=32, block_k=64, num_stages=5, weight_tma=True),
    DecodeTiles(block_t=16, weight_tma=True),
    DecodeTiles(block_t=16, block_k=64, num_stages=6, weight_tma=True),
)
"""The tilings ``ExpertKernelChoice`` times for each of the two swapped products: 64 slots cover the experts of a
512-sequence step in one pass, 16 and 32 those of smaller steps; the blocks and stages set how many weight bytes
each program keeps in flight and the shared memory it takes (stages x (2 x block_n + block_t) x block_k x 2 bytes
for gate|up in bf16, 96 to 164 KiB here), so how many programs an SM holds. The TMA ones read the weight
blocks without the pointer arithmetic and registers of a pointer load."""

WIDE_GATE_UP_TILES = (
    DecodeTiles(block_n=128, block_k=64, num_stages=4, num_warps=8, weight_tma=True),
    DecodeTiles(block_t=32, block_n=256, block_k=64, num_stages=3, num_warps=8),
    DecodeTiles(block_t=32, block_n=256, block_k=64, num_stages=3, num_warps=8, weight_tma=True),
    DecodeTiles(block_n=32, block_k=256, num_stages=3),
    DecodeTiles(block_n=32, block_k=256, num_stages=3, weight_tma=True),
    DecodeTiles(block_t=32, block_n=32, block_k=256, num_stages=4, weight_tma=True),
)
"""Gate|up tilings of 128 and 256 weight columns a program: each program reads its expert's rows from L2 once per
K block, so wider blocks cut that traffic (half the weight bytes at 64 columns and 64 slots); and of 32 columns
(gate and up: 64 weight rows, below the 64 of Hopper's wgmma, so Ampere's MMA) reading 512 contiguous bytes of
each weight row a block."""

WIDE_DOWN_TILES = (
    DecodeTiles(block_k=256, num_stages=3),
    DecodeTiles(block_k=256, num_stages=3, weight_tma=True),
    DecodeTiles(block_t=32, block_k=256, num_stages=4),
    DecodeTiles(block_t=32, block_k=256, num_stages=4, weight_tma=True),
    DecodeTiles(block_n=256, block_k=64, num_warps=8),
    DecodeTiles(block_n=256, block_k=64, num_warps=8, weight_tma=True),
)
"""Down-product tilings reading 512 contiguous bytes of each weight row per block, or 256 weight columns a program
(the gate|up kernel, with two weight blocks a stage, has no room for them)."""

EAGER_TILES = (
    DecodeTiles(block_k=64, eager=True),
    DecodeTiles(block_k=64, weight_tma=True, eager=True),
    DecodeTiles(num_stages=3, weight_tma=True, eager=True),
    DecodeTiles(block_n=128, block_k=64, num_stages=3, num_warps=8, weight_tma=True, eager=True),
)
"""Tilings of 64 slots whose first block does not wait for the expert's bounds (``DecodeTiles.eager``)."""

ROTATED_TILES = (
    DecodeTiles(block_k=64, rotate_k=True),
    DecodeTiles(block_k=64, weight_tma=True, rotate_k=True),
    DecodeTiles(num_stages=3, weight_tma=True, rotate_k=True),
)
"""Tilings of 64 slots whose programs start their K loops at different blocks (``DecodeTiles.rotate_k``)."""

PRODUCT_TILES = {"gate_up": DECODE_TILES + WIDE_GATE_UP_TILES + EAGER_TILES + ROTATED_TILES,
                 "down": DECODE_TILES + WIDE_DOWN_TILES + EAGER_TILES + ROTATED_TILES
                 + (DecodeTiles(block_n=256, block_k=64, num_warps=8, weight_tma=True, eager=True),)}
"""The tilings ``ExpertKernelChoice`` times for each swapped product."""


def _dot_options(dtype: torch.dtype) -> dict[str, object]:
    """float32 products in float32 (the exact path of the tests), 16-bit ones on the MMA. Triton's interpreter
    multiplies bf16 operands wrongly and truncates bf16 casts, so there (``UPCAST``) the operands are widened to
    float32 first (the MMA's products are exact in float32 too) and roundings to bf16 are done on the bits."""
    upcast = _INTERPRETED and dtype != torch.float32
    if upcast and dtype != torch.bfloat16:
        raise ValueError(f"the expert kernels run {dtype} on the GPU only; Triton's interpreter runs float32 and bf16")
    return {"PRECISION": "ieee" if dtype == torch.float32 or upcast else "tf32", "UPCAST": upcast}


def tma_loadable(weight: Tensor) -> bool:
    """Whether TMA can read ``weight`` (experts, cols, inner): the inner dimension contiguous, the other strides and
    the base 16-byte aligned."""
    size = weight.element_size()
    return (weight.stride(-1) == 1 and weight.data_ptr() % 16 == 0
            and all(stride * size % 16 == 0 for stride in weight.stride()[:-1]))


def _weight_operand(weight: Tensor, tiles: DecodeTiles) -> object:
    """The weight as the swapped kernels read it: a tensor, or a tensor descriptor of (1, block_n, block_k) blocks."""
    if not tiles.weight_tma:
        return weight
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not tma_loadable(weight):
        raise ValueError(f"TMA cannot read the expert weight of strides {tuple(weight.stride())}: its inner dimension "
                         "is not contiguous with 16-byte aligned rows; a pointer tiling runs it")
    return TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [1, tiles.block_n, tiles.block_k])


def expert_gate_up_silu(hidden: Tensor, gate_up: Tensor, bounds: Tensor, order: Tensor, top_k: int,
                        tiles: DecodeTiles = DecodeTiles()) -> Tensor:
    """silu(gate_e(x)) * up_e(x) for every assignment, in the order sorted by expert.

    hidden: (tokens, hidden), rows contiguous; gate_up: (experts, 2 * inter, hidden), gate rows first, any strides;
    bounds: (experts + 1,) 0 then each expert's cumulative end over the sorted assignments; order: (tokens * top_k,)
    the assignment (token * top_k + slot) at each sorted position. Returns (tokens * top_k, inter) in hidden's dtype.
    """
    num_experts, two_inter, num_inner = gate_up.shape
    inter = two_inter // 2
    out = torch.empty(order.shape[0], inter, dtype=hidden.dtype, device=hidden.device)
    grid = (num_experts, triton.cdiv(inter, tiles.block_n))
    _gate_up_silu_kernel[grid](hidden, _weight_operand(gate_up, tiles), out, bounds, order, hidden.stride(0),
                               gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), out.stride(0), inter,
                               TOP_K=top_k, NUM_INNER=num_inner, BLOCK_T=tiles.block_t, BLOCK_N=tiles.block_n,
                               BLOCK_K=tiles.block_k, EVEN_K=num_inner % tiles.block_k == 0,
                               WEIGHT_TMA=tiles.weight_tma, EAGER=tiles.eager,
                               ROTATE_K=tiles.rotate_k and num_inner % tiles.block_k == 0, **_dot_options(hidden.dtype),
                               STATIC_LOOP_END=max(order.shape[0], 1) if _INTERPRETED else 0,
                               num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def expert_down_scatter(activated: Tensor, down: Tensor, bounds: Tensor, order: Tensor, routing: Tensor,
                        tiles: DecodeTiles = DecodeTiles()) -> Tensor:
    """routing[a] * down_e(activated[s]) at row a = order[s] for every sorted position s (e its expert).

    activated: (assignments, inter) sorted by expert, rows contiguous; down: (experts, hidden, inter), any strides;
    routing: (assignments,) in assignment order. Returns (assignments, hidden) in assignment order, in the dtype
    torch gives a product of activated's and routing's dtypes.
    """
    num_experts, num_cols, num_inner = down.shape
    out = torch.empty(order.shape[0], num_cols, dtype=torch.result_type(activated, routing), device=activated.device)
    grid = (num_experts, triton.cdiv(num_cols, tiles.block_n))
    _down_scatter_kernel[grid](activated, _weight_operand(down, tiles), out, bounds, order, routing,
                               activated.stride(0), down.stride(0), down.stride(1), down.stride(2), out.stride(0),
                               num_cols, NUM_INNER=num_inner,
                               BLOCK_T=tiles.block_t, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                               EVEN_K=num_inner % tiles.block_k == 0, WEIGHT_TMA=tiles.weight_tma,
                               EAGER=tiles.eager, ROTATE_K=tiles.rotate_k and num_inner % tiles.block_k == 0,
                               **_dot_options(activated.dtype),
                               STATIC_LOOP_END=max(order.shape[0], 1) if _INTERPRETED else 0,
                               num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


@triton.jit
def _expert_order_kernel(ids_ptr, order_ptr, bounds_ptr, num_assignments, num_experts, NUM_CHUNKS: tl.constexpr,
                         BLOCK: tl.constexpr):
    """Program e: bounds[e] = assignments with an expert below e, and order[bounds[e] + i] = the i-th assignment of
    expert e (a stable counting sort, one expert per program)."""
    expert = tl.program_id(0)
    start = 0
    for chunk in range(0, NUM_CHUNKS * BLOCK, BLOCK):
        offsets = chunk + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offsets, mask=offsets < num_assignments, other=num_experts)
        start += tl.sum((ids < expert).to(tl.int32), axis=0)
    tl.store(bounds_ptr + expert, start)
    tl.store(bounds_ptr + num_experts, num_assignments, mask=expert == num_experts - 1)
    filled = start
    for chunk in range(0, NUM_CHUNKS * BLOCK, BLOCK):
        offsets = chunk + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offsets, mask=offsets < num_assignments, other=num_experts)
        mine = (ids == expert).to(tl.int32)
        tl.store(order_ptr + filled + tl.cumsum(mine, axis=0) - 1, offsets, mask=mine != 0)
        filled += tl.sum(mine, axis=0)


def expert_order(expert_ids: Tensor, num_experts: int, block: int = 1024) -> tuple[Tensor, Tensor]:
    """The assignments sorted by expert in one launch: bounds (experts + 1,) int32, 0 then each expert's cumulative
    end, and order (assignments,) int64, the assignment at each sorted position (a stable sort's order).

    expert_ids: (assignments,) flat expert ids, token-major."""
    expert_ids = expert_ids.contiguous()
    order = torch.empty(expert_ids.shape[0], dtype=torch.int64, device=expert_ids.device)
    bounds = torch.empty(num_experts + 1, dtype=torch.int32, device=expert_ids.device)
    _expert_order_kernel[(num_experts,)](expert_ids, order, bounds, expert_ids.shape[0], num_experts,
                                         NUM_CHUNKS=max(triton.cdiv(expert_ids.shape[0], block), 1), BLOCK=block,
                                         num_warps=4)
    return bounds, order


@dataclass(frozen=True)
class SwappedExperts:
    """Both products as the swapped kernels, each with its own tiling."""

    gate_up: DecodeTiles
    down: DecodeTiles

    def __str__(self) -> str:
        return f"swapped (gate|up {self.gate_up}; down {self.down})"


def swapped_experts(hidden: Tensor, expert_ids: Tensor, routing: Tensor, gate_up: Tensor, down: Tensor,
                    tiles: SwappedExperts) -> Tensor:
    """Every assignment's weighted expert output, (assignments, hidden) in assignment order, from the flat expert ids
    and routing weights (token-major): three launches (``expert_order``, gate|up with the activation, down with the
    weighting and the un-permute)."""
    hidden, routing = hidden.contiguous(), routing.contiguous()
    bounds, order = expert_order(expert_ids, gate_up.shape[0])
    top_k = max(order.shape[0] // max(hidden.shape[0], 1), 1)
    activated = expert_gate_up_silu(hidden, gate_up, bounds, order, top_k, tiles.gate_up)
    return expert_down_scatter(activated, down, bounds, order, routing, tiles.down)


MAX_ROWS_PER_EXPERT = 64
"""The Triton kernels are candidates while the rows average at most this many per expert (decode steps); longer
batches (prefill) are compute-bound, where torch's grouped GEMM is the one to run."""

MIN_EXPERT_BYTES = 64 << 20
"""The Triton kernels are candidates for layers whose experts weigh at least this much (every MoE model worth
serving: 0.8 to 1.2 GB a layer for OLMoE, DeepSeek-V2-Lite and Qwen3-30B-A3B); below, compiling and timing them
costs more than they could save, and torch's grouped GEMMs run untimed."""

Candidate = TileConfig | SwappedExperts | None
"""How the experts run: None torch's grouped GEMMs, a ``TileConfig`` the tiled kernel for both products (with the
activation, weighting and un-permute in torch), a ``SwappedExperts`` the swapped kernels."""

TiledExperts = Callable[[Tensor, Callable[[Tensor, Tensor, Tensor], Tensor] | None], Tensor]
"""``moe.grouped_experts`` bound to a layer's hidden states, routing weights and expert weights: given the flat
expert ids (sorted there with ``torch.sort``) and a grouped GEMM ``(rows, weight, bounds)`` (None: torch's), every
assignment's weighted expert output in assignment order."""


def spread_assignments(num_assignments: int, num_experts: int, device: torch.device) -> Tensor:
    """Flat expert ids of ``num_assignments`` assignments drawn uniformly over the experts (a fixed seed): what the
    candidates are timed on, since the call that triggers the timing may route otherwise (a decode graph's warm-up
    runs identical padding tokens, which all pick the same experts)."""
    generator = torch.Generator(device=device).manual_seed(0)
    return torch.randint(0, num_experts, (num_assignments,), generator=generator, device=device)


class ExpertKernelChoice:
    """Which kernels run the experts, per (assignments rounded up to a power of two, experts, gate|up and down
    shapes, dtypes): torch's grouped GEMMs unless a Triton candidate was timed faster (for decode-sized batches of
    layers of ``min_expert_bytes`` or more). Candidates are timed on the call's hidden states and weights with its
    number of assignments spread over the experts at random (``spread_assignments``). The swapped kernels are timed
    tiling by tiling for each product, then as a pair against torch's and the tiled kernel's tilings
    (``TILE_CONFIGS``). A candidate that fails to compile or run, or whose output is not torch's within bf16
    rounding, is dropped in one line. Timing needs a stream that is not capturing; inside a capture an untimed
    shape runs torch's."""

    def __init__(self, repeats: int = 5, tiles: dict[str, tuple[DecodeTiles, ...]] = PRODUCT_TILES,
                 tile_configs: tuple[TileConfig, ...] = TILE_CONFIGS, min_expert_bytes: int = MIN_EXPERT_BYTES):
        self.repeats = repeats
        self.min_expert_bytes = min_expert_bytes
        self.tiles = tiles
        self.tile_configs = tile_configs
        self.picked: dict[tuple, Candidate] = {}
        """key -> the candidate that runs it."""
        self.timings: dict[tuple, dict[str, float]] = {}
        """key -> milliseconds of each candidate timed (the swapped products also alone, per tiling)."""
        self.failed: set[str] = set()
        """Candidates (their ``str``) dropped for failing or differing from torch's."""

    def __call__(self, hidden: Tensor, expert_ids: Tensor, routing: Tensor, gate_up: Tensor, down: Tensor,
                 tiled: TiledExperts) -> Tensor:
        """Every assignment's weighted expert output, (assignments, hidden) in assignment order, by the picked
        candidate (``tiled(expert_ids, None)`` is torch's). expert_ids, routing: (assignments,), token-major."""
        candidate = self._candidate_for(hidden, expert_ids, routing, gate_up, down, tiled)
        if isinstance(candidate, SwappedExperts):
            return swapped_experts(hidden, expert_ids, routing, gate_up, down, candidate)
        if isinstance(candidate, TileConfig):
            return tiled(expert_ids, lambda rows, weight, bounds: expert_matmul(rows, weight, bounds, candidate))
        return tiled(expert_ids, None)

    def key(self, expert_ids: Tensor, routing: Tensor, gate_up: Tensor, down: Tensor) -> tuple:
        return (triton.next_power_of_2(expert_ids.shape[0]), *gate_up.shape, down.shape[1], gate_up.dtype,
                routing.dtype)

    def _candidate_for(self, hidden: Tensor, expert_ids: Tensor, routing: Tensor, gate_up: Tensor, down: Tensor,
                       tiled: TiledExperts) -> Candidate:
        if (expert_ids.shape[0] > MAX_ROWS_PER_EXPERT * gate_up.shape[0]
                or gate_up.nbytes + down.nbytes < self.min_expert_bytes):
            return None
        key = self.key(expert_ids, routing, gate_up, down)  # prefills vary: rows by octave
        if key in self.picked:
            return self.picked[key]
        if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        expert_ids = spread_assignments(expert_ids.shape[0], gate_up.shape[0], hidden.device)
        expected = tiled(expert_ids, None)
        timings = {"torch": self._time(lambda: tiled(expert_ids, None))}
        runs: dict[Candidate, Callable[[], Tensor]] = {}
        for config in self.tile_configs:
            runs[config] = lambda config=config: tiled(
                expert_ids, lambda rows, weight, bounds: expert_matmul(rows, weight, bounds, config))
        swapped = self._swapped_tiles(hidden, expert_ids, routing, gate_up, down, timings)
        if swapped is not None:
            runs[swapped] = lambda: swapped_experts(hidden, expert_ids, routing, gate_up, down, swapped)
        best: Candidate = None
        for candidate, run in runs.items():
            if str(candidate) in self.failed:
                continue
            milliseconds = self._checked_time(str(candidate), run, expected)
            if milliseconds is not None:
                timings[str(candidate)] = milliseconds
                if milliseconds < timings[str(best) if best is not None else "torch"]:
                    best = candidate
        self.picked[key], self.timings[key] = best, timings
        logger.info("experts of %d assignments x %s (timed spread over the experts): %s; running %s",
                    expert_ids.shape[0], tuple(gate_up.shape),
                    ", ".join(f"{name} {ms:.3f} ms" for name, ms in timings.items()), best or "torch's grouped GEMMs")
        return best

    def _swapped_tiles(self, hidden: Tensor, expert_ids: Tensor, routing: Tensor, gate_up: Tensor, down: Tensor,
                       timings: dict[str, float]) -> SwappedExperts | None:
        """The fastest tiling of each swapped product, timed alone (the down product on the gate|up one's output)."""
        bounds, order = expert_order(expert_ids, gate_up.shape[0])
        top_k = max(order.shape[0] // max(hidden.shape[0], 1), 1)
        gate_up_tiles = self._fastest_tiles("gate_up", gate_up, timings, lambda tiles: lambda: expert_gate_up_silu(
            hidden, gate_up, bounds, order, top_k, tiles))
        if gate_up_tiles is None:
            return None
        activated = expert_gate_up_silu(hidden, gate_up, bounds, order, top_k, gate_up_tiles)
        down_tiles = self._fastest_tiles("down", down, timings, lambda tiles: lambda: expert_down_scatter(
            activated, down, bounds, order, routing, tiles))
        return None if down_tiles is None else SwappedExperts(gate_up_tiles, down_tiles)

    def _fastest_tiles(self, product: str, weight: Tensor, timings: dict[str, float],
                       runner: Callable[[DecodeTiles], Callable[[], Tensor]]) -> DecodeTiles | None:
        fastest: tuple[float, DecodeTiles] | None = None
        for tiles in self.tiles[product]:
            if tiles.weight_tma and not tma_loadable(weight):
                continue
            name = f"swapped {product} {tiles}"
            milliseconds = None if name in self.failed else self._checked_time(name, runner(tiles), None)
            if milliseconds is not None:
                timings[name] = milliseconds
                if fastest is None or milliseconds < fastest[0]:
                    fastest = (milliseconds, tiles)
        return None if fastest is None else fastest[1]

    def _checked_time(self, name: str, run: Callable[[], Tensor], expected: Tensor | None) -> float | None:
        """Milliseconds per ``run()``, or None (dropped in one line) when it fails or its output is not ``expected``
        within bf16 rounding."""
        try:
            out = run()
            if expected is not None:
                scale = expected.float().abs().max().clamp(min=1e-6)
                error = float((out.float() - expected.float()).abs().max() / scale)
                if not error <= 2e-2:
                    raise ValueError(f"its output differs from torch's by {error:.2g} of the largest value")
            return self._time(run)
        except Exception as error:  # noqa: BLE001 (a kernel the device cannot compile or run: keep torch's)
            self.failed.add(name)
            logger.warning("the Triton expert kernel %s is dropped (%s: %s); the experts run another candidate",
                           name, type(error).__name__, str(error).splitlines()[0] if str(error) else "")
            return None

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
