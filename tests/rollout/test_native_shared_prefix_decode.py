"""Decode attention that reads a group's shared blocks once (the n samples of a prompt share its full blocks)
against the PyTorch reference and the kernel that reads every sequence's blocks itself.

On the CPU the kernels run in Triton's interpreter on small shapes."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from test_native_long_decode import reference  # noqa: E402

from reinforge.rollout.native import decode_kernels  # noqa: E402
from reinforge.rollout.native.kv_quant import QuantizedCache, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def grouped_inputs(groups: list[tuple[int, int]], singles: list[int], num_heads: int, num_kv_heads: int,
                   head_dim: int, page: int, prefix_blocks: int, seed: int = 0):
    """Sequences in groups of ``(members, context)`` whose tables start with the same ``prefix_blocks`` blocks,
    then sequences of their own; every other block is a sequence's own, shuffled in the pool."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [context for members, context in groups for _ in range(members)] + singles
    max_blocks = -(-max(lengths) // page)
    num_blocks = max_blocks * len(lengths) + len(groups) * prefix_blocks + 3
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for members, _ in groups:
        shared = [pool.pop() for _ in range(prefix_blocks)]
        tables += [shared + [pool.pop() for _ in range(max_blocks - prefix_blocks)] for _ in range(members)]
    tables += [[pool.pop() for _ in range(max_blocks)] for _ in singles]
    k_cache, v_cache = (torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=generator) for _ in range(2))
    q = torch.randn(len(lengths), num_heads, head_dim, generator=generator)
    return q, k_cache, v_cache, tables, lengths


def test_groups_are_sequences_starting_with_the_same_blocks_below_every_members_context():
    tables = np.array([[7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 4, 3], [5, 6, 10, 11], [12, 13, 14, 15], [5, 6, 16, 17],
                       [-1, -1, 20, 21], [-1, -1, 22, 23]])
    contexts = np.array([50, 60, 40, 33, 60, 47, 60, 60])
    members, group_lens, prefix_lens = decode_kernels.shared_prefix_arrays(tables, contexts, page=16, max_members=4)
    # 3 and 5 share two blocks; the first three share two (the third differs in its third block); 3's context of
    # 33 leaves only its first two blocks whole; released entries (-1, outside a window) are never shared
    assert members.tolist() == [[3, 5, -1, -1], [0, 1, 2, -1]] and group_lens.tolist() == [32, 32]
    assert prefix_lens.tolist() == [32, 32, 32, 32, 0, 32, 0, 0]
    two = decode_kernels.shared_prefix_arrays(tables, contexts, page=16, max_members=2)[0]
    assert two.tolist() == [[3, 5], [0, 1]]  # the first three cut into two and one: one alone is no group
    assert decode_kernels.shared_prefix(tables, contexts, page=16, device="cpu", min_blocks=3) is None
    tables[1, 0] = 30  # 0 and 2 still share their first two blocks
    members, group_lens, _ = decode_kernels.shared_prefix_arrays(tables, contexts, page=16)
    assert sorted(map(sorted, (row[row >= 0].tolist() for row in members))) == [[0, 2], [3, 5]]


@pytest.mark.parametrize(("num_heads", "window", "softcap"), [(6, None, None), (4, 37, None), (2, None, 0.5),
                                                              (6, 50, 0.5)])
def test_reading_shared_blocks_once_a_group_is_the_reference(num_heads, window, softcap):
    """Two groups (4 members, 3 members) and two sequences of their own; grouped query heads (3, 2 or 1 per KV
    head), a head dim that is no power of two, a window that starts inside the shared blocks for some members."""
    page = 4
    q, k_cache, v_cache, tables, lengths = grouped_inputs([(4, 52), (3, 30)], [9, 41], num_heads, 2, 24, page,
                                                          prefix_blocks=5)
    lengths = torch.tensor(lengths, dtype=torch.int32)
    lengths[0], lengths[2] = 45, 38  # members of one group at other lengths
    table_tensor = torch.tensor(tables, dtype=torch.int32)
    expected = reference(q, k_cache, v_cache, table_tensor, lengths, 0.3, window, softcap)
    prefix = decode_kernels.shared_prefix(tables, lengths.tolist(), page, DEVICE)
    assert prefix is not None and prefix.group_prefix_lens.tolist() == [20, 20]
    args = (q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), table_tensor.to(DEVICE), lengths.to(DEVICE), 0.3,
            softcap, window)
    shared = decode_kernels.paged_decode_attention(*args, block_n=16, num_splits=1, prefix=prefix)
    plain = decode_kernels.paged_decode_attention(*args, block_n=16, num_splits=1)
    torch.testing.assert_close(shared.cpu(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)


def test_a_shared_prefix_over_an_fp8_cache_is_the_unshared_kernels_result():
    page = 4
    q, k_cache, v_cache, tables, lengths = grouped_inputs([(3, 26)], [13], 4, 2, 16, page, prefix_blocks=4)
    k_fp8, v_fp8 = (QuantizedCache(*quantize(cache.to(DEVICE)), torch.float32) for cache in (k_cache, v_cache))
    q = q.to(DEVICE)
    table_tensor = torch.tensor(tables, dtype=torch.int32, device=DEVICE)
    context = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    prefix = decode_kernels.shared_prefix(tables, lengths, page, DEVICE)
    shared = decode_kernels.paged_decode_attention(q, k_fp8, v_fp8, table_tensor, context, 0.25, block_n=16,
                                                   num_splits=1, prefix=prefix)
    plain = decode_kernels.paged_decode_attention(q, k_fp8, v_fp8, table_tensor, context, 0.25, block_n=16,
                                                  num_splits=1)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    elementwise = decode_kernels.paged_decode_attention(q, k_fp8, v_fp8, table_tensor, context, 0.25, block_n=16,
                                                        num_splits=1, prefix=prefix, elementwise=True)
    torch.testing.assert_close(elementwise, plain, atol=1e-5, rtol=1e-5)


def test_a_shared_prefix_is_for_the_unsplit_kernel():
    page = 4
    q, k_cache, v_cache, tables, lengths = grouped_inputs([(2, 20)], [], 2, 1, 16, page, prefix_blocks=2)
    prefix = decode_kernels.shared_prefix(tables, lengths, page, "cpu")
    with pytest.raises(ValueError, match="unsplit kernel only"):
        decode_kernels.paged_decode_attention(q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
                                              torch.tensor(lengths, dtype=torch.int32), 0.25, num_splits=2,
                                              prefix=prefix)


@pytest.mark.skipif(DEVICE == "cuda", reason="Triton's interpreter on CPU tensors; the engine test below runs on the GPU")
@pytest.mark.parametrize("family", ["gemma2"])  # its full and sliding layers' tables; qwen2 on the GPU
def test_the_samples_of_a_prompt_decode_through_their_shared_blocks_as_generate_does(monkeypatch, family):
    """Four samples of a 37-token prompt share its four whole blocks of 8: every decode step reads them once for the
    four (a Gemma 2 model: its sliding and full layers' tables each); greedy tokens are transformers' and a sampled
    row's log-probs are its forward's."""
    from transformers_reference import hf_greedy, recomputed_log_probs

    from reinforge.models.tiny import build_tiny_causal_lm
    from reinforge.rollout.base import GenerationRequest, SamplingParams
    from reinforge.rollout.native import NativeEngine, triton_kernels

    model = build_tiny_causal_lm(family, vocab_size=128, num_layers=2, seed=3, max_position_embeddings=96,
                                 **({"sliding_window": 16} if family == "gemma2" else {})).eval()
    groups = []
    kernel = triton_kernels.paged_decode_attention

    def recording(*args, **kwargs):
        prefix = kwargs.get("prefix")
        groups.append(None if prefix is None else prefix.members[prefix.members[:, 0] >= 0].tolist())
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_kernels, "paged_decode_attention", recording)
    prompt = torch.randint(0, 128, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=96, block_size=8, max_num_seqs=8, use_triton=True,
                          shared_prefix_decode=True)
    # 4 tokens: 3 decode steps in the interpreter, each reading the shared blocks
    outputs = engine.generate([GenerationRequest(prompt, SamplingParams(n=3, max_tokens=4, temperature=0.8, seed=2)),
                               GenerationRequest(prompt, SamplingParams(max_tokens=4, temperature=0.0))])
    assert any(group and any(len([row for row in members if row >= 0]) >= 3 for members in group)
               for group in groups)  # the samples of the prompt read their blocks as one group
    assert outputs[1][0].token_ids == hf_greedy(model, prompt, 4)
    for sampled in outputs[0]:
        torch.testing.assert_close(torch.tensor(sampled.log_probs),
                                   recomputed_log_probs(model, prompt, sampled.token_ids, 0.8), atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "softcap"),
                         [(12, 2, 128, None), (14, 2, 64, None), (8, 4, 256, 50.0), (32, 32, 96, None)])
def test_shared_prefix_decode_at_the_standard_workloads_shapes_on_gpu(num_heads, num_kv_heads, head_dim, softcap):
    """bf16, pages of 16: 64 prompts of 128 tokens x 8 samples at contexts of 129 to 640 (Qwen2.5-1.5B's, 0.5B's,
    Gemma-2-2B's and Phi-3-mini's heads), against the kernel that reads every sequence's blocks and a float32
    reference."""
    page = 16
    q, k_cache, v_cache, tables, lengths = grouped_inputs([(8, 640)] * 64, [], num_heads, num_kv_heads, head_dim,
                                                          page, prefix_blocks=8)
    lengths = torch.randint(129, 641, (len(lengths),), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    table_tensor = torch.tensor(tables, dtype=torch.int32)
    scale = head_dim**-0.5
    expected = reference(q, k_cache, v_cache, table_tensor, lengths, scale, None, softcap)
    args = [tensor.to("cuda") for tensor in (q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), table_tensor,
                                             lengths)]
    prefix = decode_kernels.shared_prefix(tables, lengths.tolist(), page, "cuda")
    assert prefix is not None and len(prefix.group_prefix_lens) == 64
    shared = decode_kernels.paged_decode_attention(*args, scale, softcap, num_splits=1, prefix=prefix)
    plain = decode_kernels.paged_decode_attention(*args, scale, softcap, num_splits=1)
    torch.testing.assert_close(shared.float().cpu(), expected, atol=2e-2, rtol=2e-2)
    assert (shared.float().cpu() - expected).abs().max() <= (plain.float().cpu() - expected).abs().max() + 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "gemma2", "phi3"])
def test_engine_decodes_a_prompts_samples_through_their_shared_blocks_as_generate_does_on_gpu(family):
    """float32, CUDA graphs on: 8 samples of each of 4 prompts; greedy tokens are transformers' and every sampled
    row's log-probs are its forward's."""
    from transformers_reference import hf_greedy, recomputed_log_probs

    from reinforge.models.tiny import build_tiny_causal_lm
    from reinforge.rollout.base import GenerationRequest, SamplingParams
    from reinforge.rollout.native import NativeEngine

    model = build_tiny_causal_lm(family, vocab_size=128, num_layers=2, seed=3,
                                 max_position_embeddings=256).to("cuda").eval()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (length,), generator=generator).tolist() for length in (40, 64, 77, 129)]
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=256, block_size=16, max_num_seqs=64,
                          shared_prefix_decode=True)
    requests = [GenerationRequest(prompt, SamplingParams(n=8, max_tokens=24, temperature=0.9, seed=index))
                for index, prompt in enumerate(prompts)]
    requests += [GenerationRequest(prompt, SamplingParams(max_tokens=24, temperature=0.0)) for prompt in prompts]
    outputs = engine.generate(requests)
    for prompt, output in zip(prompts, outputs[len(prompts):], strict=True):
        assert output[0].token_ids == hf_greedy(model, prompt, 24)
    for prompt, samples in zip(prompts, outputs[:len(prompts)], strict=True):
        for sample in samples:
            torch.testing.assert_close(torch.tensor(sample.log_probs),
                                       recomputed_log_probs(model, prompt, sample.token_ids, 0.9), atol=1e-4, rtol=0)
    # then a smaller batch: its graph is captured while the group buffers still hold the larger batch's groups
    samples = engine.generate([GenerationRequest(prompts[1], SamplingParams(n=4, max_tokens=24, temperature=0.9,
                                                                            seed=9))])[0]
    for sample in samples:
        torch.testing.assert_close(torch.tensor(sample.log_probs),
                                   recomputed_log_probs(model, prompts[1], sample.token_ids, 0.9), atol=1e-4, rtol=0)
