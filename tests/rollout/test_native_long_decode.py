"""Split-KV (flash-decoding) paged decode attention against the PyTorch reference, and the engine at long contexts.

On the CPU the kernels run in Triton's interpreter on small shapes with the split count forced; the GPU tests
decode at 8k and 32k contexts, where the engine picks the split count itself, against transformers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parents[1]))
from transformers_reference import hf_greedy, recomputed_log_probs  # noqa: E402

from reinforge.models.tiny import build_tiny_causal_lm  # noqa: E402
from reinforge.rollout.base import GenerationRequest, SamplingParams  # noqa: E402
from reinforge.rollout.native import NativeEngine, decode_kernels, triton_kernels  # noqa: E402
from reinforge.rollout.native.attention import AttentionMetadata, DecodeTiling, decode_attention  # noqa: E402
from reinforge.rollout.native.model_runner import ModelRunner  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def paged_inputs(context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, page: int,
                 dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu"):
    """A query per sequence and shuffled pages of random keys and values for each context."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(context_lens, dtype=torch.int32)
    max_blocks = -(-max(context_lens) // page)
    num_blocks = max_blocks * len(context_lens) + 3
    tables = torch.stack([torch.randperm(num_blocks, generator=generator)[:max_blocks] for _ in context_lens])
    k_cache, v_cache = (torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=generator).to(dtype)
                        for _ in range(2))
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=generator).to(dtype)
    return (tensor.to(device) for tensor in (q, k_cache, v_cache, tables.to(torch.int32), lengths))


def reference(q, k_cache, v_cache, tables, lengths, scale, window=None, softcap=None):
    meta = AttentionMetadata(slot_mapping=torch.empty(0), is_prefill=False, block_tables=tables, context_lens=lengths)
    return decode_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale, window, softcap)


@pytest.mark.parametrize(("window", "softcap", "num_splits"), [(None, None, 3), (37, None, 2), (9, 0.5, 4),
                                                               (None, 0.5, 7)])
def test_split_decode_attention_is_the_reference(window, softcap, num_splits):
    """Grouped heads (3 per KV head), a head dim that is no power of two, contexts of one token (one chunk) to
    several chunks; a windowed layer's table entries before the window name no block (-1) and are never read."""
    q, k_cache, v_cache, tables, lengths = paged_inputs([1, 9, 40, 70], 6, 2, 24, 4)
    expected = reference(q, k_cache, v_cache, tables, lengths, 0.3, window, softcap)
    if window is not None:
        for row, length in enumerate(lengths.tolist()):
            tables[row, :max(length - window, 0) // 4] = -1
    out = triton_kernels.paged_decode_attention(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE), lengths.to(DEVICE), 0.3, softcap,
        window, block_n=16, num_splits=num_splits, min_chunk_tokens=16)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("heads_first", "elementwise", "num_heads"), [(True, False, 2), (False, True, 2),
                                                                      (True, True, 6)])
def test_the_grids_order_and_the_elementwise_products_give_the_reference(num_splits, heads_first, elementwise,
                                                                          num_heads):
    """The grid in (KV heads, sequences) order: every (sequence, KV head) program still reads its own rows; the
    scores and values as elementwise products, with one query head per KV head (as Phi-3 and OLMo 2 keep them,
    no rows padded) or three; heads of 24 dims, a window and a soft-cap on the last case."""
    q, k_cache, v_cache, tables, lengths = paged_inputs([3, 40, 17], num_heads, 2, 24, 4)
    window, softcap = (9, 0.5) if num_heads == 6 else (None, None)
    expected = reference(q, k_cache, v_cache, tables, lengths, 0.3, window, softcap)
    out = triton_kernels.paged_decode_attention(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE), lengths.to(DEVICE), 0.3, softcap,
        window, block_n=16, num_splits=num_splits, min_chunk_tokens=16, heads_first=heads_first,
        elementwise=elementwise)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_split_and_unsplit_decode_attention_agree_on_a_batch_of_uneven_contexts():
    """Chunks of at least min_chunk_tokens: the 5-token sequence reads one chunk, the 100-token one four."""
    q, k_cache, v_cache, tables, lengths = (tensor.to(DEVICE) for tensor in paged_inputs([5, 100, 33], 4, 1, 16, 8))
    unsplit = triton_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 0.25, num_splits=1)
    split = triton_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 0.25, block_n=16,
                                                  num_splits=8, min_chunk_tokens=32)
    torch.testing.assert_close(split, unsplit, atol=1e-5, rtol=1e-5)


def test_the_split_count_follows_the_batch_and_not_the_context_past_the_threshold():
    below = decode_kernels.SPLIT_MIN_CONTEXT - 1
    assert decode_kernels.decode_num_splits(128, 2, below, 132) == 1
    at_4k = decode_kernels.decode_num_splits(128, 2, 4200, 132)
    assert at_4k == -(-decode_kernels.PROGRAMS_PER_SM * 132 // 256) > 1
    assert decode_kernels.decode_num_splits(128, 2, 32768, 132) == at_4k  # one graph per batch size once split
    assert decode_kernels.decode_num_splits(1, 1, 32768, 132) == decode_kernels.MAX_SPLITS
    assert decode_kernels.decode_num_splits(1024, 8, 32768, 132) == 1  # the batch alone fills the device


def test_a_batch_that_fills_the_sms_reads_long_contexts_unsplit_in_128_token_blocks():
    tiling = decode_kernels.decode_tiling
    long_unsplit = DecodeTiling(splits=1, block_n=128, num_warps=4, num_stages=3)
    assert tiling(128, 2, 128, decode_kernels.SPLIT_MIN_CONTEXT - 1, 132, False) == DecodeTiling()
    assert tiling(128, 2, 128, 4200, 132, False) == long_unsplit  # 256 programs: two waves 97% full
    assert tiling(128, 2, 128, 32768, 132, False) == long_unsplit  # one graph per batch size once long
    assert tiling(128, 2, 96, 4200, 132, False) == long_unsplit  # Phi-3's heads pad to 128 dims
    split = DecodeTiling(splits=decode_kernels.decode_num_splits(128, 2, 4200, 132))
    assert split.splits > 1
    assert tiling(128, 2, 128, 4200, 132, True) == DecodeTiling(splits=split.splits, block_n=128, num_warps=4,
                                                                num_stages=3)  # fp8: split, 128-token blocks
    assert tiling(128, 2, 256, 4200, 132, False) == split  # 256-dim heads: 128-token blocks would not fit
    assert tiling(80, 2, 128, 4200, 132, False).splits > 1  # 160 programs: a second wave 21% full
    assert tiling(64, 2, 128, 32768, 132, False).splits > 1  # 128 programs leave SMs idle


def test_a_kv_head_read_by_one_query_head_is_launched_heads_first_when_unsplit():
    tiling = decode_kernels.decode_tiling
    assert tiling(512, 32, 96, 256, 132, False, num_heads=32) == DecodeTiling(heads_first=True)  # Phi-3-mini
    assert tiling(512, 16, 128, 640, 132, False, 232_448, num_heads=16).heads_first  # OLMo-2-1B
    assert not tiling(512, 2, 64, 256, 132, False, num_heads=14).heads_first  # grouped query heads
    assert not tiling(512, 32, 96, 256, 132, False).heads_first  # query heads not known
    assert not tiling(512, 32, 96, 256, 132, True, num_heads=32).heads_first  # an fp8 cache
    split = tiling(2, 32, 96, 8192, 132, False, num_heads=32)
    assert split.splits > 1 and not split.heads_first


def test_the_tiling_keeps_to_the_devices_shared_memory():
    """3 stages of 128-token blocks of 128-dim heads take 192 KiB of shared memory: an H200 gives a program 227 KiB,
    an A100 163, an L40S or RTX 4090 99."""
    tiling, h200, a100, l40s = decode_kernels.decode_tiling, 232_448, 166_912, 101_376
    assert tiling(128, 2, 128, 4200, 132, False, h200) == DecodeTiling(1, 128, 4, 3)
    assert tiling(108, 2, 128, 4200, 108, False, a100) == DecodeTiling(1, 128, 4, 2)  # two full waves
    fallback = tiling(128, 2, 128, 4200, 142, False, l40s)
    assert fallback.block_n == 64 and fallback.splits > 1
    assert tiling(128, 2, 128, 4200, 108, True, a100).num_stages == 2  # fp8 too
    many = tiling(1, 2, 128, 32768, 142, False, l40s)  # 64 splits: 3 stages of 64-token blocks would not fit
    assert many.splits == decode_kernels.MAX_SPLITS and many.num_stages == 2
    assert tiling(512, 8, 256, 200, 142, False, l40s) == DecodeTiling(splits=1, block_n=32, num_stages=2)
    for shared_memory, device_tiling in ((h200, tiling(1, 2, 256, 32768, 132, False, h200)),
                                         (l40s, tiling(512, 8, 256, 200, 142, False, l40s))):
        stages = device_tiling.num_stages or decode_kernels.default_num_stages(device_tiling.splits)
        assert decode_kernels.fits_shared_memory(device_tiling.block_n, 256, stages, shared_memory)


def test_the_unsplit_kernel_in_128_token_blocks_is_the_reference():
    q, k_cache, v_cache, tables, lengths = paged_inputs([1, 130, 300, 257], 6, 2, 24, 16)
    expected = reference(q, k_cache, v_cache, tables, lengths, 0.3)
    out = triton_kernels.paged_decode_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                                                tables.to(DEVICE), lengths.to(DEVICE), 0.3,
                                                **DecodeTiling(splits=1, block_n=128, num_warps=4,
                                                               num_stages=3).options())
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_engine_decodes_through_split_attention_as_generate_does(monkeypatch):
    """The runner's split count reaches every layer's kernel: greedy tokens and a sampled row's log-probs are
    transformers' (a window smaller than the context on the sliding layers)."""
    model = build_tiny_causal_lm("mistral", vocab_size=128, num_layers=2, sliding_window=24, seed=3,
                                 max_position_embeddings=128).to(DEVICE).eval()
    monkeypatch.setattr(ModelRunner, "decode_tiling", lambda self, batch, max_context_len: DecodeTiling(splits=3))
    monkeypatch.setattr(decode_kernels, "MIN_CHUNK_TOKENS", 16)
    launched = []
    kernel = triton_kernels.paged_decode_attention

    def recording(*args, **kwargs):
        launched.append(kwargs["num_splits"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_kernels, "paged_decode_attention", recording)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 128, (48,), generator=generator).tolist()  # 3 chunks of 16 or more, past the window
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=96, block_size=8, max_num_seqs=4, use_triton=True)
    outputs = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=3, temperature=0.0)),
                               GenerationRequest(prompt, SamplingParams(max_tokens=3, temperature=0.8, seed=2))])
    assert launched and set(launched) == {3}
    assert outputs[0][0].token_ids == hf_greedy(model, prompt, 3)
    sampled = outputs[1][0]
    torch.testing.assert_close(torch.tensor(sampled.log_probs), recomputed_log_probs(model, prompt, sampled.token_ids,
                                                                                     0.8), atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 1000])
def test_split_kernel_at_8k_and_32k_contexts_on_gpu(window):
    """bf16, Qwen2.5-1.5B's heads (12 query, 2 KV, dim 128), pages of 16: the split count the engine would pick,
    and the unsplit kernel in the 128-token blocks of a batch that fills the SMs, against the unsplit kernel's
    default tiling and a float32 reference."""
    q, k_cache, v_cache, tables, lengths = paged_inputs([8192, 32768, 300, 5000], 12, 2, 128, 16,
                                                        dtype=torch.bfloat16, device="cuda")
    num_splits = decode_kernels.decode_num_splits(4, 2, 32768, decode_kernels.num_sms(q.device))
    assert num_splits > 1
    split = triton_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 128**-0.5, window=window,
                                                  num_splits=num_splits)
    unsplit = triton_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 128**-0.5, window=window,
                                                    num_splits=1)
    blocks_128 = triton_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, 128**-0.5,
                                                       window=window, **decode_kernels.decode_tiling(
                                                           128, 2, 128, 32768, 132, False).options())
    expected = reference(q, k_cache, v_cache, tables, lengths, 128**-0.5, window)
    torch.testing.assert_close(split.float(), expected, atol=2e-2, rtol=2e-2)
    assert (split.float() - expected).abs().max() <= (unsplit.float() - expected).abs().max() + 1e-2
    torch.testing.assert_close(blocks_128.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("family", "prompt_len", "window"), [("qwen2", 8192, None), ("qwen2", 32768, None),
                                                              ("mistral", 8192, 2048)])
def test_engine_at_long_contexts_matches_transformers_on_gpu(family, prompt_len, window):
    """float32, CUDA graphs on: the decode graph splits each context, and greedy tokens and sampled log-probs are
    those of transformers."""
    model = build_tiny_causal_lm(family, vocab_size=128, num_layers=2, sliding_window=window, seed=3,
                                 max_position_embeddings=prompt_len + 64).to("cuda").eval()
    generator = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(0, 128, (prompt_len,), generator=generator).tolist()
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=prompt_len + 64, max_num_seqs=8)
    outputs = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=8, temperature=0.0)),
                               GenerationRequest(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=5))])
    assert any(tiling.splits > 1 for _, tiling in engine.runner._captured)
    assert outputs[0][0].token_ids == hf_greedy(model, prompt, 8)
    sampled = outputs[1][0]
    torch.testing.assert_close(torch.tensor(sampled.log_probs), recomputed_log_probs(model, prompt, sampled.token_ids),
                               atol=1e-4, rtol=0)
    engine.sleep()


@pytest.mark.gpu
def test_split_decode_keeps_bf16_samples_of_the_unsplit_path_on_gpu(monkeypatch):
    """bf16 at an 8k context: split and unsplit decoding mostly sample the same greedy tokens (a near tie may
    flip under different rounding), and while they agree their log-probs differ by bf16 rounding only."""
    model = build_tiny_causal_lm("qwen2", vocab_size=128, num_layers=2, seed=3,
                                 max_position_embeddings=8192 + 64).to("cuda", torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 128, (8000 + 50 * index,), generator=generator).tolist() for index in range(4)]

    def greedy(split: bool):
        monkeypatch.setattr(decode_kernels, "SPLIT_MIN_CONTEXT", 1024 if split else 1 << 30)
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=8192 + 64, max_num_seqs=8)
        outputs = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=32, temperature=0.0))
                                   for p in prompts])
        assert any(tiling.splits > 1 for _, tiling in engine.runner._captured) == split
        engine.sleep()
        return [sample[0] for sample in outputs]

    split, unsplit = greedy(True), greedy(False)
    compared, agreeing = 0, 0
    for a, b in zip(split, unsplit, strict=True):
        common = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y), len(a.token_ids))
        agreeing += common
        compared += len(a.token_ids)
        # where the tokens so far agree, the log-probs of the next differ by rounding only
        difference = (torch.tensor(a.log_probs[:common]) - torch.tensor(b.log_probs[:common])).abs()
        assert difference.max() < 0.05
    assert agreeing / compared >= 0.5
