"""Prefix caching in the native engine: a trajectory's next turn prefills only its new tokens, with
the same tokens and log-probs as without the cache, under eviction, and never across a weight change."""

from __future__ import annotations

import asyncio

import pytest
import torch

from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.native.block_manager import BlockManager

BLOCK = 8
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, seed=5)


def make_engine(model, **kwargs) -> NativeEngine:
    return NativeEngine(model, eos_token_ids=[], max_model_len=160, block_size=BLOCK,
                        **{"max_num_seqs": 16, **kwargs})


@pytest.fixture(scope="module")
def qwen2(tiny):
    return tiny.build("qwen2", seed=4)


def hits(engine: NativeEngine) -> int:
    return engine.counters.prefix_hit_tokens


def two_turns(engine: NativeEngine, prompts: list[list[int]], tool_tokens: list[list[int]], n: int = 1):
    """Turn 1 from each prompt, then turn 2 from prompt + turn 1 + tool tokens (n samples); both turns' completions."""
    first = engine.generate([GenerationRequest(p, SAMPLED) for p in prompts])
    counts = (engine.counters.prefix_hit_tokens, engine.counters.prefilled_tokens)
    second_prompts = [p + samples[0].token_ids + tool for p, samples, tool in zip(prompts, first, tool_tokens,
                                                                                    strict=True)]
    second = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=n))
                              for p in second_prompts])
    return first, second, second_prompts, counts


def assert_same(a, b):
    for samples_a, samples_b in zip(a, b, strict=True):
        for x, y in zip(samples_a, samples_b, strict=True):
            assert x.token_ids == y.token_ids
            torch.testing.assert_close(torch.tensor(x.log_probs), torch.tensor(y.log_probs), atol=1e-5, rtol=0)


def test_second_turn_prefills_only_new_tokens_with_the_same_samples(qwen2, tiny):
    prompts = tiny.prompts([21, 8, 30])
    tools = tiny.prompts([7, 3, 16], seed=2)
    cached = make_engine(qwen2)
    plain = make_engine(qwen2, enable_prefix_caching=False)
    first_on, second_on, second_prompts, (first_hits, before_prefill) = two_turns(cached, prompts, tools, n=3)
    assert first_hits == 0 and before_prefill == sum(map(len, prompts))  # turn 1 found nothing
    first_off, second_off, *_ = two_turns(plain, prompts, tools, n=3)
    assert_same(first_on, first_off)
    assert_same(second_on, second_off)
    assert hits(plain) == 0
    # turn 1 left (len(prompt) + 12 - 1) tokens' keys and values; its full blocks are reused
    expected = [min((len(p) + 12 - 1) // BLOCK, (len(s) - 1) // BLOCK) * BLOCK
                for p, s in zip(prompts, second_prompts, strict=True)]
    assert hits(cached) == sum(expected) > 0
    assert cached.counters.prefilled_tokens - before_prefill == sum(len(s) for s in second_prompts) - sum(expected)
    assert cached.last_metrics["rollout/prefix_cache_hit_tokens"] == sum(expected)
    assert 0 < cached.last_metrics["rollout/prefix_cache_hit_rate"] < 1
    # and the samples are the model's: log-probs of a plain forward over the whole context
    for prompt, samples in zip(second_prompts, second_on, strict=True):
        for sample in samples:
            expected_log_probs = tiny.recomputed_log_probs(qwen2, prompt, sample.token_ids)
            torch.testing.assert_close(torch.tensor(sample.log_probs), expected_log_probs, atol=1e-5, rtol=0)


def test_async_turns_reuse_their_prefix_while_others_run(qwen2, tiny):
    prompts = tiny.prompts([12, 25, 17, 9])

    def run(engine: NativeEngine) -> list[tuple[list[int], list[float]]]:
        async def trajectory(index: int) -> tuple[list[int], list[float]]:
            context, log_probs = list(prompts[index]), []
            for turn in range(3):
                sampling = SamplingParams(max_tokens=6 + index, temperature=1.0, seed=100 * index + turn)
                completion = (await engine.generate_async(GenerationRequest(context, sampling)))[0]
                await asyncio.sleep(0.001 * index)
                context += completion.token_ids + [turn + 1, 2 * index + 3]  # a tool's reply
                log_probs += completion.log_probs
            return context, log_probs

        async def main():
            return await asyncio.gather(*(trajectory(index) for index in range(len(prompts))))

        return asyncio.run(main())

    cached, plain = make_engine(qwen2), make_engine(qwen2, enable_prefix_caching=False)
    for (context, log_probs), (plain_context, plain_log_probs) in zip(run(cached), run(plain), strict=True):
        assert context == plain_context
        torch.testing.assert_close(torch.tensor(log_probs), torch.tensor(plain_log_probs), atol=1e-5, rtol=0)
    assert hits(cached) > 0 and hits(plain) == 0
    assert cached.counters.prefilled_tokens < plain.counters.prefilled_tokens


def test_eviction_under_few_blocks_keeps_results(qwen2, tiny):
    prompts = tiny.prompts([21, 30, 14, 27, 9, 33])
    tools = tiny.prompts([5, 9, 2, 11, 4, 6], seed=3)
    few = make_engine(qwen2, num_kv_blocks=12)  # 96 slots: turn 1's six trajectories cannot all stay cached
    reference = make_engine(qwen2, enable_prefix_caching=False)
    first_few, second_few, second_prompts, _ = two_turns(few, prompts, tools)
    first_ref, second_ref, *_ = two_turns(reference, prompts, tools)
    assert_same(first_few, first_ref)
    assert_same(second_few, second_ref)
    most = sum(min((len(p) + 11) // BLOCK, (len(s) - 1) // BLOCK) * BLOCK
               for p, s in zip(prompts, second_prompts, strict=True))
    assert 0 < hits(few) < most  # some blocks were evicted, some reused
    manager = few.scheduler.block_manager
    assert manager.num_free_blocks == 12 and len(manager.cached_blocks) <= 12


def test_no_reuse_across_a_weight_change_or_a_sleep(tiny):
    model = tiny.build("qwen2", seed=6)
    prompt = tiny.prompts([26])[0]
    engine = make_engine(model)
    turn = engine.generate([GenerationRequest(prompt, SAMPLED)])[0][0]
    context = prompt + turn.token_ids + [3, 4]
    with torch.no_grad():  # an optimizer step, in place, synced while awake
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    engine.sync_weights(model)
    after_sync = engine.generate([GenerationRequest(context, SAMPLED)])[0][0]
    assert hits(engine) == 0
    fresh = make_engine(model, enable_prefix_caching=False).generate([GenerationRequest(context, SAMPLED)])[0][0]
    assert after_sync.token_ids == fresh.token_ids
    torch.testing.assert_close(torch.tensor(after_sync.log_probs), torch.tensor(fresh.log_probs), atol=1e-5, rtol=0)
    # a sleep drops the cache too (with free_on_sleep=False the KV memory itself is kept)
    for free_on_sleep in (True, False):
        keeper = make_engine(model, free_on_sleep=free_on_sleep)
        keeper.generate([GenerationRequest(context, SAMPLED)])
        keeper.sleep()
        keeper.generate([GenerationRequest(context + [5], SAMPLED)])
        assert hits(keeper) == 0
    # LoRA-style in-place deltas on the engine's copy invalidate it as well
    engine.generate([GenerationRequest(context + [6], SAMPLED)])
    assert hits(engine) > 0  # the same prefix, before the change, is reused
    before = hits(engine)
    engine.add_to_weights([(model.model.layers[0].mlp.down_proj,
                            torch.zeros_like(model.model.layers[0].mlp.down_proj.weight, dtype=torch.float32))])
    engine.generate([GenerationRequest(context + [5], SAMPLED)])
    assert hits(engine) == before


def test_block_manager_registers_evicts_lru_and_resets():
    manager = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    tokens = list(range(11))
    table = manager.allocate(11)
    manager.free(table, tokens, num_written=10, known=[])  # blocks 0, 1 full and written; block 2 partial
    assert len(manager.cached_blocks) == 2 and manager.num_free_blocks == 6
    again = manager.match_prefix(tokens + [11, 12], [])
    assert len(again) == 2
    assert manager.match_prefix(tokens[:8], []) == again[:1]  # the last token is always computed
    assert manager.match_prefix([99] + tokens[1:], []) == []  # a block's key names its whole prefix
    taken = manager.allocate(13, again)
    assert taken[:2] == again and manager.num_free_blocks == 2 and manager.ref_counts[again[0]] == 1
    manager.free(taken)
    other = manager.allocate(4 * 5)  # needs five blocks: four never cached, then the least recently released
    assert len(other) == 5 and len(manager.cached_blocks) == 1
    manager.reset_prefix_cache()
    assert manager.cached_blocks == {} and manager.match_prefix(tokens, []) == [] and manager.num_free_blocks == 1
    manager.free(other, list(range(20)), num_written=19, known=[], epoch=0)  # filled before the reset (epoch 1)
    assert manager.cached_blocks == {} and manager.num_free_blocks == 6


@pytest.mark.parametrize("use_triton", [False, True])
def test_a_prefill_after_a_hit_gives_a_full_prefills_logits(use_triton, tiny):
    # the runner alone, so the Triton path (rope and cache write in Triton, in its interpreter on the CPU) is
    # checked too: same positions and slots from the block table as the PyTorch path
    if use_triton:
        pytest.importorskip("triton")
    from reinforge.rollout.native.model_runner import ModelRunner
    from reinforge.rollout.native.sequence import Sequence

    model = tiny.build("qwen3", seed=2)
    tokens = tiny.prompts([29])[0]
    runner = ModelRunner(model, block_size=BLOCK, max_num_seqs=4, max_model_len=64, use_triton=use_triton,
                         cuda_graph_batch_sizes=[])
    runner.load_weights()
    runner.allocate_kv_cache(16)

    def sequence(token_ids: list[int], blocks: list[int], num_cached: int) -> Sequence:
        seq = Sequence(1, 0, 0, token_ids, SAMPLED, 0, frozenset(), 64)
        seq.block_table, seq.num_cached_tokens = blocks, num_cached
        return seq

    full = runner.prefill([sequence(tokens, [0, 1, 2, 3], 0), sequence(tokens[:20], [4, 5, 6], 0)])
    # the same tokens again, the first two blocks read from the cache (blocks 0, 1), next to a plain prefill
    partial = runner.prefill([sequence(tokens[:9], [7, 8], 0), sequence(tokens, [0, 1, 9, 10], 2 * BLOCK)])
    torch.testing.assert_close(partial[1], full[0], atol=1e-5, rtol=0)
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(partial[1], expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(runner.kv_cache[:, :, 9:11], runner.kv_cache[:, :, 2:4], atol=1e-5, rtol=0)


def test_a_request_that_keeps_no_prefix_registers_no_blocks(qwen2, tiny):
    """keep_prefix=False (the single-turn training step): its blocks are freed, not cached, so nothing hits."""
    prompt = tiny.prompts([30])[0]
    engine = make_engine(qwen2)
    turn = engine.generate([GenerationRequest(prompt, SAMPLED, keep_prefix=False)])[0][0]
    assert not engine.scheduler.block_manager.cached_blocks
    engine.generate([GenerationRequest(prompt + turn.token_ids + [5], SAMPLED)])
    assert hits(engine) == 0


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 2)])
def test_packed_prefix_attention_equals_the_padded_reference(heads):
    """Each sequence's whole context gathered by slot, unpadded, causal from its end: the reference's result."""
    from reinforge.rollout.native.attention import (
        AttentionMetadata,
        packed_prefix_attention,
        prefill_attention_with_prefix,
    )

    num_heads, kv_heads = heads
    generator = torch.Generator().manual_seed(3)
    block, dim, num_blocks = 4, 16, 24
    k_cache, v_cache = torch.randn(2, num_blocks, block, kv_heads, dim, generator=generator)
    prefixes, news = [8, 0, 13, 4], [3, 5, 1, 9]  # cached tokens before each sequence's packed ones
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for prefix, new in zip(prefixes, news, strict=True):
        tables.append([free.pop() for _ in range(-(-(prefix + new) // block))])
    contexts = [p + n for p, n in zip(prefixes, news, strict=True)]
    width = max(map(len, tables))
    q = torch.randn(sum(news), num_heads, dim, generator=generator)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0), is_prefill=True, seq_lens=news,
        batch_index=torch.repeat_interleave(torch.arange(len(news)), torch.tensor(news)),
        token_index=torch.cat([torch.arange(n) for n in news]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        context_lens=torch.tensor(contexts, dtype=torch.int32), prefix_lens=torch.tensor(prefixes),
        max_context_len=max(contexts),
        context_slots=torch.cat([torch.tensor(t)[torch.arange(c) // block] * block + torch.arange(c) % block
                                 for t, c in zip(tables, contexts, strict=True)]), context_lengths=contexts,
        cu_seqlens_q=torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, *torch.tensor(contexts).cumsum(0).tolist()], dtype=torch.int32))
    expected = prefill_attention_with_prefix(q, k_cache, v_cache, meta, dim ** -0.5)
    torch.testing.assert_close(packed_prefix_attention(q, k_cache, v_cache, meta, dim ** -0.5), expected)


def test_the_packed_prefix_path_gives_the_same_samples(qwen2, tiny):
    """The model runner's slots and offsets for the packed path, end to end: turn 2 over cached turn-1 blocks
    samples the same tokens and log-probs through it as through the padded reference."""
    prompts = tiny.prompts([21, 8, 30])
    tools = tiny.prompts([7, 3, 16], seed=2)
    reference = make_engine(qwen2)
    packed = make_engine(qwen2)
    packed.runner.decoder.flash_prefix = True  # the CUDA choice, here through the packed path's CPU branch
    _, second_reference, *_ = two_turns(reference, prompts, tools, n=2)
    _, second_packed, *_ = two_turns(packed, prompts, tools, n=2)
    assert hits(packed) > 0 and not reference.runner.decoder.flash_prefix
    assert_same(second_packed, second_reference)
