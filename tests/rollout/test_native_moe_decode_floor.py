"""The MoE layers of a Qwen3-30B-A3B decode step against the weight-read floor (GPU; prints its numbers).

A decode step of B sequences sends 8 B (token, expert) assignments to 128 experts (about 32 each at 512
sequences, 8 at 128), so every expert's weights are read (a smaller step may leave an expert unpicked: its bytes
are left out): the floor of the step's 48 expert layers is those bytes (57 GiB in bf16 at 512) over the rate a
copy reaches on the device the test runs on (a 1 GiB device-to-device clone, its bytes read and written per
second, as ``bench.floor.COPY_BYTES_PER_S`` counts the H200's 4.19 TB/s), so the share means the same on any GPU.
The layers run as the engine's decode graph runs them (router, sort by expert, the expert kernels, weighting and
sum), captured in one CUDA graph over four layers' distinct weights (no layer's weights are in L2 when it runs),
replayed and timed: once with torch's grouped GEMM alone, once with the kernels the engine picks
(``moe_choice.ExpertKernelChoice``), at 128, 256 and 512 sequences. Each line gives the step's milliseconds, the
weight bytes read per second and the share of the floor's speed, then what the choice timed for one layer of that
shape (on assignments spread over the experts).
Run: ``pytest -q -s -m gpu tests/rollout/test_native_moe_decode_floor.py``.
"""

from __future__ import annotations

import pytest
import torch

from reinforge.bench.shapes import shape_config
from reinforge.models.architectures import architecture_spec
from reinforge.rollout.native.moe import experts_forward, grouped_mm_applies, route

TARGET_FRACTION = 0.7
"""The rollout's target at the standard workload (512 sequences): at least 70% of the weight-read floor's speed."""

SEQUENCES = (128, 256, 512)


@pytest.mark.gpu
def test_the_30b_a3b_expert_layers_of_a_decode_step_run_near_the_weight_read_floor():
    from transformers import AutoConfig

    from reinforge.rollout.native import triton_kernels
    from reinforge.rollout.native.moe_choice import ExpertKernelChoice

    keys = shape_config("qwen3-30b-a3b")
    config = AutoConfig.for_model(keys.pop("model_type"), **keys)
    spec = architecture_spec(config).moe
    hidden, inter, num_experts = config.hidden_size, config.moe_intermediate_size, config.num_experts
    num_layers, distinct = config.num_hidden_layers, 4
    generator = torch.Generator(device="cuda").manual_seed(0)

    def weights(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02

    layers = [(weights(num_experts, hidden), weights(num_experts, 2 * inter, hidden),
               weights(num_experts, hidden, inter)) for _ in range(distinct)]
    choice = ExpertKernelChoice()  # one per process, as the engine's
    copy_bytes_per_s = device_copy_bytes_per_s()
    fractions = {}
    for num_sequences in SEQUENCES:
        x = torch.randn(num_sequences, hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
        assert grouped_mm_applies(x)
        used = [route(x, router, None, spec, deepseek=False)[1].unique().numel() for router, _, _ in layers]
        if num_sequences == 512:  # every expert is read: the target's floor counts all of them
            assert used == [num_experts] * distinct, used
        # the bytes the step must read: each layer's router and the experts its tokens picked
        step_bytes = sum(layers[index % distinct][0].nbytes + sum(tensor.nbytes for tensor in layers[0][1:])
                         * used[index % distinct] / num_experts for index in range(num_layers))
        floor_ms = step_bytes / copy_bytes_per_s * 1e3

        def step(kernels: ExpertKernelChoice | None, x: torch.Tensor = x) -> torch.Tensor:
            """Every layer routes the same hidden states (random weights would shrink a chained stream towards
            ties, which send every token to the same experts); their outputs are summed as the residual is."""
            residual = torch.zeros_like(x)
            for index in range(num_layers):
                router, gate_up, down = layers[index % distinct]
                routing_weights, expert_ids = route(x, router, None, spec, deepseek=False)
                residual += experts_forward(x, expert_ids, routing_weights, gate_up, down,
                                            activate=triton_kernels.act_and_mul, kernels=kernels)
            return residual

        torch_ms, torch_out = timed_graph(lambda: step(None))
        step_ms, step_out = timed_graph(lambda: step(choice))  # what the engine runs
        torch.testing.assert_close(step_out.float(), torch_out.float(), atol=5e-2, rtol=5e-2)
        fractions[num_sequences] = floor_ms / step_ms
        (key,) = [key for key in choice.picked if key[0] == num_sequences * spec.top_k]  # a power of two
        print(f"\nQwen3-30B-A3B expert layers of one decode step, {num_sequences} sequences (top-{spec.top_k} of "
              f"{num_experts}, {min(used)} to {max(used)} experts picked a layer, {num_layers} layers, "
              f"{step_bytes / 2**30:.1f} GiB of weights read): "
              f"{step_ms:.2f} ms, {step_bytes / step_ms / 1e6:.0f} GB/s, "
              f"{fractions[num_sequences]:.0%} of the floor with the engine's kernels "
              f"({choice.picked.get(key) or 'torch'}); {torch_ms:.2f} ms, {floor_ms / torch_ms:.0%} with torch's "
              f"grouped GEMM alone; floor {floor_ms:.2f} ms at {copy_bytes_per_s / 1e12:.2f} TB/s (this device's "
              "copy rate)")
        expert_bytes = {"swapped gate_up": layers[0][1].nbytes, "swapped down": layers[0][2].nbytes}
        for name, milliseconds in sorted(choice.timings.get(key, {}).items(), key=lambda item: item[1]):
            read = next((size for prefix, size in expert_bytes.items() if name.startswith(prefix)),
                        layers[0][1].nbytes + layers[0][2].nbytes)  # a product alone, or both
            print(f"  one layer's experts, {name}: {milliseconds:.3f} ms, "
                  f"{read / milliseconds / 1e9:.2f} TB/s of expert weights")
        if choice.failed:
            print(f"  dropped: {', '.join(sorted(choice.failed))}")
    assert fractions[512] >= TARGET_FRACTION, (f"the expert layers of 512 sequences run at {fractions[512]:.0%} of "
                                               f"the floor's speed (target {TARGET_FRACTION:.0%})")


def device_copy_bytes_per_s() -> float:
    """The bytes a device-to-device clone of 1 GiB reads and writes per second on this GPU."""
    source = torch.ones(2**30, dtype=torch.uint8, device="cuda")
    milliseconds, _ = timed_graph(source.clone)
    return 2 * source.nbytes / milliseconds * 1e3


def timed_graph(step, replays: int = 20) -> tuple[float, torch.Tensor]:
    """Milliseconds per replay of ``step`` captured in a CUDA graph (after an eager warm-up, where Triton compiles,
    cuBLAS and CUTLASS pick their kernels and the choice times its candidates), and the captured output."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays, out
