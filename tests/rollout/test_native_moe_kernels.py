"""The Triton grouped GEMM of the experts (rollout/native/moe_kernels.py), run by Triton's interpreter on the CPU
and against torch's grouped GEMM on the GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from reinforge.rollout.native.moe_kernels import TILE_CONFIGS, ExpertKernelChoice, TileConfig, expert_matmul  # noqa: E402


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


def test_the_experts_of_a_layer_through_the_triton_kernel_equal_the_gathered_experts():
    """experts_forward's grouped path with the Triton kernel for both products (an expert no token picked)."""
    from reinforge.rollout.native.moe import experts_forward

    generator = torch.Generator().manual_seed(3)
    num_tokens, top_k, num_experts, hidden_size, inter = 11, 2, 5, 32, 16
    hidden = torch.randn(num_tokens, hidden_size, generator=generator)
    expert_ids = torch.randint(0, num_experts - 1, (num_tokens, top_k), generator=generator)
    weights = torch.rand(num_tokens, top_k, generator=generator)
    gate_up = torch.randn(num_experts, 2 * inter, hidden_size, generator=generator)
    down = torch.randn(num_experts, hidden_size, inter, generator=generator)
    calls = []

    def triton_always(rows, weight, bounds, torch_matmul):
        calls.append(tuple(weight.shape))
        return expert_matmul(rows, weight, bounds, TileConfig(block_m=16, block_n=16, block_k=16))

    got = experts_forward(hidden, expert_ids, weights, gate_up, down, grouped=True, kernels=triton_always)
    gathered = experts_forward(hidden, expert_ids, weights, gate_up, down, grouped=False)
    torch.testing.assert_close(got, gathered, atol=1e-4, rtol=1e-4)
    assert calls == [tuple(gate_up.shape), tuple(down.shape)]


@pytest.mark.gpu
def test_the_timed_choice_gives_torchs_grouped_gemm_products_in_bf16():
    from reinforge.rollout.native.moe import _grouped_mm

    counts = torch.randint(0, 64, (128,), generator=torch.Generator().manual_seed(2)).tolist()
    rows, bounds = sorted_rows(counts, inner=2048, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(128, 1536, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    offsets = bounds[1:].contiguous()

    def grouped(rows_: torch.Tensor, weight_: torch.Tensor) -> torch.Tensor:
        return _grouped_mm(rows_, weight_.transpose(1, 2), offs=offsets)

    triton_out, torch_out = expert_matmul(rows, weight, bounds), grouped(rows, weight)
    torch.testing.assert_close(triton_out.float(), torch_out.float(), atol=2e-2, rtol=2e-2)
    choice = ExpertKernelChoice()
    torch.testing.assert_close(choice(rows, weight, bounds, grouped).float(), torch_out.float(), atol=2e-2, rtol=2e-2)
    assert len(choice.picked) == 1 and not choice.failed
    for config in TILE_CONFIGS:
        torch.testing.assert_close(expert_matmul(rows, weight, bounds, config).float(), torch_out.float(),
                                   atol=2e-2, rtol=2e-2)
