"""The fp8 KV cache (kv_quant.py): e4m3 vectors with a float32 scale each, written by the rotary-and-cache kernel
and read by the paged decode kernels (Triton's interpreter on the CPU) and by the PyTorch paths."""

from __future__ import annotations

import pytest
import torch

from reinforge.models.tiny import build_tiny_causal_lm
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.native.attention import AttentionMetadata, decode_attention
from reinforge.rollout.native.kv_quant import FP8_MAX, block_bytes, dequantize, layer_caches, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_quantize_round_trip_stays_within_e4m3_rounding():
    """Each element comes back within half an e4m3 step: 2^-4 of itself, or 2^-10 of its vector's scale below
    e4m3's normal range; a vector's largest magnitude maps to 448, and an all-zero vector stays zero."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 128, generator=generator) * torch.logspace(-3, 2, 64)[:, None, None]
    x[3, 1] = 0.0
    values, scales = quantize(x)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (64, 4)
    torch.testing.assert_close(scales, x.abs().amax(-1) / FP8_MAX)
    assert (values.float().abs().amax(-1)[scales > 0] == FP8_MAX).all()
    back = dequantize(values, scales, torch.float32)
    bound = torch.maximum(x.abs() * 2**-4, scales[..., None] * 2**-10) * (1 + 1e-6)
    assert ((back - x).abs() <= bound).all()
    assert (back[3, 1] == 0).all()
    relative = ((back - x).norm(dim=-1) / x.norm(dim=-1).clamp(min=1e-30))[scales > 0]
    assert relative.max() < 0.04


def fp8_layer_cache(num_blocks: int, page: int, heads: int, dim: int, dtype=torch.float32):
    cache = torch.zeros(2, num_blocks, block_bytes(page, heads, dim), dtype=torch.uint8, device=DEVICE)
    return cache, layer_caches(cache, heads, dim, dtype)


def test_the_block_layout_keeps_every_slots_values_and_scales_apart_and_copies_with_its_block():
    page, heads, dim, num_blocks = 4, 2, 24, 5
    cache, (k_cache, v_cache) = fp8_layer_cache(num_blocks, page, heads, dim)
    generator = torch.Generator().manual_seed(1)
    k, v = (torch.randn(num_blocks * page, heads, dim, generator=generator).to(DEVICE) for _ in range(2))
    slots = torch.randperm(num_blocks * page, generator=generator).to(DEVICE)
    k_cache.write(k, slots)
    v_cache.write(v, slots)
    torch.testing.assert_close(k_cache.rows(slots), dequantize(*quantize(k), torch.float32))
    torch.testing.assert_close(v_cache.rows(slots), dequantize(*quantize(v), torch.float32))
    before = k_cache.rows(torch.arange(page, 2 * page, device=DEVICE))
    cache[:, 3] = cache[:, 1]  # what the runner's copy_blocks does to every layer
    torch.testing.assert_close(k_cache.rows(torch.arange(3 * page, 4 * page, device=DEVICE)), before)


@pytest.mark.parametrize(("page", "heads", "dim"), [(3, 1, 5), (1, 3, 7), (2, 1, 9)])
def test_blocks_of_an_odd_count_of_values_keep_their_scales_on_whole_floats(page, heads, dim):
    """A block of 3 tokens of one 5-dim head holds 15 fp8 values: its scales start after a byte of padding, and every
    slot reads back what was written (an engine built with such a block size, on a model of odd head size)."""
    num_blocks = 4
    assert block_bytes(page, heads, dim) % 4 == 0 and block_bytes(16, heads, dim) == 16 * heads * (dim + 4)
    cache, (k_cache, v_cache) = fp8_layer_cache(num_blocks, page, heads, dim)
    assert k_cache.values.shape == (num_blocks, page, heads, dim) and k_cache.scales.shape == (num_blocks, page, heads)
    generator = torch.Generator().manual_seed(6)
    k, v = (torch.randn(num_blocks * page, heads, dim, generator=generator).to(DEVICE) for _ in range(2))
    slots = torch.arange(num_blocks * page, device=DEVICE)
    k_cache.write(k, slots)
    v_cache.write(v, slots)
    torch.testing.assert_close(k_cache.rows(slots), dequantize(*quantize(k), torch.float32))
    torch.testing.assert_close(v_cache.rows(slots), dequantize(*quantize(v), torch.float32))


triton = pytest.importorskip("triton")
from reinforge.rollout.native import triton_kernels  # noqa: E402


def test_the_rotary_and_cache_kernel_quantises_as_the_pytorch_write_does():
    """A partial rotary (16 of 24 dims): q and k rotate as without fp8, and the cache holds each k and v vector
    at its slot, scaled by its own amax / 448 (up to one e4m3 step where a product rounds the other way)."""
    generator = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, dim, page = 6, 4, 2, 24, 4
    q = torch.randn(tokens, heads, dim, generator=generator)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=generator) * 3 for _ in range(2))
    k[2, 1] = 0.0
    cos, sin = (torch.randn(32, 16, generator=generator) for _ in range(2))
    positions = torch.randint(0, 32, (tokens,), generator=generator)
    slots = torch.tensor([17, 0, 5, 9, 10, 3])
    _, (k_fp8, v_fp8) = fp8_layer_cache(5, page, kv_heads, dim)
    plain_k, plain_v = (torch.zeros(5, page, kv_heads, dim, device=DEVICE) for _ in range(2))
    q_plain, k_plain = q.clone().to(DEVICE), k.clone().to(DEVICE)
    triton_kernels.rope_and_write_cache(q_plain, k_plain, v.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE),
                                        positions.to(DEVICE), slots.to(DEVICE), plain_k, plain_v)
    q_fp8, k_rotated = q.clone().to(DEVICE), k.clone().to(DEVICE)
    triton_kernels.rope_and_write_cache(q_fp8, k_rotated, v.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE),
                                        positions.to(DEVICE), slots.to(DEVICE), k_fp8, v_fp8)
    torch.testing.assert_close(q_fp8, q_plain, atol=0, rtol=0)
    torch.testing.assert_close(k_rotated, k_plain, atol=0, rtol=0)
    for cache, expected in ((k_fp8, k_plain.cpu()), (v_fp8, v)):
        scales = expected.abs().amax(-1) / FP8_MAX
        torch.testing.assert_close(cache.scales.flatten(0, 1)[slots].cpu(), scales)
        step = torch.maximum(expected.abs() * 2**-3, scales[..., None] * 2**-9)  # one e4m3 step
        assert ((cache.rows(slots.to(DEVICE)).cpu() - expected).abs() <= step).all()
    assert (k_fp8.rows(slots[2:3].to(DEVICE))[0, 1] == 0).all()


@pytest.mark.parametrize(("num_splits", "block_n", "value_scale"), [(1, 16, 1.0), (2, 128, 1.0), (1, 16, 1e-3)])
def test_bf16_fp8_decode_attention_runs_its_products_in_float16_to_the_reference(num_splits, block_n, value_scale):
    """A bf16 query over an fp8 cache: the products run in float16 (the values' weights scaled into float16's normal
    range), and match float32 attention over the dequantised cache to bf16 rounding, values of any magnitude."""
    generator = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, page, num_blocks = 6, 2, 32, 16, 40
    lengths = torch.tensor([1, 17, 150, 300], dtype=torch.int32)
    max_blocks = -(-int(lengths.max()) // page)
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:max_blocks] for _ in lengths]).to(
        torch.int32)
    k = torch.randn(num_blocks * page, kv_heads, dim, generator=generator)
    v = torch.randn(num_blocks * page, kv_heads, dim, generator=generator) * value_scale
    q = torch.randn(len(lengths), heads, dim, generator=generator) * 3
    _, (k_fp8, v_fp8) = fp8_layer_cache(num_blocks, page, kv_heads, dim, torch.bfloat16)
    slots = torch.arange(num_blocks * page, device=DEVICE)
    k_fp8.write(k.to(DEVICE), slots)
    v_fp8.write(v.to(DEVICE), slots)
    meta = AttentionMetadata(slot_mapping=torch.empty(0), is_prefill=False, block_tables=tables, context_lens=lengths)
    k_deq, v_deq = (dequantize(cache.values.cpu(), cache.scales.cpu(), torch.float32) for cache in (k_fp8, v_fp8))
    expected = decode_attention(q.bfloat16().float(), k_deq, v_deq, meta, dim**-0.5)
    out = triton_kernels.paged_decode_attention(q.to(DEVICE, torch.bfloat16), k_fp8, v_fp8, tables.to(DEVICE),
                                                lengths.to(DEVICE), dim**-0.5, block_n=block_n, num_splits=num_splits,
                                                min_chunk_tokens=16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), expected, atol=2e-2 * value_scale, rtol=2e-2)


@pytest.mark.parametrize(("window", "softcap", "num_splits", "block_n"), [
    (None, None, 1, 16), (9, 0.5, 1, 16), (None, None, 2, 128), pytest.param(None, None, 3, 16, marks=pytest.mark.slow),
    pytest.param(37, None, 4, 16, marks=pytest.mark.slow)])
def test_fp8_decode_attention_is_the_pytorch_path_over_the_same_cache(window, softcap, num_splits, block_n):
    """The kernels dequantise each vector by its scale as they read it: they give what the PyTorch reference
    gives over the dequantised cache, and stay near the unquantised attention (128-token blocks: the tiling of a
    long fp8 decode, over contexts of several blocks)."""
    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, page, num_blocks = 6, 2, 24, 4, 80
    lengths = torch.tensor([1, 9, 40, 70] if block_n < 128 else [1, 9, 140, 300], dtype=torch.int32)
    max_blocks = -(-int(lengths.max()) // page)
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:max_blocks] for _ in lengths])
    tables = tables.to(torch.int32)
    k, v = (torch.randn(num_blocks * page, kv_heads, dim, generator=generator) for _ in range(2))
    q = torch.randn(len(lengths), heads, dim, generator=generator)
    _, (k_fp8, v_fp8) = fp8_layer_cache(num_blocks, page, kv_heads, dim)
    slots = torch.arange(num_blocks * page, device=DEVICE)
    k_fp8.write(k.to(DEVICE), slots)
    v_fp8.write(v.to(DEVICE), slots)
    meta = AttentionMetadata(slot_mapping=torch.empty(0), is_prefill=False, block_tables=tables.to(DEVICE),
                             context_lens=lengths.to(DEVICE))
    expected = decode_attention(q.to(DEVICE), k_fp8, v_fp8, meta, 0.3, window, softcap)
    out = triton_kernels.paged_decode_attention(q.to(DEVICE), k_fp8, v_fp8, tables.to(DEVICE), lengths.to(DEVICE),
                                                0.3, softcap, window, block_n=block_n, num_splits=num_splits,
                                                num_stages=3 if block_n == 128 else None, min_chunk_tokens=16)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    unquantized = decode_attention(q, k.view(num_blocks, page, kv_heads, dim), v.view(num_blocks, page, kv_heads, dim),
                                   AttentionMetadata(slot_mapping=torch.empty(0), is_prefill=False,
                                                     block_tables=tables, context_lens=lengths), 0.3, window, softcap)
    assert (out.cpu() - unquantized).abs().max() < 0.1
    assert not torch.equal(out.cpu(), unquantized)


def tiny_model(family: str = "qwen2", window: int | None = None):
    return build_tiny_causal_lm(family, vocab_size=128, num_layers=2, sliding_window=window, seed=3,
                                max_position_embeddings=128).to(DEVICE).eval()


def test_an_fp8_cache_holds_the_tokens_of_its_bytes_and_generates_near_the_model_dtype():
    """PyTorch path: a block costs head_dim + 4 bytes per KV head and token; greedy decoding from the fp8 cache
    (prefix-cache hit included) follows the float32 cache's tokens closely on a tiny random model."""
    model = tiny_model("mistral", window=12)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (length,), generator=generator).tolist() for length in (30, 7, 19)]
    requests = [GenerationRequest(p, SamplingParams(max_tokens=8, temperature=0.0)) for p in prompts]
    results = {}
    for kv_cache_dtype in ("auto", "fp8"):
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=96, block_size=4, max_num_seqs=4,
                              use_triton=False, kv_cache_dtype=kv_cache_dtype)
        results[kv_cache_dtype] = [samples[0] for samples in engine.generate(requests)]
        again = engine.generate(requests[:1])[0][0]  # its prompt's blocks come from the prefix cache
        assert again.token_ids == results[kv_cache_dtype][0].token_ids
        if kv_cache_dtype == "fp8":
            config = model.config
            head_dim = config.hidden_size // config.num_attention_heads
            assert engine.runner.kv_bytes_per_block() == 2 * 2 * 4 * config.num_key_value_heads * (head_dim + 4)
            assert engine.runner.kv_cache.dtype == torch.uint8
    first_decoded = [a.token_ids[1] == b.token_ids[1] for a, b in zip(results["fp8"], results["auto"], strict=True)]
    assert sum(first_decoded) >= 2
    for a, b in zip(results["fp8"], results["auto"], strict=True):
        assert abs(a.log_probs[1] - b.log_probs[1]) < 0.1 or a.token_ids[1] != b.token_ids[1]


@pytest.mark.slow
def test_the_triton_path_decodes_an_fp8_cache_as_the_pytorch_path_does():
    model = tiny_model()
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (length,), generator=generator).tolist() for length in (21, 6)]
    requests = [GenerationRequest(p, SamplingParams(max_tokens=4, temperature=0.0)) for p in prompts]
    outputs = [NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=8, max_num_seqs=4,
                            use_triton=use_triton, kv_cache_dtype="fp8").generate(requests)
               for use_triton in (True, False)]
    for triton_samples, torch_samples in zip(*outputs, strict=True):
        assert triton_samples[0].token_ids == torch_samples[0].token_ids
        torch.testing.assert_close(torch.tensor(triton_samples[0].log_probs), torch.tensor(torch_samples[0].log_probs),
                                   atol=2e-3, rtol=0)


def test_fp8_is_refused_in_one_line_where_it_cannot_run():
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp16' is not one of auto, fp8"):
        NativeEngine(tiny_model(), eos_token_ids=[], max_model_len=64, kv_cache_dtype="fp16")
    mla = build_tiny_causal_lm("deepseek_v3", vocab_size=128, num_layers=1, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"latent attention \(MLA\) keeps its compressed cache in the model dtype"):
        NativeEngine(mla, eos_token_ids=[], max_model_len=64, kv_cache_dtype="fp8")


def test_the_config_names_the_kv_cache_dtypes():
    from reinforge.config import ConfigError, load_config

    assert load_config(None, ["rollout.kv_cache_dtype=fp8"]).rollout.kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match=r"rollout.kv_cache_dtype='int8' is not one of auto, fp8"):
        load_config(None, ["rollout.kv_cache_dtype=int8"])
    for value, shown in (("null", "None"), ("[fp8]", r"\['fp8'\]")):  # no word at all: the words are named too
        with pytest.raises(ConfigError, match=rf"^rollout.kv_cache_dtype={shown} \(command line\) is not one of auto, "
                                              "fp8$"):
            load_config(None, [f"rollout.kv_cache_dtype={value}"])


@pytest.mark.gpu
def test_fp8_kv_at_an_8k_context_on_gpu():
    """bf16 model, 8k prompts, CUDA graphs and split decode: a block of the fp8 cache takes the bytes its e4m3
    values and scales need (about half the bf16 block's at head dim 128), and its greedy tokens and log-probs
    stay near the bf16 cache's (printed; loose bounds)."""
    model = build_tiny_causal_lm("qwen2", vocab_size=128, num_layers=2, seed=3,
                                 max_position_embeddings=8192 + 64).to("cuda", torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 128, (8000 + 40 * index,), generator=generator).tolist() for index in range(4)]
    requests = [GenerationRequest(p, SamplingParams(max_tokens=32, temperature=0.0)) for p in prompts]
    samples, blocks = {}, {}
    for kv_cache_dtype in ("auto", "fp8"):
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=8192 + 64, max_num_seqs=8,
                              kv_cache_dtype=kv_cache_dtype)
        blocks[kv_cache_dtype] = engine.runner.kv_bytes_per_block()
        samples[kv_cache_dtype] = [group[0] for group in engine.generate(requests)]
        engine.sleep()
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    # a token's K or V per KV head: head_dim bf16 values, or head_dim e4m3 values and one float32 scale
    assert blocks["auto"] / blocks["fp8"] == pytest.approx(2 * head_dim / (head_dim + 4))
    agreeing, total, differences = 0, 0, []
    for a, b in zip(samples["fp8"], samples["auto"], strict=True):
        common = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y),
                      len(a.token_ids))
        agreeing, total = agreeing + common, total + len(a.token_ids)
        differences += [abs(x - y) for x, y in zip(a.log_probs[:common], b.log_probs[:common], strict=True)]
    mean_difference = sum(differences) / max(len(differences), 1)
    print(f"fp8 KV at 8k: greedy prefix agreement {agreeing / total:.3f}, mean |log-prob difference| "
          f"{mean_difference:.4f}")
    # the first token comes from the prefill (no cache read); the second is the first decoded from the cache
    assert sum(a.token_ids[1] == b.token_ids[1] for a, b in zip(samples["fp8"], samples["auto"], strict=True)) >= 2
    assert mean_difference < 0.2


@pytest.mark.slow
def test_bench_train_runs_an_fp8_cache_and_reports_the_rollout_mismatch(tmp_path):
    import json

    from reinforge.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "train", "--cpu", "--steps", "1", "--kv-cache-dtype", "fp8", "--response-tokens", "32",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    step = result["steps"][0]
    assert 0 <= step["rollout_probs_diff_mean"] <= step["rollout_probs_diff_max"] <= 1
    # fp8 rounds the cache (the native engine's, not float32 noise: transformers' generate keeps no fp8 cache)
    assert 1e-5 < step["rollout_log_probs_diff_mean"] <= step["rollout_log_probs_diff_max"]
    assert result["settings"]["response_tokens"] == 32 and step["rollout_floor_decode_steps"] == 31  # the prefill gives the first
