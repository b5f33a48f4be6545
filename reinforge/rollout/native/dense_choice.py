"""Which kernels run a decode step's gated MLP: cuBLAS or the Triton ones of ``dense_kernels.py``, timed.

A decode step's MLP products are bound by reading the weights; whether cuBLAS's tiling or a swapped Triton tiling
comes closer to the device's copy rate depends on the shape, the number of rows and the device, so
``DenseMLPChoice`` times the candidates once per (shape, rows), outside graph capture (the decode graph's warm-up
forward runs first), and keeps the fastest for each product: cuBLAS, or one of the tilings (``GATE_UP_TILES``,
``DOWN_TILES``; the down product also split along K, ``down_splits``). Each candidate is timed replayed from a CUDA
graph, as the decode step runs it, after a read that evicts the weights from L2, as the other layers' reads do.
A candidate that fails to compile or run, or gives other numbers than cuBLAS, is dropped in one line and cuBLAS
stays. The attention's q|k|v and o products of a decode step are chosen the same way (``DenseMLPChoice.linear``:
cuBLAS or the down kernel's tilings and splits).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from torch import Tensor

from reinforge.rollout.native import dense_kernels, triton_kernels
from reinforge.rollout.native.compile_ahead import compile_ahead
from reinforge.rollout.native.dense_kernels import DenseKernels, DenseTiles, MLPWeights
from reinforge.rollout.native.timed_choice import CheckedTimings

logger = logging.getLogger(__name__)

GATE_UP_TILES = (
    DenseTiles(block_t=16, block_n=16, block_k=256, num_stages=3),
    DenseTiles(block_t=16, block_n=32, block_k=128, num_stages=3),
    DenseTiles(block_t=16, block_n=64, block_k=128, num_stages=4),
    DenseTiles(block_t=16, block_n=32, block_k=256, num_stages=4),
    DenseTiles(block_t=16, block_n=64, block_k=128, num_stages=4, weight_tma=True),
    DenseTiles(block_t=32, block_n=64, block_k=128, num_stages=4),
    DenseTiles(block_t=32, block_n=64, block_k=128, num_stages=4, weight_tma=True),
    DenseTiles(block_t=32, block_n=32, block_k=128, num_stages=3),
    DenseTiles(block_t=32, block_n=32, block_k=256, num_stages=3),
    DenseTiles(block_t=64, block_n=32, block_k=128, num_stages=3),
    DenseTiles(block_t=64, block_n=64, block_k=128, num_stages=3),
    DenseTiles(block_t=64, block_n=64, block_k=128, num_stages=3, weight_tma=True),
    DenseTiles(block_t=64, block_n=128, block_k=64, num_stages=3, num_warps=8, weight_tma=True),
    DenseTiles(block_t=128, block_n=64, block_k=64, num_stages=4, num_warps=8),
    DenseTiles(block_t=128, block_n=64, block_k=64, num_stages=4, num_warps=8, weight_tma=True),
)
"""Gate|up tilings: stages x (2 x block_n + block_t) x block_k x 2 bytes of shared memory in bf16 (48 to 164 KiB),
which sets how many weight bytes a program keeps in flight and how many programs an SM holds. The product cannot
split along K (the activation needs whole sums), so narrower blocks of weight rows (16 and 32) make more, smaller
programs, several an SM, where 64 rows give about one program an SM (140 for a 1.5B model's 8960 inter columns)
and a second wave on a few SMs."""

DOWN_TILES = (
    DenseTiles(block_t=16, block_n=32, block_k=128, num_stages=3),
    DenseTiles(block_t=16, block_n=64, block_k=128, num_stages=4),
    DenseTiles(block_t=16, block_n=64, block_k=256, num_stages=4),
    DenseTiles(block_t=16, block_n=64, block_k=128, num_stages=4, weight_tma=True),
    DenseTiles(block_t=32, block_n=32, block_k=128, num_stages=3),
    DenseTiles(block_t=32, block_n=64, block_k=128, num_stages=4),
    DenseTiles(block_t=32, block_n=64, block_k=256, num_stages=3, weight_tma=True),
    DenseTiles(block_t=64, block_n=64, block_k=128, num_stages=4),
    DenseTiles(block_t=64, block_n=64, block_k=128, num_stages=4, weight_tma=True),
    DenseTiles(block_t=64, block_n=128, block_k=128, num_stages=3, num_warps=8, weight_tma=True),
    DenseTiles(block_t=128, block_n=64, block_k=128, num_stages=3, num_warps=8),
    DenseTiles(block_t=128, block_n=64, block_k=128, num_stages=3, num_warps=8, weight_tma=True),
)
"""Down tilings (stages x (block_n + block_t) x block_k x 2 bytes, 36 to 160 KiB), each also split along K
(``down_splits``): a 1.5B model's 1536 output columns are 24 blocks of 64."""

MAX_DECODE_ROWS = 256
"""The Triton kernels are candidates for decode steps of at most this many rows; larger steps are closer to
compute-bound, where cuBLAS's tiling is the one to run."""

MIN_MLP_BYTES = 16 << 20
"""The Triton kernels are candidates for MLPs whose weights weigh at least this much (a 0.5B model's: 26 MB a layer);
below, compiling and timing them costs more than they could save, and cuBLAS runs untimed."""

MIN_LINEAR_BYTES = 4 << 20
"""The same for a single product (``DenseMLPChoice.linear``: the attention's q|k|v and o products; a 1.5B model's
weigh 6.3 and 4.7 MB)."""


def candidate_tiles(tiles: tuple[DenseTiles, ...], num_rows: int) -> list[DenseTiles]:
    """The tilings worth timing for ``num_rows`` rows: blocks of rows no wider than the rows rounded up to a power
    of two (at least 16, the MMA's narrowest), so no program multiplies rows that are all padding."""
    widest = max(16, triton.next_power_of_2(num_rows))
    return [tile for tile in tiles if tile.block_t <= widest]


def down_splits(tiles: DenseTiles, num_rows: int, num_cols: int, num_inner: int, num_sms: int) -> list[int]:
    """The K splits to time a down tiling with: none, and those giving one, two or four programs an SM, rounded down
    (no SM runs a second wave while others idle) and, for one an SM, up; at most one K block a program."""
    output_blocks = triton.cdiv(num_rows, tiles.block_t) * triton.cdiv(num_cols, tiles.block_n)
    num_blocks = triton.cdiv(num_inner, tiles.block_k)
    splits = {1, triton.cdiv(num_sms, output_blocks)} | {per_sm * num_sms // output_blocks for per_sm in (1, 2, 4)}
    return sorted({min(split, num_blocks) for split in splits if split >= 1})


def readable(tiles: DenseTiles, weight: Tensor) -> bool:
    """Whether the kernels can read ``weight`` with ``tiles``: contiguous rows, and for TMA 16-byte aligned ones."""
    return weight.stride(-1) == 1 and (not tiles.weight_tma or dense_kernels.tma_loadable(weight))


def cublas_mlp(x: Tensor, weights: MLPWeights, activation: str) -> Tensor:
    """The MLP as the Triton path runs it without the choice: cuBLAS products and ``triton_kernels.act_and_mul``."""
    activated = triton_kernels.act_and_mul(F.linear(x, weights.gate_up, weights.gate_up_bias), activation)
    return F.linear(activated, weights.down, weights.down_bias)


class DenseMLPChoice(CheckedTimings):
    """Which kernels run a gated MLP, per (rows, gate|up and down shapes, biases, activation, dtype): cuBLAS unless
    a Triton tiling of a product was timed faster (for decode steps of ``max_rows`` or fewer, of MLPs of
    ``min_weight_bytes`` or more). Each product is timed alone on the call's rows and weights (down on cuBLAS's
    gate|up output), then the picked pair against cuBLAS's MLP. A candidate that fails to compile or run, or
    whose output is not cuBLAS's within bf16 rounding, is dropped in one line. Timing needs a stream that is not
    capturing; inside a capture an untimed shape runs cuBLAS."""

    reference, candidates, fallback = "cuBLAS's", "the dense MLP kernel", "cuBLAS or another tiling runs it"

    def __init__(self, repeats: int = 10, gate_up_tiles: tuple[DenseTiles, ...] = GATE_UP_TILES,
                 down_tiles: tuple[DenseTiles, ...] = DOWN_TILES, max_rows: int = MAX_DECODE_ROWS,
                 min_weight_bytes: int = MIN_MLP_BYTES, min_linear_bytes: int = MIN_LINEAR_BYTES):
        self.repeats = repeats
        self.gate_up_tiles = gate_up_tiles
        self.down_tiles = down_tiles
        self.max_rows = max_rows
        self.min_weight_bytes = min_weight_bytes
        self.min_linear_bytes = min_linear_bytes
        self.picked: dict[tuple, DenseKernels | DenseTiles | None] = {}
        """key -> the kernels that run it: an MLP's ``DenseKernels``, a single product's tiling (``linear``), None
        for cuBLAS."""
        self.timings: dict[tuple, dict[str, float]] = {}
        """key -> milliseconds of each candidate timed."""
        super().__init__()  # self.failed: candidates (their names) dropped
        self._flush: Tensor | None = None
        self._flush_milliseconds = 0.0
        self._stream: torch.cuda.Stream | None = None

    def __call__(self, x: Tensor, weights: MLPWeights, activation: str) -> Tensor:
        """down(act(gate(x)) * up(x)) for x (rows, hidden) by the picked kernels. Returns (rows, hidden)."""
        kernels = self.kernels_for(x, weights, activation)
        if kernels is None:
            return cublas_mlp(x, weights, activation)
        return dense_kernels.gated_mlp(x, weights, activation, kernels)

    def key(self, x: Tensor, weights: MLPWeights, activation: str) -> tuple:
        """What the pick depends on: the rows, the shapes, the biases, the activation, the dtype and how the kernels
        can read each weight (contiguous rows; by TMA), so a layer whose weights lie otherwise is timed apart."""
        layouts = tuple((weight.stride(-1) == 1, dense_kernels.tma_loadable(weight))
                        for weight in (weights.gate_up, weights.down))
        return (x.shape[0], *weights.gate_up.shape, weights.down.shape[0], weights.gate_up_bias is not None,
                weights.down_bias is not None, activation, x.dtype, layouts)

    def kernels_for(self, x: Tensor, weights: MLPWeights, activation: str) -> DenseKernels | None:
        """The picked kernels for the call's key, timed now when the key is new and the stream is not capturing."""
        if x.shape[0] > self.max_rows or sum(weight.nbytes for weight in weights if weight is not None) \
                < self.min_weight_bytes:
            return None
        key = self.key(x, weights, activation)
        if key in self.picked:
            return self.picked[key]
        x = x.contiguous()
        return self._pick(key, x, f"the gated MLP of {x.shape[0]} rows x {tuple(weights.gate_up.shape)}",
                          lambda timings: self._timed_pick(x, weights, activation, timings))

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """x @ weight^T + bias for a decode step's x (rows, inner), weight (cols, inner): the attention's q|k|v and o
        products, by the down kernel's tiling (and K split) timed fastest for the rows and shape, or cuBLAS."""
        tiles = self.linear_tiles_for(x, weight, bias)
        if tiles is None:
            return F.linear(x, weight, bias)
        return dense_kernels.down(x.contiguous(), weight, bias, tiles)

    def linear_tiles_for(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> DenseTiles | None:
        """The picked tiling for a single product, timed now as ``kernels_for`` times an MLP's."""
        if x.shape[0] > self.max_rows or weight.nbytes < self.min_linear_bytes:
            return None
        key = ("linear", x.shape[0], *weight.shape, bias is not None, x.dtype, weight.stride(-1) == 1,
               dense_kernels.tma_loadable(weight))
        if key in self.picked:
            return self.picked[key]
        x = x.contiguous()
        return self._pick(key, x, f"the product of {x.shape[0]} rows x {tuple(weight.shape)}",
                          lambda timings: self._fastest("linear", lambda: F.linear(x, weight, bias), [
                              (tiles, lambda tiles=tiles: dense_kernels.down(x, weight, bias, tiles))
                              for tiles in self._split_candidates(x, weight)], timings))

    def _pick(self, key: tuple, x: Tensor, what: str, timed_pick):
        """The pick for a new ``key``, timed now by ``timed_pick(timings)`` and kept, unless the stream is capturing
        (cuBLAS then runs, untimed); a failure of the timing itself keeps cuBLAS, said in one line."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        timings: dict[str, float] = {}
        try:
            picked = timed_pick(timings)
        except Exception as error:  # noqa: BLE001 (cuBLAS's own timing failed: run it untimed)
            logger.warning("%s could not be timed (%s: %s); cuBLAS runs it", what, type(error).__name__,
                           str(error).splitlines()[0] if str(error) else "")
            picked = None
        finally:
            self._flush = None
        self.picked[key], self.timings[key] = picked, timings
        logger.info("%s: %s; running %s", what, ", ".join(f"{name} {ms:.4f} ms" for name, ms in timings.items()),
                    picked or "cuBLAS")
        return picked

    def _split_candidates(self, x: Tensor, weight: Tensor) -> list[DenseTiles]:
        """The down tilings that can read ``weight`` (cols, inner), each at its K splits for x's rows."""
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        num_cols, num_inner = weight.shape
        return [dataclasses.replace(tiles, split_k=split)
                for tiles in candidate_tiles(self.down_tiles, x.shape[0]) if readable(tiles, weight)
                for split in down_splits(tiles, x.shape[0], num_cols, num_inner, num_sms)]

    def _timed_pick(self, x: Tensor, weights: MLPWeights, activation: str,
                    timings: dict[str, float]) -> DenseKernels | None:
        gate_up_linear = lambda: triton_kernels.act_and_mul(  # noqa: E731
            F.linear(x, weights.gate_up, weights.gate_up_bias), activation)
        activated = gate_up_linear()
        gate_up_tiles = self._fastest("gate|up", gate_up_linear, [
            (tiles, lambda tiles=tiles: dense_kernels.gate_up_act(x, weights.gate_up, weights.gate_up_bias,
                                                                 activation, tiles))
            for tiles in candidate_tiles(self.gate_up_tiles, x.shape[0]) if readable(tiles, weights.gate_up)], timings)
        down_tiles = self._fastest("down", lambda: F.linear(activated, weights.down, weights.down_bias), [
            (tiles, lambda tiles=tiles: dense_kernels.down(activated, weights.down, weights.down_bias, tiles))
            for tiles in self._split_candidates(x, weights.down)], timings)
        if gate_up_tiles is None and down_tiles is None:
            return None
        picked = DenseKernels(gate_up_tiles, down_tiles)
        timings["cuBLAS MLP"] = self._time(lambda: cublas_mlp(x, weights, activation))
        milliseconds = self._checked_time(str(picked), lambda: dense_kernels.gated_mlp(x, weights, activation, picked),
                                          cublas_mlp(x, weights, activation))
        if milliseconds is None:
            return None
        timings[f"{picked} MLP"] = milliseconds
        return picked if milliseconds < timings["cuBLAS MLP"] else None

    def _fastest(self, product: str, cublas: Callable[[], Tensor],
                 candidates: list[tuple[DenseTiles, Callable[[], Tensor]]],
                 timings: dict[str, float]) -> DenseTiles | None:
        """The tiling timed faster than cuBLAS for one product, or None (cuBLAS). The tilings' kernels are compiled
        together first, on threads (``compile_ahead``)."""
        candidates = [(tiles, run) for tiles, run in candidates if f"{product} {tiles}" not in self.failed]
        compile_ahead([run for _, run in candidates], f"{product} tilings")
        expected = cublas()
        fastest: tuple[float, DenseTiles | None] = (self._time(cublas), None)
        timings[f"{product} cuBLAS"] = fastest[0]
        for tiles, run in candidates:
            name = f"{product} {tiles}"
            milliseconds = self._checked_time(name, run, expected)
            if milliseconds is not None:
                timings[name] = milliseconds
                if milliseconds < fastest[0]:
                    fastest = (milliseconds, tiles)
        return fastest[1]

    def _time(self, run: Callable[[], Tensor]) -> float:
        """Milliseconds per ``run()`` replayed from a CUDA graph, each run after a read of twice the L2's size (so
        the weights come from DRAM and the L2 holds clean lines, as after the other layers' weight reads in a decode
        step), that read's own time taken off."""
        run()  # compiles, picks its kernels
        torch.cuda.synchronize()
        if self._flush is None:
            size = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
            self._flush = torch.zeros(size // 2, dtype=torch.float32, device="cuda")
            self._flush_milliseconds = self._graph_time(self._flush.sum)
        flush = self._flush
        return max(self._graph_time(lambda: (flush.sum(), run())) - self._flush_milliseconds, 0.0)

    def _graph_time(self, run: Callable[[], object]) -> float:
        # capture_begin rather than torch.cuda.graph, which collects garbage and empties the cache at each capture;
        # one side stream for every capture (cuBLAS keeps a workspace per stream); thread_local: a training worker
        # on another thread (trainer.separate_rollout) may launch meanwhile
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        graph, stream = torch.cuda.CUDAGraph(), self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # on the capture stream first: cuBLAS's workspace for it is allocated outside the capture
            stream.synchronize()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                for _ in range(self.repeats):
                    run()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / self.repeats


_DENSE_KERNELS: list[DenseMLPChoice] = []


def dense_mlp_choice() -> DenseMLPChoice:
    """The one ``DenseMLPChoice`` of the process: every layer and engine shares its timings."""
    if not _DENSE_KERNELS:
        _DENSE_KERNELS.append(DenseMLPChoice())
    return _DENSE_KERNELS[0]
