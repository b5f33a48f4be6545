"""The Triton kernels against PyTorch references: compiled on a GPU, else in Triton's interpreter on the CPU.

tests/conftest.py sets TRITON_INTERPRET=1 without a GPU; the module is skipped without Triton.

Each kernel is checked against an independent reference (transformers' own functions where it has them), and
the engine on the Triton path against ``generate``. bf16 arithmetic runs only on the GPU (see BFLOAT16_ON_GPU).

The sampler's reference recomputes the kernels' noise (lowbias32 of each column under a key from
the sample seed and position), so these tests also pin that noise: changing it changes samples.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from reinforge.rollout.base import GenerationRequest, SamplingParams  # noqa: E402
from reinforge.rollout.native import NativeEngine, triton_kernels  # noqa: E402
from reinforge.rollout.native.sampling import Sampler, SamplingTensors, truncation_thresholds  # noqa: E402
from reinforge.rollout.noise import gumbel_noise, noise_keys  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPLIT_LAYOUTS = [dict(), dict(block_v=64, blocks_per_split=3), dict(block_v=128, blocks_per_split=1)]
"""The default layout (one split at these vocabulary sizes), several splits with a ragged last one, one block each."""

_MASK = np.uint64(0xFFFFFFFF)
BFLOAT16_ON_GPU = pytest.param(torch.bfloat16, marks=pytest.mark.gpu)
"""bf16 arithmetic inside a kernel runs on the GPU only: Triton's interpreter multiplies bf16 values as their raw
bits and truncates casts to bf16 (loading bf16 and computing in float32 runs under it)."""


def _lowbias32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x7FEB352D)) & _MASK
    h = h ^ (h >> np.uint64(15))
    h = (h * np.uint64(0x846CA68B)) & _MASK
    return h ^ (h >> np.uint64(16))


def reference_gumbel(sample_seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The kernels' Gumbel noise (rows, vocab) float32, from integer hashes of (seed, position) and column."""
    mixed = (sample_seeds.cpu().numpy().astype(np.uint64)
             + positions.cpu().numpy().astype(np.uint64) * np.uint64(0x5851F42D4C957F2D))
    keys = _lowbias32((mixed ^ (mixed >> np.uint64(32))) & _MASK)
    columns = np.arange(vocab_size, dtype=np.uint64)
    hashes = _lowbias32(((columns[None, :] * np.uint64(0x9E3779B1)) & _MASK) ^ keys[:, None])
    uniform = (torch.from_numpy((hashes >> np.uint64(9)).astype(np.float32)) + 0.5) * (1.0 / 8388608.0)
    return -torch.log(-torch.log(uniform))


def reference_sample(logits: torch.Tensor, inv_temperatures: torch.Tensor, greedy: torch.Tensor,
                     thresholds: torch.Tensor, sample_seeds: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scaled = logits.float().cpu() * inv_temperatures.cpu()[:, None]
    gumbel = reference_gumbel(sample_seeds, positions, logits.shape[1])
    sampled = torch.where(scaled >= thresholds.cpu()[:, None], scaled + gumbel, float("-inf"))
    tokens = torch.where(greedy.cpu().bool()[:, None], scaled, sampled).argmax(dim=-1)  # ties: the first column
    return tokens, torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None])[:, 0]


def random_sampling_inputs(rows: int, vocab_size: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Logits, temperatures, a quarter of rows greedy, top-k thresholds on some rows; all on DEVICE."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab_size, generator=generator) * 3).to(dtype)
    greedy = torch.rand(rows, generator=generator) < 0.25
    inv_temperatures = torch.where(greedy, 1.0, 0.3 + 2 * torch.rand(rows, generator=generator))
    top_k = torch.where(torch.rand(rows, generator=generator) < 0.4, 20, 0)
    kth = (logits.float() * inv_temperatures[:, None]).topk(20, dim=-1).values[:, -1]
    inputs = dict(logits=logits, inv_temperatures=inv_temperatures, greedy=greedy.to(torch.int32),
                  thresholds=torch.where(top_k > 0, kth, float("-inf")),
                  sample_seeds=torch.randint(0, 2**62, (rows,), generator=generator),
                  positions=torch.randint(0, 4096, (rows,), generator=generator))
    return {name: tensor.to(DEVICE) for name, tensor in inputs.items()}


@pytest.mark.parametrize("layout", SPLIT_LAYOUTS)
@pytest.mark.parametrize(("vocab_size", "dtype"), [(1000, torch.float32), (2053, torch.bfloat16)])
def test_sampler_kernel_matches_the_reference(layout, vocab_size, dtype):
    inputs = random_sampling_inputs(8, vocab_size, dtype, seed=vocab_size)
    tokens, log_probs = triton_kernels.sample(*inputs.values(), **layout)
    expected_tokens, expected_log_probs = reference_sample(*inputs.values())
    assert tokens.dtype == torch.int64 and log_probs.dtype == torch.float32
    assert tokens.cpu().tolist() == expected_tokens.tolist()
    torch.testing.assert_close(log_probs.cpu(), expected_log_probs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", SPLIT_LAYOUTS)
def test_sampler_kernel_ties_pick_the_first_column(layout):
    inputs = random_sampling_inputs(4, 700, torch.float32, seed=3)
    logits = inputs["logits"]
    logits[:, [650, 5, 300]] = logits.max() + 1.0  # equal maxima in different blocks and splits
    inputs["greedy"].fill_(1)
    inputs["inv_temperatures"].fill_(1.0)
    tokens, _ = triton_kernels.sample(*inputs.values(), **layout)
    assert tokens.cpu().tolist() == [5, 5, 5, 5]
    inputs["greedy"].zero_()
    inputs["thresholds"].fill_(float(logits.max()))  # only the three tied columns qualify
    tokens, _ = triton_kernels.sample(*inputs.values(), **layout)
    assert set(tokens.cpu().tolist()) <= {5, 300, 650}
    assert tokens.cpu().tolist() == reference_sample(*inputs.values())[0].tolist()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NaN arithmetic, on purpose here
@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("layout", SPLIT_LAYOUTS)
def test_no_parameters_or_logits_sample_an_id_past_the_vocabulary(layout, use_triton):
    # rows of every kind of inverse temperature, each greedy and sampled, without a threshold and with a NaN one, over
    # logits of ordinary, NaN and infinite values (a vocabulary that is no multiple of a block)
    vocab_size, inf, nan = 300, float("inf"), float("nan")
    inv_temperatures = torch.tensor([-1.0, -1e30, -inf, 0.0, nan, inf, 1.0])
    rows = [(inv, greedy, threshold) for inv in inv_temperatures.tolist() for greedy in (1, 0)
            for threshold in (-inf, nan)]
    logits = torch.randn(len(rows), vocab_size, generator=torch.Generator().manual_seed(0))
    logits[0::4] = -logits[0::4].abs()  # all negative: a negative temperature makes each one +inf
    logits[1::4, ::3] = nan
    logits[2::4, 7] = inf
    logits[3::4, 5] = -inf
    num_rows = len(rows)
    params = SamplingTensors(
        inv_temperatures=torch.tensor([row[0] for row in rows], device=DEVICE),
        greedy=torch.tensor([row[1] for row in rows], dtype=torch.int32, device=DEVICE),
        top_k=torch.zeros(num_rows, dtype=torch.int64, device=DEVICE), top_p=torch.ones(num_rows, device=DEVICE),
        log_min_p=torch.full((num_rows,), -inf, device=DEVICE),
        sample_seeds=torch.arange(num_rows, device=DEVICE), needs_truncation=False, needs_min_p=False,
        positions=torch.full((num_rows,), 9, device=DEVICE))
    thresholds = torch.tensor([row[2] for row in rows], device=DEVICE)
    if use_triton:
        tokens, _ = triton_kernels.sample(logits.to(DEVICE), params.inv_temperatures, params.greedy, thresholds,
                                          params.sample_seeds, params.positions, **layout)
    else:
        tokens, _ = Sampler._sample_torch(logits.to(DEVICE), params, thresholds)
    assert 0 <= int(tokens.min()) and int(tokens.max()) < vocab_size, tokens.tolist()


def test_the_pytorch_noise_is_the_kernels_noise_and_both_sampler_paths_agree():
    inputs = random_sampling_inputs(16, 1000, torch.float32, seed=21)
    seeds, positions = inputs["sample_seeds"], inputs["positions"]
    keys = noise_keys(seeds.cpu().tolist(), positions.cpu().tolist())
    assert torch.equal(gumbel_noise(keys, 1000), reference_gumbel(seeds, positions, 1000))
    params = SamplingTensors(
        inv_temperatures=inputs["inv_temperatures"], greedy=inputs["greedy"],
        top_k=torch.zeros(16, dtype=torch.int64, device=DEVICE), top_p=torch.ones(16, device=DEVICE),
        log_min_p=torch.full((16,), float("-inf"), device=DEVICE), sample_seeds=seeds,
        needs_truncation=False, needs_min_p=False, positions=positions)
    triton_tokens, triton_log_probs = Sampler(use_triton=True)(inputs["logits"], params)
    torch_tokens, torch_log_probs = Sampler(use_triton=False)(inputs["logits"], params)
    assert triton_tokens.tolist() == torch_tokens.tolist()
    torch.testing.assert_close(triton_log_probs, torch_log_probs, atol=1e-5, rtol=1e-5)


def test_sampler_forms_min_p_and_top_p_thresholds_before_the_kernel():
    rows, vocab_size = 16, 1500
    inputs = random_sampling_inputs(rows, vocab_size, torch.bfloat16, seed=9)
    generator = torch.Generator().manual_seed(4)
    uses_min_p = (torch.rand(rows, generator=generator) < 0.5) & ~inputs["greedy"].cpu().bool()
    log_min_p = torch.where(uses_min_p, torch.log(0.02 + 0.3 * torch.rand(rows, generator=generator)), float("-inf"))
    params = SamplingTensors(
        inv_temperatures=inputs["inv_temperatures"], greedy=inputs["greedy"],
        top_k=torch.where(torch.arange(rows) % 3 == 0, 40, 0).to(DEVICE),
        top_p=torch.where(torch.arange(rows) % 4 == 1, 0.8, 1.0).to(DEVICE),
        log_min_p=log_min_p.to(DEVICE), sample_seeds=inputs["sample_seeds"],
        needs_truncation=True, needs_min_p=True, positions=inputs["positions"])
    tokens, log_probs = Sampler(use_triton=True)(inputs["logits"], params)
    scaled = inputs["logits"].float().cpu() * params.inv_temperatures.cpu()[:, None]
    thresholds = torch.maximum(truncation_thresholds(scaled, params.top_k.cpu(), params.top_p.cpu()),
                               scaled.max(dim=-1).values + params.log_min_p.cpu())
    expected_tokens, expected_log_probs = reference_sample(
        inputs["logits"], params.inv_temperatures, params.greedy, thresholds, params.sample_seeds, params.positions)
    assert tokens.cpu().tolist() == expected_tokens.tolist()
    torch.testing.assert_close(log_probs.cpu(), expected_log_probs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_reads_gate_then_up(dtype):
    gate_up = torch.randn(5, 2 * 1100, generator=torch.Generator().manual_seed(0)).to(dtype).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    out = triton_kernels.silu_and_mul(gate_up)
    assert out.shape == (5, 1100)
    torch.testing.assert_close(out, F.silu(gate) * up)  # transformers' Qwen2/Llama MLP, rounded alike


def reference_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Each sequence's query against its first context_len cached tokens, head by head, in float64."""
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for row, context_len in enumerate(context_lens.tolist()):
        positions = torch.arange(context_len)
        blocks = block_tables[row].cpu().long()[positions // page]
        keys = k_cache.cpu().double()[blocks, positions % page].repeat_interleave(group, dim=1)  # (context, heads, dim)
        values = v_cache.cpu().double()[blocks, positions % page].repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[row].cpu().double(), keys) * scale, dim=-1)
        out[row] = torch.einsum("ht,thd->hd", weights, values)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, BFLOAT16_ON_GPU])
@pytest.mark.parametrize(("num_heads", "page", "block_n"), [(4, 8, 16), (6, 16, 64), (2, 4, 4)])
def test_paged_decode_attention_matches_the_reference(dtype, num_heads, page, block_n):
    """Ragged context lengths (one token, one exact page, several loop blocks) over shuffled pages, grouped heads."""
    generator = torch.Generator().manual_seed(num_heads * page)
    num_kv_heads, head_dim, num_blocks = 2, 16, 48
    context_lens = torch.tensor([1, page, 3 * block_n + 5, 37], dtype=torch.int32)
    max_blocks = -(-int(context_lens.max()) // page)
    block_tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:max_blocks] for _ in context_lens])
    k_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=generator).to(dtype)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=generator).to(dtype)
    out = triton_kernels.paged_decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                                                block_tables.to(torch.int32).to(DEVICE), context_lens.to(DEVICE),
                                                scale=head_dim**-0.5, block_n=block_n)
    expected = reference_decode_attention(q, k_cache, v_cache, block_tables, context_lens, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, BFLOAT16_ON_GPU])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_transformers(dtype, with_residual):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3, 40, generator=generator).to(dtype)  # (rows, heads, dim), as for Qwen3's q and k norms
    residual = torch.randn(6, 3, 40, generator=generator).to(dtype)
    norm = Qwen2RMSNorm(40, eps=1e-6)
    norm.weight.data = (1 + torch.randn(40, generator=generator) / 4).to(dtype)
    residual_device = residual.clone().to(DEVICE)
    out = triton_kernels.rms_norm(x.to(DEVICE), norm.weight.data.to(DEVICE), 1e-6,
                                  residual_device if with_residual else None)
    summed = (x + residual) if with_residual else x
    torch.testing.assert_close(out.cpu(), norm.to(dtype)(summed))
    if with_residual:
        torch.testing.assert_close(residual_device.cpu(), summed, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, BFLOAT16_ON_GPU])
def test_rope_and_write_cache_rotates_in_place_and_fills_the_slots(dtype):
    """Strided q/k/v views of one fused projection, as the engine passes them; unmapped slots stay untouched."""
    generator = torch.Generator().manual_seed(8)
    num_tokens, num_heads, num_kv_heads, head_dim, page = 5, 6, 3, 16, 4
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(32).float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], dim=-1).cos().to(dtype), torch.cat([angles, angles], dim=-1).sin().to(dtype)
    positions = torch.tensor([0, 7, 8, 30, 3])
    slot_mapping = torch.tensor([9, 0, 21, 14, 5])
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(num_tokens, -1, head_dim) for t in (q, k, v))
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos[positions], sin[positions], unsqueeze_dim=1)
    qkv_device = qkv.clone().to(DEVICE)
    q_view, k_view, v_view = (t.view(num_tokens, -1, head_dim) for t in qkv_device.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1))
    k_cache = torch.full((6, page, num_kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    v_cache = torch.full((6, page, num_kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE)
    triton_kernels.rope_and_write_cache(q_view, k_view, v_view, cos.to(DEVICE), sin.to(DEVICE), positions.to(DEVICE),
                                        slot_mapping.to(DEVICE), k_cache, v_cache)
    # the kernel rotates in float32 and rounds once; transformers rounds each bf16 product: one bf16 step apart
    close = {} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 1.6e-2}
    torch.testing.assert_close(q_view.cpu(), expected_q, **close)
    torch.testing.assert_close(k_view.cpu(), expected_k, **close)
    k_slots, v_slots = k_cache.cpu().flatten(0, 1), v_cache.cpu().flatten(0, 1)
    torch.testing.assert_close(k_slots[slot_mapping], expected_k, **close)
    torch.testing.assert_close(v_slots[slot_mapping], v, atol=0, rtol=0)
    unmapped = torch.ones(len(k_slots), dtype=torch.bool)
    unmapped[slot_mapping] = False
    assert (k_slots[unmapped] == 7).all() and (v_slots[unmapped] == 7).all()


def test_engine_on_the_triton_path_matches_generate(tiny):
    """Every kernel in one engine: fused projections as strided q/k/v views (Qwen2: with biases) through the norm,
    rotary and cache, attention, MLP and sampler kernels; greedy rows and a sampled one in the same steps."""
    model = tiny.build("qwen2", device=DEVICE)
    prompts = tiny.prompts([3, 11])
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=8, max_num_seqs=4, use_triton=True)
    outputs = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=4, temperature=0.0)) for p in prompts]
                              + [GenerationRequest(prompts[1], SamplingParams(max_tokens=4, temperature=0.8, seed=2))])
    for prompt, samples in zip(prompts, outputs, strict=False):
        assert samples[0].token_ids == tiny.hf_greedy(model, prompt, 4)
    sampled = outputs[2][0]
    expected = tiny.recomputed_log_probs(model, prompts[1], sampled.token_ids, temperature=0.8)
    torch.testing.assert_close(torch.tensor(sampled.log_probs), expected, atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_sampler_kernel_matches_the_reference_at_qwen_vocab_size():
    inputs = random_sampling_inputs(64, 151936, torch.bfloat16, seed=1)
    tokens, log_probs = triton_kernels.sample(*inputs.values())
    expected_tokens, expected_log_probs = reference_sample(*inputs.values())
    assert tokens.cpu().tolist() == expected_tokens.tolist()
    torch.testing.assert_close(log_probs.cpu(), expected_log_probs, atol=1e-4, rtol=1e-5)


@triton.jit
def _gumbel_of_uniforms(uniforms_ptr, out_ptr, count, FAST_LOG: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    uniforms = tl.load(uniforms_ptr + offsets, mask=offsets < count, other=0.5)
    tl.store(out_ptr + offsets, triton_kernels._gumbel(uniforms, FAST_LOG), mask=offsets < count)


@pytest.mark.gpu
def test_the_compiled_samplers_noise_is_gumbel_to_float32_precision_at_every_uniform():
    """The fast noise (approximate log2 where it is accurate, a series for -log(u) as u nears 1) against float64
    at each of the 2^23 uniforms the hash can give: within 4e-7 of max(|noise|, 1), as float32 rounding allows (the
    accurate float32 logarithms are within 1.4e-7), the largest noise included."""
    uniforms = ((torch.arange(2**23, dtype=torch.float32) + 0.5) / 2**23).cuda()
    fast = torch.empty_like(uniforms)
    _gumbel_of_uniforms[(2**23 // 1024,)](uniforms, fast, 2**23, FAST_LOG=True, BLOCK=1024)
    exact = -torch.log(-torch.log(uniforms.double()))
    assert float(((fast.double() - exact).abs() / exact.abs().clamp(min=1)).max()) < 4e-7
    assert float(fast.max()) > 16.0  # u = 1 - 2^-24 gives the largest noise, finite


@pytest.mark.parametrize("dtype", [torch.float32, BFLOAT16_ON_GPU])
@pytest.mark.parametrize("kind", ["gemma", "olmo"])
def test_rms_norm_kinds_match_transformers(kind, dtype):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    generator = torch.Generator().manual_seed(6)
    x, residual = (torch.randn(5, 48, generator=generator).to(dtype) for _ in range(2))
    norm = Gemma2RMSNorm(48, eps=1e-6) if kind == "gemma" else Olmo2RMSNorm(48, eps=1e-6)
    norm.weight.data = (torch.randn(48, generator=generator) / 4 + (0 if kind == "gemma" else 1)).to(dtype)
    residual_device = residual.clone().to(DEVICE)
    out = triton_kernels.rms_norm(x.to(DEVICE), norm.weight.data.to(DEVICE), 1e-6, residual_device, kind)
    torch.testing.assert_close(out.cpu(), norm.to(dtype)(x + residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_is_transformers_gelu_pytorch_tanh(dtype):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("bf16 arithmetic inside a kernel runs on the GPU only")
    gate_up = (3 * torch.randn(4, 2 * 300, generator=torch.Generator().manual_seed(2))).to(dtype).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(triton_kernels.act_and_mul(gate_up, "gelu_tanh"), F.gelu(gate, approximate="tanh") * up)


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(24, 12), (16, 0)])
def test_rope_and_write_cache_rotates_the_rotary_dims_only(head_dim, rotary_dim):
    """Phi-style partial rotary on a head dim that is no power of two, and a layer without rotary (SmolLM3's
    NoPE layers): the other dims pass through to the cache unchanged."""
    from reinforge.rollout.native.layers import apply_partial_rotary

    generator = torch.Generator().manual_seed(9)
    num_tokens, num_heads, num_kv_heads = 4, 4, 2
    q = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) for _ in range(2))
    positions, slots = torch.tensor([3, 0, 9, 5]), torch.tensor([2, 7, 4, 0])
    if rotary_dim:
        angles = torch.arange(16).float()[:, None] * torch.rand(rotary_dim // 2, generator=generator)[None, :]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        expected_q, expected_k = (apply_partial_rotary(t, cos[positions], sin[positions]) for t in (q, k))
    else:
        cos = sin = None
        expected_q, expected_k = q, k
    q_device, k_device = q.clone().to(DEVICE), k.clone().to(DEVICE)
    k_cache, v_cache = (torch.zeros(3, 4, num_kv_heads, head_dim, device=DEVICE) for _ in range(2))
    triton_kernels.rope_and_write_cache(q_device, k_device, v.to(DEVICE), None if cos is None else cos.to(DEVICE),
                                        None if sin is None else sin.to(DEVICE), positions.to(DEVICE),
                                        slots.to(DEVICE), k_cache, v_cache)
    torch.testing.assert_close(q_device.cpu(), expected_q)
    torch.testing.assert_close(k_cache.cpu().flatten(0, 1)[slots], expected_k)
    torch.testing.assert_close(v_cache.cpu().flatten(0, 1)[slots], v, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, BFLOAT16_ON_GPU])
@pytest.mark.parametrize(("kind", "head_dim", "rotary_dim"), [("llama", 32, 32), ("gemma", 24, 12), ("llama", 16, 0)])
def test_rope_with_head_norms_is_the_norm_then_the_rope(kind, head_dim, rotary_dim, dtype):
    """Qwen3's and Gemma 3's q and k norms inside the rotary kernel: q, k and v as views of each token's q|k|v row,
    as a layer hands them over; the row's q and k become what the norm kernel and then the rotary kernel give, with
    partial rotary and without rotary (each head still normalised), and the cache gets the same k and v."""
    generator = torch.Generator().manual_seed(10)
    num_tokens, num_heads, num_kv_heads = 5, 4, 2
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=generator).to(dtype)
    q_weight, k_weight = ((torch.randn(head_dim, generator=generator) / 4 + (kind != "gemma")).to(dtype)
                          for _ in range(2))
    positions, slots = torch.tensor([3, 0, 9, 5, 1]), torch.tensor([2, 7, 4, 0, 11])
    if rotary_dim:
        angles = torch.arange(16).float()[:, None] * torch.rand(rotary_dim // 2, generator=generator)[None, :]
        cos, sin = (f(torch.cat([angles, angles], -1)).to(DEVICE) for f in (torch.cos, torch.sin))
    else:
        cos = sin = None

    def run(fused: bool):
        row = qkv.clone().to(DEVICE)
        q, k, v = row.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, num_heads, head_dim)
        k, v = k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)
        weights = q_weight.to(DEVICE), k_weight.to(DEVICE)
        if not fused:
            q, k = (triton_kernels.rms_norm(x, w, 1e-6, kind=kind) for x, w in zip((q, k), weights, strict=True))
        caches = [torch.zeros(3, 4, num_kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(2)]
        triton_kernels.rope_and_write_cache(q, k, v, cos, sin, positions.to(DEVICE), slots.to(DEVICE), *caches,
                                            (*weights, 1e-6, kind) if fused else None)
        return q.cpu(), k.cpu(), *(cache.cpu() for cache in caches)

    # the interpreter sums as numpy does either way; compiled, the two reductions may differ in their order
    close = {"atol": 0, "rtol": 0} if DEVICE == "cpu" else \
        {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 1.6e-2}
    for fused_part, separate_part in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(fused_part, separate_part, **close)


@pytest.mark.parametrize(("window", "softcap"), [(5, None), (None, 0.5), (9, 0.5)])
def test_paged_decode_attention_with_windows_and_softcaps_is_the_pytorch_paths(window, softcap):
    """Context lengths inside and past the window, a head dim that is no power of two; table entries before
    the window name a block that is not there (-1): a windowed kernel never reads them."""
    from reinforge.rollout.native.attention import AttentionMetadata, decode_attention

    generator = torch.Generator().manual_seed(11)
    num_heads, num_kv_heads, head_dim, page, num_blocks = 4, 2, 24, 4, 40
    context_lens = torch.tensor([1, 5, 23, 70], dtype=torch.int32)
    max_blocks = -(-int(context_lens.max()) // page)
    block_tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:max_blocks] for _ in context_lens])
    k_cache, v_cache = (torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=generator) for _ in range(2))
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=generator)
    meta = AttentionMetadata(slot_mapping=torch.empty(0), is_prefill=False, block_tables=block_tables,
                             context_lens=context_lens)
    expected = decode_attention(q, k_cache, v_cache, meta, 0.3, window, softcap)
    tables = block_tables.clone().to(torch.int32)
    if window is not None:  # blocks wholly before each query's window were given back
        for row, length in enumerate(context_lens.tolist()):
            tables[row, :max(length - window, 0) // page] = -1
    out = triton_kernels.paged_decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                                                tables.to(DEVICE), context_lens.to(DEVICE), 0.3, softcap, window,
                                                block_n=16)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
    if window is not None:  # and the window matters
        assert not torch.allclose(expected, decode_attention(q, k_cache, v_cache, meta, 0.3, None, softcap))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("truncate", [False, True], ids=["kernel-caps", "thresholds-cap-first"])
def test_a_soft_capped_model_samples_as_if_its_logits_were_capped_in_float32(dtype, truncate):
    rows, vocab_size, cap = 12, 1300, 30.0
    inputs = random_sampling_inputs(rows, vocab_size, dtype, seed=5)
    logits = (inputs["logits"].float() * 40.0).to(dtype)  # reaching past the cap, where tanh bends
    params = SamplingTensors(
        inv_temperatures=inputs["inv_temperatures"], greedy=inputs["greedy"],
        top_k=torch.full((rows,), 50 if truncate else 0, dtype=torch.int64, device=DEVICE),
        top_p=torch.full((rows,), 0.9 if truncate else 1.0, device=DEVICE),
        log_min_p=torch.full((rows,), float("-inf"), device=DEVICE), sample_seeds=inputs["sample_seeds"],
        needs_truncation=truncate, needs_min_p=False, positions=inputs["positions"])
    capped = cap * torch.tanh(logits.float() / cap)
    expected_tokens, expected_log_probs = Sampler(use_triton=False)(capped, params)
    for use_triton in (True, False):
        tokens, log_probs = Sampler(use_triton=use_triton, softcap=cap)(logits, params)
        assert tokens.tolist() == expected_tokens.tolist(), use_triton
        torch.testing.assert_close(log_probs, expected_log_probs, atol=2e-5, rtol=1e-5)
    uncapped_tokens, _ = Sampler(use_triton=True)(logits, params)
    assert uncapped_tokens.tolist() != expected_tokens.tolist()  # the cap changes what is sampled here
