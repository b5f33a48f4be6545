"""The soft-capped varlen attention kernels against the padded path, forward and gradients.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) in float32;
the gpu-marked tests run them compiled in bf16 at Gemma 2's shapes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from reinforge.packed_attention import padded_packed_attention  # noqa: E402
from reinforge.packed_attention.softcap_kernels import (  # noqa: E402
    softcap_kernel_runs_on,
    softcap_varlen_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def offsets(lengths: list[int], device: str = DEVICE) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def random_inputs(query_lengths: list[int], key_lengths: list[int], heads: int, kv_heads: int, head_dim: int,
                  seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(query_lengths), heads, head_dim, generator=generator)
    k, v = (torch.randn(sum(key_lengths), kv_heads, head_dim, generator=generator) for _ in range(2))
    return q, k, v, torch.randn(q.shape, generator=generator)


def run(attention, q, k, v, grad_out) -> tuple[torch.Tensor, ...]:
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attention(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out, *(leaf.grad for leaf in leaves)


CASES = [  # (query lengths, key lengths, head dim, window, softcap)
    ([5, 23, 40], [5, 23, 40], 16, None, 2.0),
    ([5, 23, 40], [5, 23, 40], 32, 7, 50.0),
    ([12, 33], [12, 33], 16, 7, 2.0),
    ([5, 23, 40], [9, 23, 52], 16, 7, 2.0),  # shared prompts: more keys than queries, mask aligned to the end
    ([5, 31], [20, 31], 32, None, 50.0),
    ([9, 17, 30], [9, 17, 30], 16, 4, None),  # no cap: the plain windowed softmax
    ([3, 70], [3, 90], 16, 22, 2.0),  # the last query seeing a key block starts a query block
]


@pytest.mark.parametrize("query_lengths,key_lengths,head_dim,window,softcap", CASES)
def test_kernels_equal_the_padded_path_in_float32(query_lengths, key_lengths, head_dim, window, softcap):
    q, k, v, grad_out = (x.to(DEVICE) for x in random_inputs(query_lengths, key_lengths, 4, 2, head_dim))
    cu_q, cu_k = offsets(query_lengths), offsets(key_lengths)
    got = run(lambda q, k, v: softcap_varlen_attention(q, k, v, cu_q, cu_k, max(query_lengths), max(key_lengths),
                                                       0.3, softcap, window), q, k, v, grad_out)
    expected = run(lambda q, k, v: padded_packed_attention(q, k, v, query_lengths, key_lengths, 0.3, window=window,
                                                           softcap=softcap), q, k, v, grad_out)
    for name, value, reference in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(value, reference, atol=1e-5, rtol=1e-5, msg=lambda text, name=name: f"{name}: {text}")


def test_compiled_without_graph_break_matches_eager():
    """The kernels are custom ops with fake implementations: a compiled layer calls them inside its graph."""
    query_lengths, key_lengths = [6, 19], [6, 25]
    q, k, v, grad_out = (x.to(DEVICE) for x in random_inputs(query_lengths, key_lengths, 4, 2, 16, seed=1))
    cu_q, cu_k = offsets(query_lengths), offsets(key_lengths)

    def attention(q, k, v):
        return softcap_varlen_attention(q * 1.0, k, v, cu_q, cu_k, 19, 25, 0.25, 3.0, 9)

    compiled = torch.compile(attention, backend="aot_eager", dynamic=True, fullgraph=True)
    for got, expected in zip(run(compiled, q, k, v, grad_out), run(attention, q, k, v, grad_out), strict=True):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_shapes_that_do_not_fit_name_themselves():
    q, k, v, _ = random_inputs([4], [4], 4, 2, 16)
    with pytest.raises(ValueError, match=r"q \(4, 4, 16\), k \(4, 2, 16\), v \(4, 2, 8\)"):
        softcap_varlen_attention(q, k, v[..., :8], offsets([4], "cpu"), offsets([4], "cpu"), 4, 4, 0.3, 2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 4096, 256])
@pytest.mark.parametrize("shared", [False, True])
def test_bfloat16_at_gemma2_shapes_matches_the_float32_padded_path(window, shared):
    """8 segments of 640 tokens, 8 query heads over 4 KV heads of dim 256, soft-cap 50, as Gemma 2's layers."""
    query_lengths = [640] * 8 if not shared else [512] * 8
    key_lengths = [640] * 8
    q, k, v, grad_out = random_inputs(query_lengths, key_lengths, 8, 4, 256, seed=2)
    scale = 256 ** -0.5
    expected = run(lambda q, k, v: padded_packed_attention(q, k, v, query_lengths, key_lengths, scale,
                                                           window=window, softcap=50.0),
                   *(x.cuda() for x in (q, k, v, grad_out)))
    cu_q, cu_k = offsets(query_lengths, "cuda"), offsets(key_lengths, "cuda")
    got = run(lambda q, k, v: softcap_varlen_attention(q, k, v, cu_q, cu_k, max(query_lengths), 640, scale, 50.0,
                                                       window),
              *(x.cuda().to(torch.bfloat16) for x in (q, k, v)), grad_out.cuda())
    for name, value, reference in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        assert value.dtype == torch.bfloat16 and torch.isfinite(value).all(), name
        error = (value.float() - reference).norm() / reference.norm()
        assert error < 1e-2, f"{name}: relative error {float(error):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_kernels_run_on_the_gpu(head_dim, dtype):
    """Else soft-capped layers fall back to flex attention or the padded path (slow)."""
    assert softcap_kernel_runs_on(torch.device("cuda"), dtype, head_dim)


@pytest.mark.gpu
def test_gemma2_packed_forwards_take_the_kernels_on_the_gpu():
    """The packed forwards of a soft-capped model pass ``packed_softcap_kernel``: its layers skip flex and the
    padded path."""
    from reinforge.engine.forward import _attention_kwargs
    from reinforge.engine.packing import attach_plan, pack_rows
    from reinforge.models.tiny import build_tiny_causal_lm
    from reinforge.protocol import Batch
    from tests.engine.test_packing import grouped_batch

    model = build_tiny_causal_lm("gemma2", vocab_size=64, seed=0)
    micro = attach_plan(Batch(dict(grouped_batch().tensors), {}, {}), share_prompts=True).to(torch.device("cuda"))
    kwargs = _attention_kwargs(pack_rows(micro), torch.bfloat16, model.config)
    assert kwargs.get("packed_softcap_kernel") and not kwargs.get("packed_flex")


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_packed_attention_routes_soft_capped_layers_to_the_kernels(shared, window):
    """``engine.attention.packed_attention`` with ``packed_softcap_kernel``: bf16 near the float32 padded path,
    gradients included."""
    from reinforge.engine.attention import packed_attention

    query_lengths, key_lengths = [5, 9, 3], ([7, 9, 6] if shared else [5, 9, 3])
    q, k, v, grad_out = random_inputs(query_lengths, key_lengths, 4, 2, 32, seed=3)
    kwargs = {"packed_cu_seqlens": offsets(query_lengths, "cuda"), "packed_max_length": max(query_lengths),
              "packed_softcap_kernel": True}
    if shared:
        kwargs |= {"packed_kv_index": torch.arange(sum(key_lengths), device="cuda"),
                   "packed_cu_seqlens_k": offsets(key_lengths, "cuda"), "packed_max_length_k": max(key_lengths)}
    got = run(lambda q, k, v: packed_attention(q, k, v, 0.3, kwargs, window=window, softcap=2.0),
              *(x.cuda().to(torch.bfloat16) for x in (q, k, v)), grad_out.cuda())
    expected = run(lambda q, k, v: padded_packed_attention(q, k, v, query_lengths, key_lengths, 0.3, window=window,
                                                           softcap=2.0), q, k, v, grad_out)
    for name, value, reference in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        error = (value.float().cpu() - reference).norm() / reference.norm()
        assert error < 1e-2, f"{name}: relative error {float(error):.2e}"


def test_a_tiling_the_device_lacks_shared_memory_for_gives_way_to_the_next(monkeypatch):
    """The fastest backward tiling at head dim 256 needs 161 KiB of shared memory; a device with less (sm_86,
    sm_89) takes the next tiling, remembered per device, and the last tiling's failure is raised."""
    from triton.runtime.errors import OutOfResources

    from reinforge.packed_attention import softcap_kernels

    launched = []

    class Kernel:  # stands in for a Triton kernel: the 64-row tiling does not fit this "device"
        def __getitem__(self, grid):
            def launch(*args, BLOCK_M, BLOCK_N, num_warps, num_stages, **constants):
                if BLOCK_M == 64:
                    raise OutOfResources(164352, 101376, "shared memory")
                launched.append((grid, BLOCK_M, BLOCK_N, num_warps, num_stages, args, constants))
            return launch

    kernel, tilings = Kernel(), ((64, 32, 4, 2), (32, 32, 8, 1))
    monkeypatch.setattr(softcap_kernels, "_FITTING", {})
    device = torch.device("cpu")
    softcap_kernels._launch(kernel, tilings, lambda m, n: (640 // m, n), device, "x", GROUP=2)
    assert launched == [((20, 32), 32, 32, 8, 1, ("x",), {"GROUP": 2})]
    assert softcap_kernels._FITTING == {(kernel, None, tilings): 1}
    softcap_kernels._launch(kernel, tilings, lambda m, n: (640 // m, n), device, "y", GROUP=2)
    assert len(launched) == 2  # straight to the tiling that fits
    with pytest.raises(OutOfResources):
        softcap_kernels._launch(kernel, tilings[:1], lambda m, n: (1, 1), device)
