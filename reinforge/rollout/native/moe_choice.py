"""Which kernels run a layer's experts: torch's grouped GEMMs or the Triton ones of ``moe_kernels.py``, timed.

A decode step's expert products are bound by reading every expert's weights; how close a kernel comes to the
device's copy rate depends on its tiling and on the device, so ``ExpertKernelChoice`` times the candidates once per
shape and row count, outside graph capture (the decode graph's warm-up forward runs first), on that many
assignments spread over the experts (the warm-up's padding tokens all pick the same experts), and keeps the
fastest: torch's grouped GEMMs, the tiled kernel (``TILE_CONFIGS``) or the swapped kernels, each product with the
fastest of its tilings (``PRODUCT_TILES``). A candidate that fails to compile or run, or gives other numbers than
torch's, is dropped in one line and the others (torch's at least) stay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import triton
from torch import Tensor

from reinforge.rollout.native import moe_kernels
from reinforge.rollout.native.compile_ahead import compile_ahead
from reinforge.rollout.native.moe_kernels import DecodeTiles, SwappedExperts, TileConfig
from reinforge.rollout.native.timed_choice import CheckedTimings

logger = logging.getLogger(__name__)

TILE_CONFIGS = (TileConfig(), TileConfig(block_n=128, block_k=64, num_stages=4), TileConfig(block_k=64, num_stages=4))
"""The tilings ``ExpertKernelChoice`` times: the shared memory they take sets how many programs an SM keeps busy
streaming weights."""

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


class ExpertKernelChoice(CheckedTimings):
    """Which kernels run the experts, per (assignments rounded up to a power of two, experts, gate|up and down
    shapes, dtypes): torch's grouped GEMMs unless a Triton candidate was timed faster (for decode-sized batches of
    layers of ``min_expert_bytes`` or more). Candidates are timed on the call's hidden states and weights with its
    number of assignments spread over the experts at random (``spread_assignments``). The swapped kernels are timed
    tiling by tiling for each product, then as a pair against torch's and the tiled kernel's tilings
    (``TILE_CONFIGS``). A candidate that fails to compile or run, or whose output is not torch's within bf16
    rounding, is dropped in one line. Timing needs a stream that is not capturing; inside a capture an untimed
    shape runs torch's."""

    reference, candidates, fallback = "torch's", "the Triton expert kernel", "the experts run another candidate"

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
        super().__init__()  # self.failed: candidates (their ``str``) dropped

    def __call__(self, hidden: Tensor, expert_ids: Tensor, routing: Tensor, gate_up: Tensor, down: Tensor,
                 tiled: TiledExperts) -> Tensor:
        """Every assignment's weighted expert output, (assignments, hidden) in assignment order, by the picked
        candidate (``tiled(expert_ids, None)`` is torch's). expert_ids, routing: (assignments,), token-major."""
        candidate = self._candidate_for(hidden, expert_ids, routing, gate_up, down, tiled)
        if isinstance(candidate, SwappedExperts):
            return moe_kernels.swapped_experts(hidden, expert_ids, routing, gate_up, down, candidate)
        if isinstance(candidate, TileConfig):
            return tiled(expert_ids,
                         lambda rows, weight, bounds: moe_kernels.expert_matmul(rows, weight, bounds, candidate))
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
        runs: dict[Candidate, Callable[[], Tensor]] = {}
        for config in self.tile_configs:
            runs[config] = lambda config=config: tiled(
                expert_ids, lambda rows, weight, bounds: moe_kernels.expert_matmul(rows, weight, bounds, config))
        bounds, order = moe_kernels.expert_order(expert_ids, gate_up.shape[0])
        self._compile_candidates(hidden, bounds, order, routing, gate_up, down,
                                 [run for config, run in runs.items() if str(config) not in self.failed])
        expected = tiled(expert_ids, None)
        timings = {"torch": self._time(lambda: tiled(expert_ids, None))}
        swapped = self._swapped_tiles(hidden, bounds, order, routing, gate_up, down, timings)
        if swapped is not None:
            runs[swapped] = lambda: moe_kernels.swapped_experts(hidden, expert_ids, routing, gate_up, down, swapped)
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

    def _compile_candidates(self, hidden: Tensor, bounds: Tensor, order: Tensor, routing: Tensor, gate_up: Tensor,
                            down: Tensor, tiled_runs: list[Callable[[], Tensor]]) -> None:
        """Every candidate's kernels compiled at once, on threads (``compile_ahead``), before any is timed: the tiled
        kernel's runs and each swapped product's tilings (bounds, order: ``expert_order`` of the timed assignments)."""
        top_k = max(order.shape[0] // max(hidden.shape[0], 1), 1)
        activated = torch.empty(order.shape[0], gate_up.shape[1] // 2, dtype=hidden.dtype, device=hidden.device)
        runs = list(tiled_runs)
        runs += [lambda tiles=tiles: moe_kernels.expert_gate_up_silu(hidden, gate_up, bounds, order, top_k, tiles)
                 for tiles in self._product_tiles("gate_up", gate_up)]
        runs += [lambda tiles=tiles: moe_kernels.expert_down_scatter(activated, down, bounds, order, routing, tiles)
                 for tiles in self._product_tiles("down", down)]
        compile_ahead(runs, f"the expert kernels of {tuple(gate_up.shape)}")

    def _product_tiles(self, product: str, weight: Tensor) -> list[DecodeTiles]:
        """The tilings of a swapped product that can read ``weight`` and were not dropped."""
        return [tiles for tiles in self.tiles[product] if (not tiles.weight_tma or moe_kernels.tma_loadable(weight))
                and f"swapped {product} {tiles}" not in self.failed]

    def _swapped_tiles(self, hidden: Tensor, bounds: Tensor, order: Tensor, routing: Tensor, gate_up: Tensor,
                       down: Tensor, timings: dict[str, float]) -> SwappedExperts | None:
        """The fastest tiling of each swapped product, timed alone (the down product on the gate|up one's output)."""
        top_k = max(order.shape[0] // max(hidden.shape[0], 1), 1)
        gate_up_tiles = self._fastest_tiles("gate_up", gate_up, timings, lambda tiles: lambda: (
            moe_kernels.expert_gate_up_silu(hidden, gate_up, bounds, order, top_k, tiles)))
        if gate_up_tiles is None:
            return None
        activated = moe_kernels.expert_gate_up_silu(hidden, gate_up, bounds, order, top_k, gate_up_tiles)
        down_tiles = self._fastest_tiles("down", down, timings, lambda tiles: lambda: (
            moe_kernels.expert_down_scatter(activated, down, bounds, order, routing, tiles)))
        return None if down_tiles is None else SwappedExperts(gate_up_tiles, down_tiles)

    def _fastest_tiles(self, product: str, weight: Tensor, timings: dict[str, float],
                       runner: Callable[[DecodeTiles], Callable[[], Tensor]]) -> DecodeTiles | None:
        fastest: tuple[float, DecodeTiles] | None = None
        for tiles in self._product_tiles(product, weight):
            name = f"swapped {product} {tiles}"
            milliseconds = self._checked_time(name, runner(tiles), None)
            if milliseconds is not None:
                timings[name] = milliseconds
                if fastest is None or milliseconds < fastest[0]:
                    fastest = (milliseconds, tiles)
        return None if fastest is None else fastest[1]

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
