"""The decode step's gated-MLP kernels (rollout/native/dense_kernels.py) and their timed choice against cuBLAS
(dense_choice.py): Triton's interpreter on the CPU, the device's kernels and timings on the GPU.

Run the GPU ones with ``pytest -q -s -m gpu tests/rollout/native/test_dense_mlp.py`` (the floor test prints its
numbers)."""

from __future__ import annotations

import dataclasses
import itertools
import logging

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from compiled_outside_interpreter import compile_report  # noqa: E402  (tests/: conftest.py)

from reinforge.rollout.native import dense_choice, dense_kernels  # noqa: E402
from reinforge.rollout.native.dense_choice import DenseMLPChoice, cublas_mlp  # noqa: E402
from reinforge.rollout.native.dense_kernels import DenseKernels, DenseTiles, MLPWeights  # noqa: E402

REFERENCE_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def mlp_weights(hidden: int, inter: int, bias: bool, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> MLPWeights:
    generator = torch.Generator().manual_seed(seed)

    def values(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

    return MLPWeights(values(2 * inter, hidden), values(2 * inter) if bias else None, values(hidden, inter),
                      values(hidden) if bias else None)


def linear_mlp(x: torch.Tensor, weights: MLPWeights, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(gate) * up and the MLP's output by F.linear, in float64."""
    x, weights = x.double(), MLPWeights(*(None if weight is None else weight.double() for weight in weights))
    gate, up = F.linear(x, weights.gate_up, weights.gate_up_bias).chunk(2, dim=-1)
    activated = REFERENCE_ACTIVATIONS[activation](gate) * up
    return activated, F.linear(activated, weights.down, weights.down_bias)


CASES = [  # rows, bias, activation, tiling (gate|up and down), down's K split
    (1, False, "silu", DenseTiles(block_t=16, block_n=16, block_k=16), 1),
    (1, True, "gelu_tanh", DenseTiles(block_t=16, block_n=16, block_k=16, weight_tma=True), 3),
    (7, True, "silu", DenseTiles(block_t=16, block_n=32, block_k=32), 2),
    (7, False, "gelu_tanh", DenseTiles(block_t=16, block_n=16, block_k=16), 4),
    (32, False, "silu", DenseTiles(block_t=32, block_n=16, block_k=16, weight_tma=True), 1),
    (32, True, "gelu_tanh", DenseTiles(block_t=16, block_n=16, block_k=16), 3),
    (129, True, "silu", DenseTiles(block_t=64, block_n=32, block_k=32), 2),
    (129, False, "gelu_tanh", DenseTiles(block_t=64, block_n=32, block_k=32, weight_tma=True), 1),
]


@pytest.mark.parametrize(("rows", "bias", "activation", "tiles", "split"), CASES,
                         ids=[f"{rows}rows-{'bias' if bias else 'nobias'}-{activation}-{'tma' if tiles.weight_tma else 'ptr'}"
                              f"-split{split}" for rows, bias, activation, tiles, split in CASES])
def test_the_kernels_equal_the_linear_mlp_in_float32(rows, bias, activation, tiles, split):
    """gate|up with the biases and activation, then down split along K or not, against F.linear in float64: rows
    below, at and past a block, hidden (48) and inter (40) not multiples of the blocks (the last K split shorter,
    a TMA read zero-filling past the inner size, gate columns past inter reading up rows no output keeps)."""
    weights = mlp_weights(hidden=48, inter=40, bias=bias, seed=rows)
    x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(100 + rows))
    expected_activated, expected = linear_mlp(x, weights, activation)
    activated = dense_kernels.gate_up_act(x, weights.gate_up, weights.gate_up_bias, activation, tiles)
    torch.testing.assert_close(activated.double(), expected_activated, atol=1e-5, rtol=1e-5)
    out = dense_kernels.down(activated, weights.down, weights.down_bias, dataclasses.replace(tiles, split_k=split))
    assert out.shape == (rows, 48) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_the_bf16_kernels_round_as_cublas_and_the_activation_kernel_do():
    """In bf16 each product is summed in float32 and rounded once after its bias, the activation and the product
    with up each rounded (as cuBLAS and ``act_and_mul`` round them on the GPU), and the split down product's float32
    partial sums added before its one rounding: the kernels give those numbers, a value differing by at most one bf16
    step where float32 sums in another order round the other way."""
    weights = mlp_weights(hidden=64, inter=48, bias=True, seed=5, dtype=torch.bfloat16)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    tiles = DenseTiles(block_t=16, block_n=16, block_k=32, split_k=2)
    gate, up = (F.linear(x.float(), weights.gate_up.float()) + weights.gate_up_bias.float()).bfloat16().chunk(2, -1)
    expected_activated = (F.silu(gate.float()).bfloat16().float() * up.float()).bfloat16()
    activated = dense_kernels.gate_up_act(x, weights.gate_up, weights.gate_up_bias, "silu", tiles)
    assert activated.dtype == torch.bfloat16
    torch.testing.assert_close(activated, expected_activated, atol=0, rtol=2 ** -7)
    assert (activated == expected_activated).float().mean() > 0.95
    expected = (F.linear(activated.float(), weights.down.float()) + weights.down_bias.float()).bfloat16()
    got = dense_kernels.down(activated, weights.down, weights.down_bias, tiles)
    torch.testing.assert_close(got, expected, atol=0, rtol=2 ** -7)
    assert (got == expected).float().mean() > 0.95


def stub_times_later_candidates_faster(monkeypatch) -> None:
    """Timings stubbed (no GPU here): each run is timed faster than the one before, so cuBLAS (timed first for each
    product and for the MLP) loses to every tiling that runs and equals it."""
    counter = itertools.count()
    monkeypatch.setattr(DenseMLPChoice, "_time", lambda self, run: (run(), 1000.0 - next(counter))[1])


def test_the_choice_keeps_the_fastest_tilings_and_drops_failing_or_wrong_ones(monkeypatch, caplog):
    """A tiling that fails to run and one whose output is wrong are each dropped in one line; the rest are timed and
    the fastest runs the layer, giving the MLP's numbers."""
    weights = mlp_weights(hidden=32, inter=32, bias=False, seed=7)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(8))
    good, broken, wrong = (DenseTiles(block_t=16, block_n=16, block_k=16), DenseTiles(block_t=16, block_n=16,
                           block_k=16, num_warps=2), DenseTiles(block_t=16, block_n=32, block_k=16))
    real_gate_up, real_down = dense_kernels.gate_up_act, dense_kernels.down

    def gate_up_or_fail(x, gate_up, bias, activation, tiles):
        if tiles == broken:
            raise RuntimeError("out of resources: shared memory\nsecond line")
        return real_gate_up(x, gate_up, bias, activation, tiles)

    def down_or_wrong(x, weight, bias, tiles):
        return real_down(x, weight, bias, tiles) + (1.0 if tiles.block_n == 32 else 0.0)

    monkeypatch.setattr(dense_kernels, "gate_up_act", gate_up_or_fail)
    monkeypatch.setattr(dense_kernels, "down", down_or_wrong)
    stub_times_later_candidates_faster(monkeypatch)
    choice = DenseMLPChoice(gate_up_tiles=(good, broken), down_tiles=(wrong, good), min_weight_bytes=0)
    with caplog.at_level(logging.INFO, logger=dense_choice.__name__):
        got = choice(x, weights, "silu")
    (picked,) = choice.picked.values()
    good_split = dataclasses.replace(good, split_k=2)  # down splits of 1 and 2 (two K blocks), the last timed fastest
    assert picked == DenseKernels(good, good_split)
    wrong_split = dataclasses.replace(wrong, split_k=2)
    assert choice.failed == {f"gate|up {broken}", f"down {wrong}", f"down {wrong_split}"}
    dropped = [record.getMessage() for record in caplog.records if "dropped" in record.getMessage()]
    assert len(dropped) == 3 and all("\n" not in line for line in dropped)
    assert "out of resources: shared memory" in dropped[0]
    assert all("differs from cuBLAS's" in line for line in dropped[1:])
    torch.testing.assert_close(got.double(), linear_mlp(x, weights, "silu")[1], atol=1e-5, rtol=1e-5)


def test_the_choice_runs_cublas_when_every_candidate_raises(monkeypatch, caplog):
    weights = mlp_weights(hidden=32, inter=32, bias=True, seed=9)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(10))

    def fail(*args):
        raise RuntimeError("PTXAS error")

    monkeypatch.setattr(dense_kernels, "gate_up_act", fail)
    monkeypatch.setattr(dense_kernels, "down", fail)
    stub_times_later_candidates_faster(monkeypatch)
    tiles = (DenseTiles(block_t=16, block_n=16, block_k=16),)
    choice = DenseMLPChoice(gate_up_tiles=tiles, down_tiles=tiles, min_weight_bytes=0)
    with caplog.at_level(logging.INFO, logger=dense_choice.__name__):
        got = choice(x, weights, "gelu_tanh")
    assert list(choice.picked.values()) == [None]
    assert "running cuBLAS" in caplog.records[-1].getMessage()
    torch.testing.assert_close(got, cublas_mlp(x, weights, "gelu_tanh"))


def test_the_choice_keeps_cublas_for_a_product_no_tiling_beats():
    """Timings as given: the down tilings lose to cuBLAS, the gate|up one wins; the MLP then runs the Triton gate|up
    and cuBLAS's down, the pair timed faster than cuBLAS's MLP."""
    weights = mlp_weights(hidden=32, inter=32, bias=False, seed=11)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(12))
    tiles = DenseTiles(block_t=16, block_n=16, block_k=16)
    times = iter([2.0, 1.0,  # gate|up: cuBLAS, the tiling
                  1.0, 3.0, 3.0,  # down: cuBLAS, the tiling unsplit and split in two
                  2.5, 2.0])  # the MLP: cuBLAS's, then the pair's

    class Timed(DenseMLPChoice):
        def _time(self, run):
            run()
            return next(times)

    choice = Timed(gate_up_tiles=(tiles,), down_tiles=(tiles,), min_weight_bytes=0)
    got = choice(x, weights, "silu")
    assert choice.picked == {choice.key(x, weights, "silu"): DenseKernels(tiles, None)}
    assert next(times, None) is None
    torch.testing.assert_close(got.double(), linear_mlp(x, weights, "silu")[1], atol=1e-5, rtol=1e-5)


def test_a_layer_whose_weights_lie_otherwise_is_timed_apart(monkeypatch):
    """Two layers of one shape, the second's down weight a transposed view (rows not contiguous, as no kernel reads
    them): the second gets its own pick, cuBLAS's down, instead of the first's kernels; no tiling is dropped, so the
    first layer's layout keeps its kernels."""
    stub_times_later_candidates_faster(monkeypatch)
    tiles = (DenseTiles(block_t=16, block_n=16, block_k=16),)
    choice = DenseMLPChoice(gate_up_tiles=tiles, down_tiles=tiles, min_weight_bytes=0)
    first = mlp_weights(hidden=32, inter=32, bias=False, seed=15)
    second = first._replace(down=first.down.T.contiguous().T)
    assert second.down.stride(-1) != 1
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(16))
    for weights in (first, second):
        torch.testing.assert_close(choice(x, weights, "silu").double(), linear_mlp(x, weights, "silu")[1], atol=1e-5,
                                   rtol=1e-5)
    assert choice.picked[choice.key(x, first, "silu")] == DenseKernels(tiles[0], dataclasses.replace(tiles[0],
                                                                                                    split_k=2))
    assert choice.picked[choice.key(x, second, "silu")] == DenseKernels(tiles[0], None)
    assert not choice.failed


def test_prefill_sized_and_small_mlps_run_cublas_untimed(monkeypatch):
    """More rows than ``max_rows`` (a prefill) or weights lighter than ``min_weight_bytes`` (tiny test models)
    compile and time nothing."""
    monkeypatch.setattr(DenseMLPChoice, "_time", lambda self, run: pytest.fail("timed an MLP outside the bounds"))
    weights = mlp_weights(hidden=32, inter=32, bias=False, seed=13)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(14))
    for choice in (DenseMLPChoice(max_rows=8, min_weight_bytes=0), DenseMLPChoice()):
        torch.testing.assert_close(choice(x, weights, "silu"), cublas_mlp(x, weights, "silu"))
        assert not choice.picked and not choice.timings


def test_a_single_product_runs_the_fastest_down_tiling_or_cublas(monkeypatch):
    """``linear`` (the attention's q|k|v and o products): the tiling timed fastest, at its K split, gives F.linear's
    numbers with the bias; a product lighter than ``min_linear_bytes`` runs cuBLAS untimed."""
    stub_times_later_candidates_faster(monkeypatch)
    tiles = DenseTiles(block_t=16, block_n=16, block_k=16)
    choice = DenseMLPChoice(down_tiles=(tiles,), min_linear_bytes=0)
    generator = torch.Generator().manual_seed(17)
    weight, bias = torch.randn(40, 48, generator=generator), torch.randn(40, generator=generator)
    x = torch.randn(6, 48, generator=generator)
    torch.testing.assert_close(choice.linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    assert list(choice.picked.values()) == [dataclasses.replace(tiles, split_k=3)]  # 3 K blocks: splits 1 to 3
    untimed = DenseMLPChoice(down_tiles=(tiles,))
    torch.testing.assert_close(untimed.linear(x, weight, bias), F.linear(x, weight, bias))
    assert not untimed.picked


def test_the_down_splits_fill_the_sms():
    """The 1.5B down product (1536 columns, 8960 inner) at 128 rows in blocks of 64 x 64: 48 output blocks, so
    splits of 2, 3, 5 and 11 give 96, 144, 240 and 528 programs for 132 SMs (at most one, two and four an SM, and
    one wave and a bit)."""
    tiles = DenseTiles(block_t=64, block_n=64, block_k=128)
    assert dense_choice.down_splits(tiles, 128, 1536, 8960, 132) == [1, 2, 3, 5, 11]
    assert dense_choice.down_splits(tiles, 128, 1536, 256, 132) == [1, 2]  # at most one K block a program
    assert dense_choice.down_splits(tiles, 256, 8192, 8192, 132) == [1]  # 512 output blocks: no split
    assert [tile.block_t for tile in dense_choice.candidate_tiles(dense_choice.DOWN_TILES, 7)] \
        == [16] * len([tile for tile in dense_choice.DOWN_TILES if tile.block_t == 16])


def test_the_decoder_marks_decode_steps_for_the_mlp_and_prefill_steps_not(tiny, monkeypatch):
    """What the choice keys on: the decoder tells each MLP block whether it runs a decode step (one token a sequence)
    or a prefill, so prefills keep cuBLAS's products."""
    from reinforge.rollout.base import GenerationRequest, SamplingParams
    from reinforge.rollout.native import NativeEngine
    from reinforge.rollout.native.layers import DenseMLP

    calls = []
    forward = DenseMLP.forward

    def recording(self, weights, x, decode=False):
        calls.append((x.shape[0], decode))
        return forward(self, weights, x, decode)

    monkeypatch.setattr(DenseMLP, "forward", recording)
    model = tiny.build("qwen2")
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=8, max_num_seqs=4)
    engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=3, temperature=0.0))
                     for prompt in tiny.prompts([5, 9])])
    assert (14, False) in calls  # both prompts in one prefill, each layer
    assert (2, True) in calls  # both sequences in a decode step
    assert {decode for rows, decode in calls if rows == 14} == {False}


@pytest.mark.parametrize("decode_products", ["cublas", "timed"])
def test_the_timed_products_serve_the_decoder_only_when_asked(tiny, decode_products):
    """rollout.decode_products: cublas (the default) leaves every product to torch; timed gives each dense MLP and
    attention block the process's choice; another value is refused naming the key."""
    from reinforge.rollout.native.model import PagedDecoder

    model = tiny.build("qwen2")
    decoder = PagedDecoder(model, 64, use_triton=True, device=torch.device("cpu"), decode_products=decode_products)
    chosen = [block.kernels for block in decoder.mlps] + [block.products for block in decoder.attention]
    if decode_products == "timed":
        assert all(choice is dense_choice.dense_mlp_choice() for choice in chosen)
    else:
        assert all(choice is None for choice in chosen)
    assert PagedDecoder(model, 64, use_triton=True, device=torch.device("cpu")).context.timed_products is False
    with pytest.raises(ValueError, match="rollout.decode_products"):
        PagedDecoder(model, 64, use_triton=True, device=torch.device("cpu"), decode_products="fast")


HOPPER_COMPILE = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from reinforge.rollout.native import dense_choice, dense_kernels

KERNELS = {  # the Qwen2.5-1.5B MLP in bf16 (down split in three), as the launchers pass them
    "gate_up": (dense_kernels._gate_up_act_kernel, 1536, dict(
        x_ptr="*bf16", weight_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", num_rows="i32", stride_x="i32",
        stride_w="i32", stride_out="i32", inter="i32"), dict(HAS_BIAS=False, ACTIVATION=0, EVEN_K=True),
        dense_choice.GATE_UP_TILES),
    "down": (dense_kernels._down_kernel, 8960, dict(
        x_ptr="*bf16", weight_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", partial_ptr="*fp32", num_rows="i32",
        stride_x="i32", stride_w="i32", stride_out="i32", num_cols="i32", blocks_per_split="i32", num_splits="i32"),
        dict(HAS_BIAS=False, STATIC_BLOCKS_PER_SPLIT=0), dense_choice.DOWN_TILES),
}
results = []
for product, (kernel, inner, arguments, extra, tilings) in KERNELS.items():
    for tiles in tilings:
        signature = {name: "constexpr" for name in kernel.arg_names} | arguments
        if tiles.weight_tma:
            signature["weight_ptr"] = f"tensordesc<bf16[{tiles.block_n}, {tiles.block_k}]>"
        constants = dict(NUM_INNER=inner, BLOCK_T=tiles.block_t, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                         WEIGHT_TMA=tiles.weight_tma, PRECISION="tf32", UPCAST=False) | extra
        aligned = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in arguments.items()
                   if signature[name] == kind and name not in ("num_rows", "blocks_per_split", "num_splits")}
        source = ASTSource(fn=kernel, signature=signature, attrs=aligned,
                           constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
        ttgir = compiled.asm["ttgir"]
        results.append(dict(product=product, tiles=str(tiles), shared=compiled.metadata.shared,
                            async_copies=ttgir.count("async_copy_global_to_local"),
                            tma_copies=ttgir.count("async_tma_copy")))
print(json.dumps(results))
"""


@pytest.mark.slow
def test_every_dense_tiling_compiles_for_hopper_with_its_weight_loads_pipelined():
    """Each tiling of both products compiled for sm_90 (no GPU needed; Triton's own ptxas), outside the interpreter:
    the weight loads run as asynchronous copies (TMA for the TMA tilings) in num_stages buffers, and the shared
    memory fits an H100/H200 SM (227 KiB)."""
    results = compile_report(HOPPER_COMPILE)
    tilings = [*dense_choice.GATE_UP_TILES, *dense_choice.DOWN_TILES]
    for result, tiles in zip(results, tilings, strict=True):
        assert result["shared"] <= 227 * 1024, result
        pipelined = result["tma_copies"] if tiles.weight_tma else result["async_copies"]
        assert pipelined >= tiles.num_stages - 1, result


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_every_tiling_gives_cublas_products_in_bf16(bias):
    """Every tiling of both products (TMA ones included, down at each of its K splits) on the 1.5B MLP shape at 1, 7,
    32, 129 and 256 rows, against cuBLAS and ``act_and_mul``, with and without biases, SiLU and GELU-tanh."""
    hidden, inter = 1536, 8960
    weights = mlp_weights(hidden, inter, bias=bias, seed=1, dtype=torch.bfloat16, device="cuda")
    weights = MLPWeights(weights.gate_up * 0.1, weights.gate_up_bias, weights.down * 0.1, weights.down_bias)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for rows, activation in zip((1, 7, 32, 129, 256), ("silu", "gelu_tanh") * 3, strict=False):
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        activated = dense_choice.triton_kernels.act_and_mul(F.linear(x, weights.gate_up, weights.gate_up_bias),
                                                            activation)
        expected = F.linear(activated, weights.down, weights.down_bias)
        for tiles in dense_choice.GATE_UP_TILES:
            got = dense_kernels.gate_up_act(x, weights.gate_up, weights.gate_up_bias, activation, tiles)
            torch.testing.assert_close(got.float(), activated.float(), atol=2e-2, rtol=2e-2,
                                       msg=lambda text, tiles=tiles, rows=rows: f"{rows} rows, {tiles}: {text}")
        for tiles in dense_choice.DOWN_TILES:
            for split in dense_choice.down_splits(tiles, rows, hidden, inter, num_sms):
                split_tiles = dataclasses.replace(tiles, split_k=split)
                got = dense_kernels.down(activated, weights.down, weights.down_bias, split_tiles)
                torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2,
                                           msg=lambda text, tiles=split_tiles, rows=rows: f"{rows} rows, {tiles}: "
                                                                                          f"{text}")


@pytest.mark.gpu
def test_greedy_tokens_are_the_same_with_the_dense_kernels_on_and_off(tiny, monkeypatch):
    """A tiny model in float32 decodes the same tokens with the Triton MLP, q|k|v and o kernels (forced: every tiling
    that runs is timed faster than cuBLAS) as with cuBLAS alone, CUDA graphs on."""
    from reinforge.rollout.base import GenerationRequest, SamplingParams
    from reinforge.rollout.native import NativeEngine

    model = tiny.build("qwen2", device="cuda")
    prompts = tiny.prompts([3, 17, 40, 5])
    results = {}
    for name, choice in (("off", DenseMLPChoice(max_rows=0)),
                         ("on", DenseMLPChoice(min_weight_bytes=0, min_linear_bytes=0))):
        monkeypatch.setattr(dense_choice, "_DENSE_KERNELS", [choice])
        if name == "on":
            stub_times_later_candidates_faster(monkeypatch)
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=128, max_num_seqs=16, decode_products="timed")
        completions = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=24, temperature=0.0, n=2))
                                       for prompt in prompts])
        results[name] = [[sample.token_ids for sample in samples] for samples in completions]
        engine.sleep()
        if name == "on":
            assert choice.picked and all(kernels is not None for kernels in choice.picked.values()), choice.timings
            assert any(key[0] == "linear" for key in choice.picked)
        else:
            assert not choice.picked
    assert results["on"] == results["off"]


def graph_milliseconds(run_layer, num_layers: int) -> float:
    """Milliseconds a layer of ``run_layer(index)`` over ``num_layers`` layers captured in one CUDA graph, replayed."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for index in range(num_layers):
            run_layer(index)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 5 / num_layers


def fastest_timings(timings: dict[str, float], per_product: int = 3) -> str:
    """cuBLAS's timings and the ``per_product`` fastest tilings of each product, as one line."""
    kept = {name: ms for name, ms in timings.items() if "cuBLAS" in name or name.endswith(" MLP")}
    for product in ("gate|up", "down", "linear"):
        tilings = sorted((ms, name) for name, ms in timings.items() if name.startswith(product + " t"))
        kept |= {name: ms for ms, name in tilings[:per_product]}
    return ", ".join(f"{name} {ms:.4f}" for name, ms in kept.items())


SEQUENCES = (1, 8, 16, 32, 64, 128, 192, 256)


@pytest.mark.gpu
def test_the_15b_mlp_of_a_decode_step_against_cublas_and_the_weight_read_floor():
    """The Qwen2.5-1.5B MLP (hidden 1536, inter 8960, bf16) of a decode step at 1 to 256 sequences: 28 layers over
    four distinct weight sets captured in one CUDA graph (no layer's weights in L2 when it runs), replayed and timed
    with cuBLAS and with the choice's kernels. Prints per batch the milliseconds a layer, the share of the
    weight-read floor's speed (``bench.floor.COPY_BYTES_PER_S``) and the picked kernels, then what the choice timed
    (cuBLAS and the three fastest tilings of each product); asserts the choice's numbers are cuBLAS's within bf16
    rounding and never slower than cuBLAS by more than timing noise."""
    from reinforge.bench.floor import COPY_BYTES_PER_S

    hidden, inter, num_layers, distinct = 1536, 8960, 28, 4
    layers = [mlp_weights(hidden, inter, bias=False, seed=seed, dtype=torch.bfloat16, device="cuda")
              for seed in range(distinct)]
    layers = [MLPWeights(w.gate_up * 0.1, None, w.down * 0.1, None) for w in layers]
    layer_bytes = sum(weight.nbytes for weight in layers[0] if weight is not None)
    floor_ms = layer_bytes / COPY_BYTES_PER_S * 1e3
    choice = DenseMLPChoice()
    lines = []
    for rows in SEQUENCES:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        expected = cublas_mlp(x, layers[0], "silu")
        got = choice(x, layers[0], "silu")
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
        cublas_ms, chosen_ms = (graph_milliseconds(lambda index, run=run, x=x: run(x, layers[index % distinct], "silu"),
                                                   num_layers) for run in (cublas_mlp, choice))
        picked = choice.picked[choice.key(x, layers[0], "silu")]
        lines.append(timing_line(f"{rows:4d} rows", cublas_ms, chosen_ms, floor_ms, picked))
        assert chosen_ms <= cublas_ms * 1.1, lines[-1]
    print("\nMLP a layer\n" + "\n".join(lines))
    for key, timings in choice.timings.items():
        print(key[0], "rows:", fastest_timings(timings))


def timing_line(label: str, cublas_ms: float, chosen_ms: float, floor_ms: float, picked) -> str:
    """One line of a GPU timing test: cuBLAS and the choice against the weight-read floor, and what the choice runs."""
    return (f"{label}: cuBLAS {cublas_ms:.4f} ms ({floor_ms / cublas_ms:.0%} of floor speed), chosen {chosen_ms:.4f} "
            f"ms ({floor_ms / chosen_ms:.0%}); floor {floor_ms:.4f} ms; running {picked or 'cuBLAS'}")


@pytest.mark.gpu
def test_the_15b_attention_products_of_a_decode_step_against_cublas_and_the_weight_read_floor():
    """The Qwen2.5-1.5B q|k|v (2048 x 1536, with its bias) and o (1536 x 1536) products of a decode step at 1 to 256
    sequences, as the MLP test times them: per batch and product the milliseconds a layer with cuBLAS and with the
    choice's pick (``DenseMLPChoice.linear``), beside the weight-read floor."""
    from reinforge.bench.floor import COPY_BYTES_PER_S

    num_layers, distinct = 28, 8
    generator = torch.Generator(device="cuda").manual_seed(0)
    products = {name: [(torch.randn(cols, 1536, device="cuda", generator=generator).bfloat16() * 0.02,
                        torch.randn(cols, device="cuda", generator=generator).bfloat16() if bias else None)
                       for _ in range(distinct)] for name, cols, bias in (("qkv", 2048, True), ("o", 1536, False))}
    choice = DenseMLPChoice()
    lines = []
    for rows in SEQUENCES:
        x = torch.randn(rows, 1536, device="cuda", dtype=torch.bfloat16)
        for name, weights in products.items():
            floor_ms = weights[0][0].nbytes / COPY_BYTES_PER_S * 1e3
            torch.testing.assert_close(choice.linear(x, *weights[0]).float(), F.linear(x, *weights[0]).float(),
                                       atol=2e-2, rtol=2e-2)
            cublas_ms, chosen_ms = (graph_milliseconds(
                lambda index, run=run, x=x, weights=weights: run(x, *weights[index % distinct]), num_layers)
                for run in (F.linear, choice.linear))
            picked = choice.linear_tiles_for(x, *weights[0])
            lines.append(timing_line(f"{rows:4d} rows, {name}", cublas_ms, chosen_ms, floor_ms, picked))
            assert chosen_ms <= cublas_ms * 1.1, lines[-1]
    print("\nattention products a layer\n" + "\n".join(lines))
    for key, timings in choice.timings.items():
        print(key[1], "rows", key[2:4], ":", fastest_timings(timings))
