"""Triton kernels for a decode step's gated MLP (``dense_choice.py`` times them against cuBLAS).

A decode step of a few hundred sequences or fewer multiplies that many rows by the MLP's weights, so its products
are bound by reading the weights once. cuBLAS tiles such products as it tiles large batches, which leaves SMs idle
when the output has few tiles (a 1.5B model's down product: 12 tiles of 128 columns for 132 SMs). These kernels
compute ``W @ x^T``, as the swapped expert kernels of ``moe_kernels.py`` do: the weight's output rows fill the
MMA's wide side and the step's rows its narrow side (16 to 128 a block).

- ``gate_up_act``: both products of a block of inter columns in one program, the biases and the activation
  (``triton_kernels.ACTIVATIONS``) in its epilogue, rounded as cuBLAS and ``triton_kernels.act_and_mul`` round;
- ``down``: the down product, its K range split over ``split_k`` programs when the output has too few blocks for
  the SMs; the partial sums stay in float32 and a second launch adds them in a fixed order with the bias and
  rounds once.

The row blocks are the grid's first axis, so the programs reading one weight block run side by side and a step of
more rows than a block reads each weight byte from DRAM once. Everything also runs in Triton's interpreter (the
CPU tests), with the workarounds of ``moe_kernels.dot_options``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from reinforge.rollout.native import triton_kernels
from reinforge.rollout.native.compile_ahead import launch
from reinforge.rollout.native.moe_kernels import _INTERPRETED, dot_options, k_masks, rounded_like
from reinforge.rollout.native.triton_kernels import ACTIVATIONS, gated_activation


class MLPWeights(NamedTuple):
    """A layer's gated MLP: gate_up (2 * inter, hidden), gate rows first; down (hidden, inter); biases or None."""

    gate_up: Tensor
    gate_up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None


@dataclass(frozen=True)
class DenseTiles:
    """A tiling of one product (``gate_up_act`` or ``down``)."""

    block_t: int = 32
    """Rows per program (the MMA's narrow side); a step of more rows runs a program per block."""
    block_n: int = 64
    """Weight rows (output columns) per program (the MMA's wide side)."""
    block_k: int = 128
    split_k: int = 1
    """Programs sharing one output block's K range (``down`` only), their float32 sums added by a second launch."""
    num_stages: int = 4
    num_warps: int = 4
    weight_tma: bool = False
    """Load the weight blocks by TMA (Hopper's tensor memory accelerator) instead of through pointers; needs
    contiguous weight rows, 16-byte aligned."""

    def __str__(self) -> str:
        return (f"t{self.block_t} n{self.block_n} k{self.block_k}" + (f" split {self.split_k}" if self.split_k > 1
                                                                       else "")
                + f" stages {self.num_stages} warps {self.num_warps}" + (" tma" if self.weight_tma else ""))


# the row count is not specialised on (== 1, multiple of 16), so every decode batch size runs one compiled kernel
@triton.jit(do_not_specialize=["num_rows"])
def _gate_up_act_kernel(x_ptr, weight_ptr, bias_ptr, out_ptr, num_rows, stride_x, stride_w, stride_out, inter,
                        NUM_INNER: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                        WEIGHT_TMA: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """out[t, j] = act(gate_j(x_t)) * up_j(x_t) for this program's rows t and inter columns j. ``WEIGHT_TMA``:
    weight_ptr is a (2 * inter, hidden) tensor descriptor of (BLOCK_N, BLOCK_K) blocks (gate columns past inter
    read up rows, which only masked outputs use)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    first_col = tl.program_id(1) * BLOCK_N
    cols = first_col + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    col_mask = cols < inter
    inner = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
    gate_rows = weight_ptr
    up_rows = weight_ptr
    if not WEIGHT_TMA:
        gate_rows = weight_ptr + cols[:, None].to(tl.int64) * stride_w
        up_rows = weight_ptr + (cols[:, None] + inter).to(tl.int64) * stride_w
    gate = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k in range(0, NUM_INNER, BLOCK_K):
        ks = k + inner
        x_mask, w_mask = k_masks(row_mask, col_mask, ks, NUM_INNER, EVEN_K)
        if WEIGHT_TMA:
            gate_w = weight_ptr.load([first_col, k])
            up_w = weight_ptr.load([first_col + inter, k])
        else:
            gate_w = tl.load(gate_rows + ks[None, :], mask=w_mask, other=0.0)
            up_w = tl.load(up_rows + ks[None, :], mask=w_mask, other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
        if UPCAST:
            x, gate_w, up_w = x.to(tl.float32), gate_w.to(tl.float32), up_w.to(tl.float32)
        gate = tl.dot(gate_w, tl.trans(x), gate, input_precision=PRECISION)
        up = tl.dot(up_w, tl.trans(x), up, input_precision=PRECISION)
    if HAS_BIAS:  # added in float32 before the product is rounded, as cuBLAS's epilogue adds it
        gate += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[:, None]
        up += tl.load(bias_ptr + inter + cols, mask=col_mask, other=0.0).to(tl.float32)[:, None]
    gate = rounded_like(gate, out_ptr, UPCAST)
    activated = rounded_like(gated_activation(gate, ACTIVATION), out_ptr, UPCAST) * rounded_like(up, out_ptr, UPCAST)
    tl.store(out_ptr + rows[None, :].to(tl.int64) * stride_out + cols[:, None],
             rounded_like(activated, out_ptr, UPCAST).to(out_ptr.dtype.element_ty),
             mask=row_mask[None, :] & col_mask[:, None])


@triton.jit(do_not_specialize=["num_rows", "blocks_per_split", "num_splits"])
def _down_kernel(x_ptr, weight_ptr, bias_ptr, out_ptr, partial_ptr, num_rows, stride_x, stride_w, stride_out,
                 num_cols, blocks_per_split, num_splits, NUM_INNER: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WEIGHT_TMA: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr, STATIC_BLOCKS_PER_SPLIT: tl.constexpr):
    """(x @ W^T)[t, n] over the K range of split ``program_id(2)`` (blocks_per_split blocks of K) for this program's
    rows t and columns n: with one split, plus the bias, rounded into out; else the float32 sum into partial
    (num_splits, rows, cols). ``WEIGHT_TMA``: weight_ptr is a (hidden, inter) tensor descriptor of (BLOCK_N,
    BLOCK_K) blocks. The split is a runtime value, counted in blocks (so the compiler still knows each K offset is a
    multiple of BLOCK_K, for 16-byte asynchronous copies), and K is always masked: every batch size and split runs
    one compiled kernel. ``STATIC_BLOCKS_PER_SPLIT`` is 0 when compiled (Triton's interpreter loops only to Python
    ints)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    first_col = tl.program_id(1) * BLOCK_N
    cols = first_col + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_mask = rows < num_rows
    col_mask = cols < num_cols
    inner = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
    weight_rows = weight_ptr
    if not WEIGHT_TMA:
        weight_rows = weight_ptr + cols[:, None].to(tl.int64) * stride_w
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for step in range(0, STATIC_BLOCKS_PER_SPLIT if STATIC_BLOCKS_PER_SPLIT else blocks_per_split):
        k = (split * blocks_per_split + step) * BLOCK_K
        ks = k + inner
        if WEIGHT_TMA:  # past the inner size, TMA reads zeros
            w = weight_ptr.load([first_col, k])
        else:
            w = tl.load(weight_rows + ks[None, :], mask=col_mask[:, None] & (ks[None, :] < NUM_INNER), other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & (ks[None, :] < NUM_INNER), other=0.0)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    out_mask = row_mask[None, :] & col_mask[:, None]
    # one of the two stores writes: the rounded sum (unsplit) or the float32 partial sum
    tl.store(partial_ptr + (split * num_rows + rows[None, :]).to(tl.int64) * num_cols + cols[:, None], acc,
             mask=out_mask & (num_splits > 1))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[None, :].to(tl.int64) * stride_out + cols[:, None],
             rounded_like(acc, out_ptr, UPCAST).to(out_ptr.dtype.element_ty), mask=out_mask & (num_splits == 1))


@triton.jit(do_not_specialize=["num_rows"])
def _split_sum_kernel(partial_ptr, bias_ptr, out_ptr, num_rows, num_cols, stride_out, SPLIT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, UPCAST: tl.constexpr):
    """out[t] = the SPLIT float32 partial rows t added in split order, plus the bias, rounded once."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(SPLIT):
        acc += tl.load(partial_ptr + (split * num_rows + row).to(tl.int64) * num_cols + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, rounded_like(acc, out_ptr, UPCAST).to(
        out_ptr.dtype.element_ty), mask=mask)


def tma_loadable(weight: Tensor) -> bool:
    """Whether TMA can read ``weight`` (cols, inner): rows contiguous, 16-byte aligned, as is its base."""
    return (weight.stride(-1) == 1 and weight.data_ptr() % 16 == 0
            and weight.stride(0) * weight.element_size() % 16 == 0)


def _weight_operand(weight: Tensor, tiles: DenseTiles) -> object:
    """The weight as the kernels read it: a tensor with contiguous rows, or a tensor descriptor of its blocks."""
    if weight.stride(-1) != 1:
        raise ValueError(f"the dense MLP kernels read weight rows that are contiguous; this weight's strides are "
                         f"{tuple(weight.stride())}; pass weight.contiguous()")
    if not tiles.weight_tma:
        return weight
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not tma_loadable(weight):
        raise ValueError(f"TMA cannot read the weight of strides {tuple(weight.stride())}: its rows are not 16-byte "
                         "aligned; a pointer tiling runs it")
    return TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [tiles.block_n, tiles.block_k])


def gate_up_act(x: Tensor, gate_up: Tensor, bias: Tensor | None, activation: str,
                tiles: DenseTiles = DenseTiles()) -> Tensor:
    """act(x @ gate^T + b_gate) * (x @ up^T + b_up), each rounded to x's dtype as cuBLAS and ``act_and_mul`` do.

    x: (rows, hidden), rows contiguous; gate_up: (2 * inter, hidden), gate rows first, rows contiguous; bias:
    (2 * inter,) or None; activation: a key of ``triton_kernels.ACTIVATIONS``. Returns (rows, inter) in x's dtype.
    """
    num_rows, num_inner = x.shape
    inter = gate_up.shape[0] // 2
    out = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(num_rows, tiles.block_t), triton.cdiv(inter, tiles.block_n))
    launch(_gate_up_act_kernel, grid, x, _weight_operand(gate_up, tiles), gate_up if bias is None else bias, out,
           num_rows, x.stride(0), gate_up.stride(0), out.stride(0), inter, NUM_INNER=num_inner,
           HAS_BIAS=bias is not None, ACTIVATION=ACTIVATIONS[activation], BLOCK_T=tiles.block_t, BLOCK_N=tiles.block_n,
           BLOCK_K=tiles.block_k, EVEN_K=num_inner % tiles.block_k == 0, WEIGHT_TMA=tiles.weight_tma,
           **dot_options(x.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def k_per_split(num_inner: int, tiles: DenseTiles) -> int:
    """The K range of each of ``tiles.split_k`` programs: whole blocks, the last range possibly shorter."""
    return triton.cdiv(triton.cdiv(num_inner, tiles.split_k), tiles.block_k) * tiles.block_k


def down(x: Tensor, weight: Tensor, bias: Tensor | None, tiles: DenseTiles = DenseTiles()) -> Tensor:
    """x @ weight^T + bias, rounded once to x's dtype.

    x: (rows, inter), rows contiguous; weight: (hidden, inter), rows contiguous; bias: (hidden,) or None.
    Returns (rows, hidden) in x's dtype.
    """
    num_rows, num_inner = x.shape
    num_cols = weight.shape[0]
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    span = k_per_split(num_inner, tiles)
    num_splits = triton.cdiv(num_inner, span)
    # (splits, rows, cols) float32 partial sums; unsplit, a placeholder of one element (its store is masked off) that
    # keeps the kernel compiled for float32 partials
    partial = torch.empty(num_splits * num_rows * num_cols if num_splits > 1 else 1, dtype=torch.float32,
                          device=x.device)
    options = dot_options(x.dtype)
    grid = (triton.cdiv(num_rows, tiles.block_t), triton.cdiv(num_cols, tiles.block_n), num_splits)
    launch(_down_kernel, grid, x, _weight_operand(weight, tiles), weight if bias is None else bias, out, partial,
           num_rows, x.stride(0), weight.stride(0), out.stride(0), num_cols, span // tiles.block_k, num_splits,
           NUM_INNER=num_inner, HAS_BIAS=bias is not None, BLOCK_T=tiles.block_t, BLOCK_N=tiles.block_n,
           BLOCK_K=tiles.block_k, WEIGHT_TMA=tiles.weight_tma, **options,
           STATIC_BLOCKS_PER_SPLIT=span // tiles.block_k if _INTERPRETED else 0, num_warps=tiles.num_warps,
           num_stages=tiles.num_stages)
    if num_splits > 1:
        block = min(triton.next_power_of_2(num_cols), 1024)
        launch(_split_sum_kernel, (num_rows, triton.cdiv(num_cols, block)), partial, weight if bias is None else bias,
               out, num_rows, num_cols, out.stride(0), SPLIT=num_splits, HAS_BIAS=bias is not None, BLOCK=block,
               UPCAST=options["UPCAST"], num_warps=4)
    return out


@dataclass(frozen=True)
class DenseKernels:
    """How each product of the MLP runs: a tiling of its Triton kernel, or None for cuBLAS (with
    ``triton_kernels.act_and_mul`` after gate|up)."""

    gate_up: DenseTiles | None
    down: DenseTiles | None

    def __str__(self) -> str:
        return f"gate|up {self.gate_up or 'cuBLAS'}; down {self.down or 'cuBLAS'}"


def gated_mlp(x: Tensor, weights: MLPWeights, activation: str, kernels: DenseKernels) -> Tensor:
    """down(act(gate(x)) * up(x)) for x (rows, hidden), each product by ``kernels``. Returns (rows, hidden)."""
    x = x.contiguous()
    if kernels.gate_up is None:
        activated = triton_kernels.act_and_mul(torch.nn.functional.linear(x, weights.gate_up, weights.gate_up_bias),
                                               activation)
    else:
        activated = gate_up_act(x, weights.gate_up, weights.gate_up_bias, activation, kernels.gate_up)
    if kernels.down is None:
        return torch.nn.functional.linear(activated, weights.down, weights.down_bias)
    return down(activated, weights.down, weights.down_bias, kernels.down)
