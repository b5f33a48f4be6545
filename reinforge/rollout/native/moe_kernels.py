"""Triton grouped GEMMs for the experts of a decode step (``moe_choice.py`` times them against torch's).

A decode step of B sequences sends B * top_k rows to the experts, a few dozen each, so the expert products are
bound by reading every expert's weights once. Two kernel families run over the assignments sorted by expert, their
bounds read on the device, so a CUDA graph captures them:

- the swapped kernels compute ``W_e @ x^T``: the weight's output columns fill the MMA's M side and the expert's few
  rows its N side (16 to 64 slots), each program streaming one block of W_e's rows along K, by TMA or pointer loads
  (``DecodeTiles``). ``expert_gate_up_silu`` gathers each slot's hidden row itself and applies silu(gate) * up in
  its epilogue (gate and up columns in one program); ``expert_down_scatter`` weights each row by its routing weight
  and writes it at its assignment's row. With ``expert_order``'s counting sort, a layer's experts are three
  launches (``swapped_experts``) where torch's path has the sort, the gather, the histogram and its sum, two
  grouped GEMMs, the activation, the weighting and the un-permute.
- ``expert_matmul`` runs ``rows_e @ W_e^T`` one product at a time, one program per (expert, block of output
  columns), the rows gathered, activated, weighted and put back by torch.

``softmax_topk`` is the router after its logits product: softmax in float32, the top k, their renormalisation,
the routed scaling factor and the cast, one launch where torch's path has seven (a cast, the softmax, the top-k and
its sort, the sum, the division and the cast back).

Everything also runs in Triton's interpreter (the CPU tests), which loops only to Python ints and mishandles bf16
products and casts; the kernels take constants that work around both there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from reinforge.rollout.native.compile_ahead import launch


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
def k_masks(row_mask, col_mask, ks, NUM_INNER, EVEN_K: tl.constexpr):
    """The load masks of the rows (tokens) and of the weight rows at K offsets ``ks``: constant along K when every
    K block is whole (EVEN_K), so the loads stay 16-byte vectors."""
    if EVEN_K:
        x_mask = row_mask[:, None]
        w_mask = col_mask[:, None]
    else:
        inside = ks[None, :] < NUM_INNER
        x_mask = row_mask[:, None] & inside
        w_mask = col_mask[:, None] & inside
    return x_mask, w_mask


@triton.jit
def rounded_like(x, like_ptr, BITWISE: tl.constexpr):
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
        x_mask, w_mask = k_masks(slot_mask, col_mask, ks, NUM_INNER, EVEN_K)
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
    gate = rounded_like(gate, out_ptr, UPCAST)
    activated = rounded_like(gate / (1.0 + tl.exp(-gate)), out_ptr, UPCAST) * rounded_like(up, out_ptr, UPCAST)
    tl.store(out_ptr + slots[None, :].to(tl.int64) * stride_out + cols[:, None],
             rounded_like(activated, out_ptr, UPCAST).to(out_ptr.dtype.element_ty),
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
        x_mask, w_mask = k_masks(slot_mask, col_mask, ks, NUM_INNER, EVEN_K)
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
    weighted = rounded_like(acc, rows_ptr, UPCAST) * routing[None, :]
    if out_ptr.dtype.element_ty != tl.float32:
        weighted = rounded_like(weighted, out_ptr, UPCAST)
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
    launch(_expert_matmul_kernel, grid, rows, weight, out, bounds, rows.stride(0), weight.stride(0), weight.stride(1),
           weight.stride(2), out.stride(0), num_cols, NUM_INNER=num_inner, BLOCK_M=config.block_m,
           BLOCK_N=config.block_n, BLOCK_K=config.block_k, STATIC_LOOP_END=static_loop_end, num_warps=config.num_warps,
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


def dot_options(dtype: torch.dtype) -> dict[str, object]:
    """float32 products in float32 (the exact path of the tests), 16-bit ones on the MMA. Triton's interpreter
    multiplies bf16 operands wrongly and truncates bf16 casts, so there (``UPCAST``) the operands are widened to
    float32 first (the MMA's products are exact in float32 too) and roundings to bf16 are done on the bits."""
    upcast = _INTERPRETED and dtype != torch.float32
    if upcast and dtype != torch.bfloat16:
        raise ValueError(f"the swapped kernels run {dtype} on the GPU only; Triton's interpreter runs float32 and bf16")
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
    launch(_gate_up_silu_kernel, grid, hidden, _weight_operand(gate_up, tiles), out, bounds, order, hidden.stride(0),
           gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), out.stride(0), inter, TOP_K=top_k,
           NUM_INNER=num_inner, BLOCK_T=tiles.block_t, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
           EVEN_K=num_inner % tiles.block_k == 0, WEIGHT_TMA=tiles.weight_tma, EAGER=tiles.eager,
           ROTATE_K=tiles.rotate_k and num_inner % tiles.block_k == 0, **dot_options(hidden.dtype),
           STATIC_LOOP_END=max(order.shape[0], 1) if _INTERPRETED else 0, num_warps=tiles.num_warps,
           num_stages=tiles.num_stages)
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
    launch(_down_scatter_kernel, grid, activated, _weight_operand(down, tiles), out, bounds, order, routing,
           activated.stride(0), down.stride(0), down.stride(1), down.stride(2), out.stride(0), num_cols,
           NUM_INNER=num_inner, BLOCK_T=tiles.block_t, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
           EVEN_K=num_inner % tiles.block_k == 0, WEIGHT_TMA=tiles.weight_tma, EAGER=tiles.eager,
           ROTATE_K=tiles.rotate_k and num_inner % tiles.block_k == 0, **dot_options(activated.dtype),
           STATIC_LOOP_END=max(order.shape[0], 1) if _INTERPRETED else 0, num_warps=tiles.num_warps,
           num_stages=tiles.num_stages)
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
    launch(_expert_order_kernel, (num_experts,), expert_ids, order, bounds, expert_ids.shape[0], num_experts,
           NUM_CHUNKS=max(triton.cdiv(expert_ids.shape[0], block), 1), BLOCK=block, num_warps=4)
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


@triton.jit
def _softmax_topk_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_logits, scaling,
                         TOP_K: tl.constexpr, K_PAD: tl.constexpr, NORMALIZE: tl.constexpr, SCALE: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Programs of BLOCK_T tokens: each token's softmax over its experts' logits in float32 (max, exp, sum, then
    each exp over the sum, as torch's softmax; its exp and sum round within a few float32 ulps of torch's, which
    moves no choice between distinct logits and none between tied ones), its TOP_K best by value (ties to the
    lower expert, as torch's top-k keeps the lower indices of a tied k-th value), divided by their sum
    (NORMALIZE), times ``scaling`` (SCALE), stored in the weights' dtype."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    row_mask = rows < num_tokens
    expert_mask = experts < num_experts
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_logits + experts[None, :],
                     mask=row_mask[:, None] & expert_mask[None, :], other=0.0).to(tl.float32)
    logits = tl.where(expert_mask[None, :], logits, float("-inf"))  # rows past the last token stay finite
    peak = tl.max(logits, axis=1)
    exps = tl.exp(logits - peak[:, None])
    probs = exps / tl.sum(exps, axis=1)[:, None]
    probs = tl.where(expert_mask[None, :], probs, -1.0)  # padding experts are never picked
    slots = tl.arange(0, K_PAD)
    values = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], tl.int64)
    for slot in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        expert = tl.argmax(probs, axis=1, tie_break_left=True)
        values = tl.where(slots[None, :] == slot, best[:, None], values)
        ids = tl.where(slots[None, :] == slot, expert[:, None].to(tl.int64), ids)
        probs = tl.where(experts[None, :] == expert[:, None], -1.0, probs)
    if NORMALIZE:
        values = values / tl.sum(values, axis=1)[:, None]
    if SCALE:
        values = values * scaling
    out = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    mask = row_mask[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, values.to(weights_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


MAX_ROUTED_EXPERTS = 512
"""``softmax_topk`` keeps a token's scores in registers: routers of up to this many experts."""


def softmax_topk(logits: Tensor, top_k: int, normalize: bool, scaling: float = 1.0,
                 weights_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """The router's choice from its logits (tokens, experts), rows contiguous: the top_k experts of each token's
    float32 softmax, sorted by score, and their scores (divided by their sum when ``normalize``, times ``scaling``)
    in ``weights_dtype``. Returns weights (tokens, top_k) and expert ids (tokens, top_k) int64."""
    num_tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts <= MAX_ROUTED_EXPERTS:
        raise ValueError(f"softmax_topk picks 1 to {num_experts} of at most {MAX_ROUTED_EXPERTS} experts; "
                         f"got top_k={top_k} of {num_experts}")
    logits = logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=weights_dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(16, 4096 // block_e))
    if num_tokens:
        _softmax_topk_kernel[(triton.cdiv(num_tokens, block_t),)](
            logits, weights, ids, num_tokens, num_experts, logits.stride(0), float(scaling), TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), NORMALIZE=normalize, SCALE=scaling != 1.0, BLOCK_T=block_t,
            BLOCK_E=block_e, num_warps=4)
    return weights, ids
