"""The Triton grouped GEMMs of the experts (rollout/native/moe_kernels.py) and their timed choice (moe_choice.py),
run by Triton's interpreter on the CPU and against torch's grouped GEMM on the GPU."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parents[1]))
from compiled_outside_interpreter import compile_report  # noqa: E402

from reinforge.rollout.native import moe_choice, moe_kernels  # noqa: E402
from reinforge.rollout.native.moe import experts_forward  # noqa: E402
from reinforge.rollout.native.moe_choice import TILE_CONFIGS, ExpertKernelChoice  # noqa: E402
from reinforge.rollout.native.moe_kernels import (  # noqa: E402
    DecodeTiles,
    SwappedExperts,
    TileConfig,
    expert_down_scatter,
    expert_gate_up_silu,
    expert_matmul,
    expert_order,
    swapped_experts,
)


def sorted_rows(counts: list[int], inner: int, dtype: torch.dtype, device: str = "cpu"):
    """Rows sorted by expert, ``counts[e]`` of expert e, and the bounds (0, then each expert's cumulative end)."""
    generator = torch.Generator(device=device).manual_seed(0)
    rows = torch.randn(sum(counts), inner, generator=generator, device=device).to(dtype)
    bounds = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return rows, bounds


def reference(rows: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows[bounds[e]:bounds[e + 1]].float() @ weight[e].float().T for e in range(weight.shape[0])])


def test_each_experts_rows_meet_its_own_weights_across_row_blocks_and_ragged_edges():
    """Experts with no row, fewer rows than a block and more than one block of rows; columns and the inner
    dimension not multiples of their blocks; the weight read through a transposed view."""
    counts = [5, 0, 37, 16, 1]
    rows, bounds = sorted_rows(counts, inner=40, dtype=torch.float32)
    weight = torch.randn(len(counts), 40, 24, generator=torch.Generator().manual_seed(1)).transpose(1, 2)
    got = expert_matmul(rows, weight, bounds, TileConfig(block_m=16, block_n=16, block_k=16))
    assert got.shape == (sum(counts), 24)
    torch.testing.assert_close(got, reference(rows, weight, bounds), atol=1e-4, rtol=1e-4)


ROWS_PER_EXPERT = [0, 1, 7, 32, 65, 25, 0]
"""Experts with no rows (the last one too), one row, fewer rows than a block, a block's worth and more than two
blocks; two slots per token over 65 tokens."""


def routed(counts: list[int], top_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, top_k) expert ids giving expert e ``counts[e]`` assignments, no token twice to one expert (the counts
    sum to top_k times the largest), and routing weights."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens = max(counts)
    assert sum(counts) == top_k * num_tokens
    slots = [expert for expert, count in enumerate(counts) for _ in range(count)]
    ids = torch.tensor(slots).view(top_k, num_tokens).T  # token t: slots t, t + tokens, ...: distinct experts
    ids = ids[torch.randperm(num_tokens, generator=generator)].contiguous()
    return ids, torch.rand(num_tokens, top_k, generator=generator)


def layer(num_experts: int, hidden_size: int, inter: int, seed: int = 1, scale: float = 0.2):
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden_size, generator=generator) * scale
    down = torch.randn(num_experts, inter, hidden_size, generator=generator).transpose(1, 2) * scale  # a view
    return gate_up, down


def per_expert(hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """The experts as plain matmuls, expert by expert over the tokens that picked it, in float64."""
    hidden, weights, gate_up, down = hidden.double(), weights.double(), gate_up.double(), down.double()
    out = torch.zeros_like(hidden)
    for expert in range(gate_up.shape[0]):
        tokens, slots = (expert_ids == expert).nonzero(as_tuple=True)
        gate, up = (hidden[tokens] @ gate_up[expert].T).chunk(2, dim=-1)
        activated = torch.nn.functional.silu(gate) * up
        out.index_add_(0, tokens, weights[tokens, slots, None] * (activated @ down[expert].T))
    return out


SMALL_TILES = (DecodeTiles(block_t=16, block_n=16, block_k=16), DecodeTiles(block_t=32, block_n=32, block_k=32),
               DecodeTiles(block_t=16, block_n=16, block_k=16, weight_tma=True),
               DecodeTiles(block_t=16, block_n=16, block_k=16, weight_tma=True, eager=True),
               DecodeTiles(block_t=16, block_n=16, block_k=16, rotate_k=True),
               DecodeTiles(block_t=16, block_n=16, block_k=16, weight_tma=True, rotate_k=True))


@pytest.mark.parametrize("tiles", SMALL_TILES, ids=["t16", "t32", "t16-tma", "t16-tma-eager", "t16-rotated",
                                                    "t16-tma-rotated"])
def test_the_swapped_kernels_give_every_expert_its_own_rows_in_float32(tiles):
    """gate|up with silu, then down weighted and put back in token order, against per-expert matmuls: 0, 1, 7, 32
    and 65 rows per expert over blocks of 16 and 32 slots; hidden (24) and inter (20) not multiples of the blocks
    (a TMA read zero-fills past the inner dimension; gate columns past inter read up rows, which no output keeps;
    an eager first block of an expert without rows writes nothing; rotated K loops sum the same blocks)."""
    top_k, hidden_size, inter = 2, 24, 20
    if tiles.rotate_k:  # K loops rotate over whole blocks: 3 of them for gate|up, 2 for down
        hidden_size, inter = 48, 32
    counts = ROWS_PER_EXPERT
    expert_ids, weights = routed(counts, top_k)
    hidden = torch.randn(expert_ids.shape[0], hidden_size, generator=torch.Generator().manual_seed(2))
    gate_up, down = layer(len(counts), hidden_size, inter)
    assert not moe_kernels.tma_loadable(down)
    if tiles.weight_tma:
        down = down.contiguous()
        assert moe_kernels.tma_loadable(gate_up) and moe_kernels.tma_loadable(down)
    per_assignment = swapped_experts(hidden, expert_ids.reshape(-1), weights.reshape(-1), gate_up, down,
                                     SwappedExperts(tiles, tiles))
    assert per_assignment.dtype == torch.float32
    got = per_assignment.view(-1, top_k, hidden_size).sum(dim=1)
    torch.testing.assert_close(got.double(), per_expert(hidden, expert_ids, weights, gate_up, down), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("num_assignments", [0, 1, 7, 600])
def test_the_counting_sort_gives_a_stable_sorts_order_and_each_experts_bounds(num_assignments):
    """Experts with no assignment (the first and last among them), chunks of 256 and a partial last chunk."""
    num_experts = 9
    expert_ids = torch.randint(1, num_experts - 1, (num_assignments,), generator=torch.Generator().manual_seed(11))
    bounds, order = expert_order(expert_ids, num_experts, block=256)
    sorted_ids, expected_order = torch.sort(expert_ids, stable=True)
    assert order.tolist() == expected_order.tolist()
    counts = torch.bincount(expert_ids, minlength=num_experts)
    assert bounds.tolist() == [0, *counts.cumsum(0).tolist()]


def test_the_swapped_products_round_as_torchs_bf16_products_and_activation():
    """bf16: each product rounded to bf16, silu rounded before the multiply by up, the down product rounded before
    its bf16 routing weight, as the grouped-GEMM path rounds them; float32 routing weights give float32 rows."""
    top_k, hidden_size, inter = 2, 48, 32
    counts = [9, 0, 1, 20, 10, 0]
    expert_ids, weights = routed(counts, top_k, seed=3)
    hidden = torch.randn(expert_ids.shape[0], hidden_size, generator=torch.Generator().manual_seed(4))
    gate_up, down = layer(len(counts), hidden_size, inter, seed=5)
    hidden, gate_up, down = hidden.bfloat16(), gate_up.bfloat16(), down.bfloat16()
    bounds, order = expert_order(expert_ids.reshape(-1), len(counts))
    tiles = DecodeTiles(block_t=16, block_n=16, block_k=16)
    activated = expert_gate_up_silu(hidden, gate_up, bounds, order, top_k, tiles)
    tokens = hidden[order // top_k].float()
    expected_gate_up = torch.cat([tokens[bounds[e]:bounds[e + 1]] @ gate_up[e].float().T
                                  for e in range(len(counts))]).bfloat16()
    gate, up = expected_gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(activated, torch.nn.functional.silu(gate) * up, atol=1e-2, rtol=1e-2)
    for routing in (weights.reshape(-1).bfloat16(), weights.reshape(-1)):
        got = expert_down_scatter(activated, down, bounds, order, routing, tiles)
        assert got.dtype == routing.dtype
        products = torch.cat([activated[bounds[e]:bounds[e + 1]].float() @ down[e].float().T
                              for e in range(len(counts))]).bfloat16()
        expected = torch.empty_like(got).index_copy_(0, order, products * routing[order, None])
        torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)


def test_the_experts_of_a_layer_through_the_picked_kernels_equal_the_gathered_experts():
    """experts_forward with the choice's pick already made: the swapped kernels, then the tiled kernel for both
    products (an expert no token picked), each equal to the gathered experts."""
    generator = torch.Generator().manual_seed(3)
    num_tokens, top_k, num_experts, hidden_size, inter = 11, 2, 5, 32, 16
    hidden = torch.randn(num_tokens, hidden_size, generator=generator)
    expert_ids = torch.randint(0, num_experts - 1, (num_tokens, top_k), generator=generator)
    weights = torch.rand(num_tokens, top_k, generator=generator)
    gate_up, down = layer(num_experts, hidden_size, inter, seed=6)
    gathered = experts_forward(hidden, expert_ids, weights, gate_up, down, grouped=False)
    choice = ExpertKernelChoice(min_expert_bytes=0)
    key = choice.key(expert_ids.reshape(-1), weights.reshape(-1), gate_up, down)
    for picked in (SwappedExperts(SMALL_TILES[0], SMALL_TILES[1]), TileConfig(block_m=16, block_n=16, block_k=16)):
        choice.picked[key] = picked
        got = experts_forward(hidden, expert_ids, weights, gate_up, down, grouped=True, kernels=choice)
        torch.testing.assert_close(got, gathered, atol=1e-5, rtol=1e-5)


def test_the_choice_keeps_the_fastest_candidate_and_drops_failing_or_wrong_ones(monkeypatch, caplog):
    """Timings stubbed (no GPU here): the swapped pair wins when its products are timed faster than torch's; a tiling
    that fails to run and a tiled kernel whose output is wrong are each dropped in one line, the rest still timed."""
    generator = torch.Generator().manual_seed(7)
    num_tokens, top_k, num_experts, hidden_size, inter = 6, 2, 4, 16, 16
    hidden = torch.randn(num_tokens, hidden_size, generator=generator)
    expert_ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=generator)
    weights = torch.rand(num_tokens, top_k, generator=generator)
    gate_up, down = layer(num_experts, hidden_size, inter, seed=8)
    broken = DecodeTiles(block_t=16, block_n=16, block_k=16, num_warps=3)  # stubbed below to fail
    wrong = TileConfig(block_m=16, block_n=16, block_k=16)
    choice = ExpertKernelChoice(tiles={"gate_up": (SMALL_TILES[0], broken), "down": (SMALL_TILES[0], broken)},
                                tile_configs=(wrong,), min_expert_bytes=0)
    real_gate_up, real_matmul = moe_kernels.expert_gate_up_silu, moe_kernels.expert_matmul

    def gate_up_or_fail(*args):
        if args[-1] == broken:
            raise RuntimeError("out of resources: shared memory\nsecond line")
        return real_gate_up(*args)

    monkeypatch.setattr(moe_kernels, "expert_gate_up_silu", gate_up_or_fail)
    monkeypatch.setattr(moe_kernels, "expert_matmul", lambda *args: real_matmul(*args) + 1.0)
    timed = []

    def torch_first_and_slowest(self, run):
        timed.append(run)
        return 2.0 if len(timed) == 1 else 0.5

    monkeypatch.setattr(ExpertKernelChoice, "_time", torch_first_and_slowest)
    with caplog.at_level(logging.INFO, logger=moe_choice.__name__):
        got = experts_forward(hidden, expert_ids, weights, gate_up, down, grouped=True, kernels=choice)
    (picked,) = choice.picked.values()
    assert picked == SwappedExperts(SMALL_TILES[0], SMALL_TILES[0])
    assert choice.failed == {f"swapped gate_up {broken}", str(wrong)}
    dropped = [record.getMessage() for record in caplog.records if "dropped" in record.getMessage()]
    assert len(dropped) == 2 and all("\n" not in line for line in dropped)
    assert "out of resources: shared memory" in dropped[0] and "differs from torch's" in dropped[1]
    gathered = experts_forward(hidden, expert_ids, weights, gate_up, down, grouped=False)
    torch.testing.assert_close(got, gathered, atol=1e-5, rtol=1e-5)


def test_the_choice_times_its_candidates_on_assignments_spread_over_the_experts(monkeypatch):
    """A decode graph's warm-up runs identical padding tokens, which all pick the same experts; the candidates are
    timed on the call's number of assignments spread over the experts, and the call still returns its own
    routing's output."""
    num_tokens, top_k, num_experts, hidden_size, inter = 16, 2, 8, 16, 16
    hidden = torch.randn(1, hidden_size, generator=torch.Generator().manual_seed(9)).expand(num_tokens, -1).contiguous()
    expert_ids = torch.tensor([[3, 5]]).expand(num_tokens, -1)
    weights = torch.full((num_tokens, top_k), 0.5)
    gate_up, down = layer(num_experts, hidden_size, inter, seed=10)
    experts_used = []
    real_gate_up = moe_kernels.expert_gate_up_silu

    def counting(hidden, gate_up, bounds, *args):
        experts_used.append(int((bounds.diff() > 0).sum()))
        return real_gate_up(hidden, gate_up, bounds, *args)

    monkeypatch.setattr(moe_kernels, "expert_gate_up_silu", counting)
    monkeypatch.setattr(ExpertKernelChoice, "_time", lambda self, run: 1.0)
    choice = ExpertKernelChoice(tiles={"gate_up": SMALL_TILES[:1], "down": SMALL_TILES[:1]}, tile_configs=(),
                                min_expert_bytes=0)
    got = experts_forward(hidden, expert_ids, weights, gate_up, down, grouped=True, kernels=choice)
    assert experts_used and min(experts_used) >= num_experts - 2, experts_used
    gathered = experts_forward(hidden, expert_ids, weights, gate_up, down, grouped=False)
    torch.testing.assert_close(got, gathered, atol=1e-5, rtol=1e-5)


def test_small_layers_run_torchs_grouped_gemms_untimed(monkeypatch):
    """Experts lighter than ``min_expert_bytes`` (tiny test models) compile and time nothing."""
    monkeypatch.setattr(ExpertKernelChoice, "_time", lambda self, run: pytest.fail("timed a small layer"))
    generator = torch.Generator().manual_seed(12)
    hidden = torch.randn(4, 16, generator=generator)
    expert_ids = torch.randint(0, 4, (4, 2), generator=generator)
    weights = torch.rand(4, 2, generator=generator)
    gate_up, down = layer(4, 16, 16, seed=13)
    choice = ExpertKernelChoice()
    got = experts_forward(hidden, expert_ids, weights, gate_up, down, grouped=True, kernels=choice)
    assert not choice.picked and not choice.timings
    torch.testing.assert_close(got, experts_forward(hidden, expert_ids, weights, gate_up, down, grouped=False),
                               atol=1e-5, rtol=1e-5)


HOPPER_COMPILE = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from reinforge.rollout.native import moe_choice, moe_kernels

SIGNATURES = {  # the Qwen3-30B-A3B expert shapes, bf16, as the launchers pass them
    "gate_up": (moe_kernels._gate_up_silu_kernel, 2048, dict(
        hidden_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16", bounds_ptr="*i32", order_ptr="*i64",
        stride_hidden="i32", stride_expert="i32", stride_n="i32", stride_out="i32", num_inter="i32"), dict(TOP_K=8)),
    "down": (moe_kernels._down_scatter_kernel, 768, dict(
        rows_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16", bounds_ptr="*i32", order_ptr="*i64",
        routing_ptr="*bf16", stride_row="i32", stride_expert="i32", stride_n="i32", stride_out="i32",
        num_cols="i32"), {}),
}
results = []
for product, (kernel, inner, arguments, extra) in SIGNATURES.items():
    for tiles in moe_choice.PRODUCT_TILES[product]:
        signature = {name: "constexpr" for name in kernel.arg_names} | arguments
        if tiles.weight_tma:
            signature["weight_ptr"] = f"tensordesc<bf16[1, {tiles.block_n}, {tiles.block_k}]>"
        constants = dict(stride_k=1, NUM_INNER=inner, BLOCK_T=tiles.block_t, BLOCK_N=tiles.block_n,
                         BLOCK_K=tiles.block_k, EVEN_K=True, WEIGHT_TMA=tiles.weight_tma, PRECISION="tf32",
                         UPCAST=False, STATIC_LOOP_END=0) | extra
        aligned = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in arguments.items()
                   if name in signature and signature[name] == kind}  # 16-byte pointers and strides, as launched
        source = ASTSource(fn=kernel, signature=signature, attrs=aligned,
                           constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
        ttgir = compiled.asm["ttgir"]
        results.append(dict(tiles=str(tiles), product=product, shared=compiled.metadata.shared,
                            async_copies=ttgir.count("async_copy_global_to_local"),
                            tma_copies=ttgir.count("async_tma_copy")))
kernel = moe_kernels._expert_order_kernel
signature = {name: "constexpr" for name in kernel.arg_names} | dict(
    ids_ptr="*i64", order_ptr="*i64", bounds_ptr="*i32", num_assignments="i32", num_experts="i32")
compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs={
    (kernel.arg_names.index("NUM_CHUNKS"),): 4, (kernel.arg_names.index("BLOCK"),): 1024}),
    target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
results.append(dict(product="order", shared=compiled.metadata.shared))
print(json.dumps(results))
"""


@pytest.mark.slow
def test_every_swapped_tiling_compiles_for_hopper_with_its_weight_loads_pipelined():
    """Each tiling of both swapped products, and the counting sort, compiled for sm_90 (no GPU needed; Triton's own
    ptxas), outside the interpreter: the weight loads run as asynchronous copies (TMA for the TMA tilings) in
    num_stages buffers, and the shared memory fits an H100/H200 SM (227 KiB)."""
    results = compile_report(HOPPER_COMPILE)
    assert results.pop()["product"] == "order"  # the counting sort compiles too
    tilings = [tiles for product in ("gate_up", "down") for tiles in moe_choice.PRODUCT_TILES[product]]
    for result, tiles in zip(results, tilings, strict=True):
        assert result["shared"] <= 227 * 1024, result
        pipelined = result["tma_copies"] if tiles.weight_tma else result["async_copies"]
        assert pipelined >= tiles.num_stages - 1, result


@pytest.mark.gpu
def test_the_triton_kernels_give_torchs_grouped_gemm_products_in_bf16():
    """Every tiling of each kernel (the TMA ones included) on the Qwen3-30B-A3B expert shapes, against torch's
    grouped GEMM: gate|up with silu, and down weighted by float32 routing weights in assignment order."""
    from reinforge.rollout.native.moe import _grouped_mm

    counts = torch.randint(0, 64, (128,), generator=torch.Generator().manual_seed(2)).tolist()
    rows, bounds = sorted_rows(counts, inner=2048, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(128, 1536, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(128, 2048, 768, device="cuda", dtype=torch.bfloat16) * 0.02
    offsets = bounds[1:].contiguous()
    torch_out = _grouped_mm(rows, weight.transpose(1, 2), offs=offsets)
    for config in TILE_CONFIGS:
        torch.testing.assert_close(expert_matmul(rows, weight, bounds, config).float(), torch_out.float(),
                                   atol=2e-2, rtol=2e-2)
    order = torch.randperm(rows.shape[0], device="cuda")  # top_k 1: sorted row s is token order[s]
    hidden = torch.empty_like(rows).index_copy_(0, order, rows)
    gate, up = torch_out.chunk(2, dim=-1)
    activated = (torch.nn.functional.silu(gate) * up).contiguous()
    routing = torch.rand(rows.shape[0], device="cuda")
    down_out = _grouped_mm(activated, down.transpose(1, 2), offs=offsets) * routing[order, None]
    expected_down = torch.empty_like(down_out).index_copy_(0, order, down_out)
    for tiles in moe_choice.PRODUCT_TILES["gate_up"]:
        torch.testing.assert_close(expert_gate_up_silu(hidden, weight, bounds, order, 1, tiles).float(),
                                   activated.float(), atol=2e-2, rtol=2e-2,
                                   msg=lambda text, tiles=tiles: f"{tiles}: {text}")
    for tiles in moe_choice.PRODUCT_TILES["down"]:
        torch.testing.assert_close(expert_down_scatter(activated, down, bounds, order, routing, tiles),
                                   expected_down, atol=2e-2, rtol=2e-2,
                                   msg=lambda text, tiles=tiles: f"{tiles}: {text}")


@pytest.mark.gpu
def test_the_timed_choice_gives_torchs_experts_in_bf16():
    generator = torch.Generator(device="cuda").manual_seed(0)
    num_tokens, top_k, num_experts, hidden_size, inter = 256, 8, 128, 2048, 768
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", dtype=torch.bfloat16, generator=generator)
    scores = torch.randn(num_tokens, num_experts, device="cuda", generator=generator)
    weights, expert_ids = scores.softmax(-1).topk(top_k, dim=-1)
    gate_up = torch.randn(num_experts, 2 * inter, hidden_size, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(num_experts, hidden_size, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    weights = weights.bfloat16()
    expected = experts_forward(hidden, expert_ids, weights, gate_up, down, grouped=True)
    choice = ExpertKernelChoice()
    got = experts_forward(hidden, expert_ids, weights, gate_up, down, grouped=True, kernels=choice)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert len(choice.picked) == 1 and not choice.failed, choice.failed
    (timings,) = choice.timings.values()
    assert {"torch", *map(str, TILE_CONFIGS)} <= timings.keys()
