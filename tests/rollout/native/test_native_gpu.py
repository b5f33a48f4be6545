"""The native engine on a GPU: Triton kernels and CUDA graphs against transformers' generate."""

from __future__ import annotations

import pytest
import torch

from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "llama"])
def test_greedy_matches_generate_on_gpu(architecture, tiny):
    model = tiny.build(architecture, device="cuda")
    prompts = tiny.prompts([3, 17, 16, 40, 90, 5])
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=192, max_num_seqs=16)
    assert engine.runner.decoder.use_triton
    completions = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=24, temperature=0.0, n=2))
                                   for p in prompts])
    for prompt, samples in zip(prompts, completions, strict=True):
        reference = tiny.hf_greedy(model, prompt, 24)
        assert samples[0].token_ids == reference
        assert samples[1].token_ids == reference
        expected = tiny.recomputed_log_probs(model, prompt, samples[0].token_ids)
        torch.testing.assert_close(torch.tensor(samples[0].log_probs), expected, atol=1e-4, rtol=0)
    engine.sleep()
    assert engine.runner.kv_cache is None


@pytest.mark.gpu
def test_seeded_sampling_reproducible_on_gpu(tiny):
    model = tiny.build("qwen2", device="cuda")
    prompts = tiny.prompts([5, 30])
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=128, max_num_seqs=16)
    sampling = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=20, n=3, seed=7)
    first = engine.generate([GenerationRequest(p, sampling) for p in prompts])
    second = engine.generate([GenerationRequest(p, sampling) for p in reversed(prompts)])
    assert [c.token_ids for c in first[0]] == [c.token_ids for c in second[1]]
    assert len({tuple(c.token_ids) for c in first[0]}) == 3
    expected = tiny.recomputed_log_probs(model, prompts[0], first[0][0].token_ids)
    torch.testing.assert_close(torch.tensor(first[0][0].log_probs), expected, atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_triton_sampler_follows_the_distribution_and_thresholds():
    from reinforge.rollout.native import triton_kernels

    rows, vocab_size = 8192, 300
    logits = torch.randn(vocab_size, device="cuda").repeat(rows, 1).to(torch.bfloat16)
    ones = torch.full((rows,), 2.0, device="cuda")  # temperature 0.5
    no_greedy = torch.zeros(rows, dtype=torch.int32, device="cuda")
    minus_inf = torch.full((rows,), float("-inf"), device="cuda")
    seeds = torch.arange(rows, device="cuda", dtype=torch.int64)
    positions = torch.full((rows,), 7, device="cuda", dtype=torch.int64)
    tokens, log_probs = triton_kernels.sample(logits, ones, no_greedy, minus_inf, seeds, positions)
    expected = torch.softmax(logits[0].float() * 2.0, 0)
    frequencies = torch.bincount(tokens, minlength=vocab_size).float() / rows
    assert (frequencies - expected).abs().max() < 0.02
    torch.testing.assert_close(log_probs, torch.log_softmax(logits[0].float() * 2.0, 0)[tokens])
    again, _ = triton_kernels.sample(logits, ones, no_greedy, minus_inf, seeds, positions)
    assert torch.equal(tokens, again)
    kth = (logits[0].float() * 2.0).topk(5).values[-1]
    top5, _ = triton_kernels.sample(logits, ones, no_greedy, kth.repeat(rows), seeds, positions)
    assert set(top5.tolist()) == set((logits[0].float() * 2.0).topk(5).indices.tolist())
    greedy, _ = triton_kernels.sample(logits, ones, torch.ones_like(no_greedy), minus_inf, seeds, positions)
    assert (greedy == logits[0].float().argmax()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_cache_on_gpu_gives_the_samples_of_a_full_prefill(tiny, dtype):
    # a second turn reads its first turn's blocks (Triton cache writes, CUDA-graph decode after the hit; in bf16
    # the flash prefix prefill)
    model = tiny.build("qwen2", device="cuda").to(dtype)
    prompts = tiny.prompts([21, 40, 9, 64])
    results = []
    for enable in (True, False):
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=192, max_num_seqs=16, block_size=16,
                              enable_prefix_caching=enable)
        first = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=20, temperature=1.0, seed=3))
                                 for p in prompts])
        second = [p + samples[0].token_ids + [5, 6, 7] for p, samples in zip(prompts, first, strict=True)]
        results.append(engine.generate([GenerationRequest(p, SamplingParams(max_tokens=30, temperature=1.0, seed=4,
                                                                            n=2)) for p in second]))
        assert (engine.counters.prefix_hit_tokens > 0) == enable
        # in bf16 the second turn's prefill ran the flash varlen kernel over the gathered contexts
        assert engine.runner.decoder.flash_prefix == (dtype == torch.bfloat16)
    for cached, plain in zip(*results, strict=True):
        for a, b in zip(cached, plain, strict=True):
            if dtype == torch.float32:
                assert a.token_ids == b.token_ids
            common = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), len(a.token_ids))
            torch.testing.assert_close(torch.tensor(a.log_probs[:common]), torch.tensor(b.log_probs[:common]),
                                       atol=1e-4 if dtype == torch.float32 else 5e-2, rtol=0)


@pytest.mark.gpu
def test_a_model_on_the_cpu_generates_on_the_gpu(tiny):
    # actor.param_offload keeps the trained parameters on the CPU between phases: the engine is told the
    # device, copies the weights there at wake-up and computes the rotary tables where the module is
    model = tiny.build("qwen2")
    prompts = tiny.prompts([7, 30])
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=128, max_num_seqs=16, device=torch.device("cuda"))
    completions = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=16, temperature=0.0)) for p in prompts])
    assert engine.runner.kv_cache.device.type == "cuda"
    for prompt, samples in zip(prompts, completions, strict=True):
        assert samples[0].token_ids == tiny.hf_greedy(model, prompt, 16)
    engine.sleep()
