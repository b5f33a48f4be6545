"""engine.rotary: the rotary op against transformers, its gradients, under compile, and its Triton kernel."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding, apply_rotary_pos_emb

from reinforge.engine import rotary
from reinforge.engine.rotary import apply_rotary

Q_HEADS, KV_HEADS = 14, 2  # Qwen2.5-0.5B


def packed_tables(lengths: list[int], dim: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (tokens, dim) of a real Qwen2 rotary embedding, positions restarting with each packed sequence."""
    config = Qwen2Config(hidden_size=Q_HEADS * dim, num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=4096)
    position_ids = torch.cat([torch.arange(length) for length in lengths])[None]
    cos, sin = Qwen2RotaryEmbedding(config)(torch.empty(0, dtype=dtype), position_ids)
    return cos[0], sin[0]


def random_inputs(tokens: int, dim: int, dtype: torch.dtype, seed: int = 0):
    """q, k as non-contiguous views of one fused projection, and unrelated cos/sin halves."""
    generator = torch.Generator().manual_seed(seed)
    fused = torch.randn(tokens, Q_HEADS + 2 * KV_HEADS, dim, generator=generator).to(dtype)
    cos, sin = (torch.randn(tokens, dim, generator=generator).to(dtype) for _ in range(2))
    return fused[:, :Q_HEADS], fused[:, Q_HEADS:Q_HEADS + KV_HEADS], cos, sin


def transformers_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' function in its (1, heads, tokens, dim) layout, back to (tokens, heads, dim)."""
    q_embed, k_embed = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    return q_embed[0].transpose(0, 1), k_embed[0].transpose(0, 1)


@pytest.mark.parametrize("dim", [64, 128])
def test_matches_transformers_at_packed_positions(dim):
    cos, sin = packed_tables([5, 17, 1, 9], dim)
    q, k, _, _ = random_inputs(cos.shape[0], dim, torch.float32)
    got = apply_rotary(q, k, cos, sin)
    for value, expected in zip(got, transformers_rotary(q, k, cos, sin), strict=True):
        assert value.is_contiguous()
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6)
    # cos/sin halves that differ: both halves are used, each in its place
    q, k, cos, sin = random_inputs(11, dim, torch.float32)
    for value, expected in zip(apply_rotary(q, k, cos, sin), transformers_rotary(q, k, cos, sin), strict=True):
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6)


def test_bfloat16_inputs_round_once_from_float32():
    q, k, cos, sin = random_inputs(13, 64, torch.bfloat16)
    got = apply_rotary(q, k, cos, sin)
    expected = apply_rotary(*(x.float() for x in (q, k, cos, sin)))
    for value, reference in zip(got, expected, strict=True):
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, reference.to(torch.bfloat16))


def test_gradients():
    # gradcheck perturbs every element of q and k, forward by forward: 3 tokens of head dim 4 (halves of 2) keep it
    # to a few hundred forwards
    q, k, cos, sin = random_inputs(3, 4, torch.float64)
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda q, k: apply_rotary(q, k, cos, sin), (q, k))
    assert torch.autograd.gradgradcheck(lambda q, k: apply_rotary(q, k, cos, sin), (q, k))
    # only q used: the gradient of k is zero
    q.grad = k.grad = None
    apply_rotary(q, k, cos, sin)[0].sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))


def test_opcheck():
    q, k, cos, sin = random_inputs(6, 16, torch.float32)
    torch.library.opcheck(torch.ops.reinforge.rotary_embedding,
                          (q.clone().requires_grad_(), k.clone().requires_grad_(), cos, sin))
    torch.library.opcheck(torch.ops.reinforge.rotary_embedding_backward, (q.contiguous(), k.contiguous(), cos, sin))


def test_compiled_without_graph_break_matches_eager():
    def loss(q, k, cos, sin):
        q_out, k_out = apply_rotary(q * 2, k, cos, sin)
        return (q_out.square().sum() + (k_out * k_out.detach().flip(0)).sum())

    compiled = torch.compile(loss, backend="aot_eager", dynamic=True, fullgraph=True)
    for tokens in (7, 12):  # a second size reuses the dynamic graph
        q, k, cos, sin = random_inputs(tokens, 16, torch.float32, seed=tokens)
        grads = []
        for fn in (loss, compiled):
            leaves = q.clone().requires_grad_(), k.clone().requires_grad_()
            value = fn(*leaves, cos, sin)
            value.backward()
            grads.append((value.detach(), *(leaf.grad for leaf in leaves)))
        for got, expected in zip(grads[1], grads[0], strict=True):
            torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("dim,tokens", [(64, 37), (128, 5), (64, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_the_pytorch_math(dim, tokens, dtype):
    """Under TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU) the kernel runs on the CPU."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, cos, sin = (x.to(device) for x in random_inputs(tokens, dim, dtype))
    # the interpreter casts float32 to bfloat16 by truncation (the GPU rounds to nearest): one ulp apart at most
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-6)
    for backward in (False, True):
        got = rotary._rotary_triton(q, k, cos, sin, backward)
        expected = rotary._rotary_torch(q, k, cos, sin, backward)
        for value, reference in zip(got, expected, strict=True):
            assert value.dtype == dtype and value.is_contiguous()
            torch.testing.assert_close(value, reference, **tolerance)


@pytest.mark.gpu
def test_cuda_kernel_matches_the_pytorch_path_in_bfloat16():
    cos, sin = (table.cuda() for table in packed_tables([300, 1000, 77], 64, torch.bfloat16))
    q, k, _, _ = (x.cuda() for x in random_inputs(cos.shape[0], 64, torch.bfloat16))
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)

    def run(fn):
        leaves = q.clone().requires_grad_(), k.clone().requires_grad_()
        q_out, k_out = fn(*leaves, cos, sin)
        torch.autograd.backward((q_out, k_out), (grad_q, grad_k))
        return q_out, k_out, *(leaf.grad for leaf in leaves)

    reference = run(lambda q, k, cos, sin: rotary._rotary_torch(q, k, cos, sin, backward=False))
    compiled = torch.compile(apply_rotary, dynamic=True, fullgraph=True)
    for fn in (apply_rotary, compiled):
        for got, expected in zip(run(fn), reference, strict=True):
            torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-6)
