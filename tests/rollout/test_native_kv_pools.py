"""The native engine's KV blocks: per-layer-group pools and preemption.

Models whose sliding layers sit beside full ones (Gemma 2, Gemma 3, Qwen2 with ``max_window_layers``) keep one
cache and block pool per window: with a window smaller than the sequence, greedy tokens are generate's and
log-probs a transformers forward's within 1e-5 while the sliding pool gives back the blocks behind its window, also
through preemption under a tiny pool and prefix-cache hits. Preempted sequences resume with generate's tokens, and a
sequence re-admitted into its old row decodes through its new blocks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from reinforge.models.tiny import build_tiny_causal_lm
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.native.block_manager import RELEASED
from reinforge.rollout.native.model_runner import layer_groups
from reinforge.rollout.native.sequence import Sequence

sys.path.insert(0, str(Path(__file__).parents[1]))
from transformers_reference import hf_greedy, recomputed_log_probs  # noqa: E402

WINDOW = 6
GROUPED = [("gemma2", 4), ("gemma3_text", 6), ("qwen2", 4)]
"""Tiny models whose sliding layers (window WINDOW) sit beside full ones, and their layer counts."""


def tiny_model(family: str, window: int | None = None, num_layers: int = 4) -> torch.nn.Module:
    return build_tiny_causal_lm(family, vocab_size=128, num_layers=num_layers, sliding_window=window, seed=3).eval()


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (length,), generator=generator).tolist() for length in lengths]


def make_engine(model: torch.nn.Module, **options) -> NativeEngine:
    options = {"block_size": 4, "max_num_seqs": 8, "num_kv_blocks": 64, **options}
    return NativeEngine(model, eos_token_ids=[], max_model_len=64, use_triton=False, **options)


@pytest.mark.parametrize("num_kv_blocks", [11, 13])
def test_a_decode_step_behind_a_readmitted_sequence_lists_each_sequence_once(num_kv_blocks):
    """Sequences preempted while the others decode are prefilled again behind a step in flight; the decode step
    launched behind that prefill holds each sequence once, and every sample is generate's."""
    model = tiny_model("llama")
    engine = make_engine(model, block_size=2, num_kv_blocks=num_kv_blocks)
    greedy = SamplingParams(n=4, max_tokens=16, temperature=0.0)
    [prompt] = prompts([6], seed=8)
    [samples] = engine.generate([GenerationRequest(prompt, greedy)])
    assert engine.last_metrics["rollout/num_preempted"] > 0
    expected = hf_greedy(model, prompt, 16)
    assert [completion.token_ids for completion in samples] == [expected] * 4


def test_a_sequence_readmitted_into_its_old_row_decodes_through_its_new_blocks():
    """A preempted sequence that gets its old row back (no other row was freed meanwhile) with other blocks: the
    runner's block-table row is rewritten, not kept from before."""
    engine = make_engine(tiny_model("llama", num_layers=1), block_size=2, num_kv_blocks=8,
                         enable_prefix_caching=False)
    engine.wake_up()
    scheduler, runner = engine.scheduler, engine.runner
    seq = Sequence(scheduler.new_seq_id(), 0, 0, [1, 2, 3], SamplingParams(max_tokens=4), 0, frozenset(), 64)
    scheduler.add(seq)
    scheduler.schedule_prefill()
    row, blocks = seq.row, list(seq.block_table)
    runner._decode_inputs([seq], lookahead=0)  # the runner records the row's blocks
    scheduler._preempt(seq)
    held = scheduler.block_manager.allocate(2 * len(blocks))  # another sequence takes the blocks it gave back
    scheduler.schedule_prefill()
    assert seq.row == row and set(seq.block_table).isdisjoint(blocks)
    inputs = runner._decode_inputs([seq], lookahead=0)
    assert inputs["block_tables"][0, :len(seq.block_table)].tolist() == seq.block_table
    scheduler.block_manager.free(held)


def test_a_sequence_that_outgrows_the_whole_cache_is_refused_in_one_line():
    """A sequence alone needs more blocks than the cache has: it preempts itself and the engine says so, naming the
    blocks, rather than launching an empty decode step."""
    engine = make_engine(tiny_model("llama", num_layers=1), block_size=2, num_kv_blocks=4)
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    with pytest.raises(RuntimeError, match=r"needs \d+ KV blocks but the cache has 4; raise gpu_memory_utilization"):
        engine.generate([GenerationRequest(prompts([5])[0], greedy)])


@pytest.mark.parametrize("family, length, n, message", [
    ("llama", 9, 1, r"a sequence of 9 tokens with n=1 needs 5 KV blocks but the cache has 4; raise"),
    ("llama", 5, 2, r"a sequence of 5 tokens with n=2 needs 4 KV blocks but the cache has 3; raise"),
    ("gemma2", 9, 1, r"needs 5 KV blocks but the cache has 4 \(the full-attention layers' pool\)"),
])
def test_a_request_the_cache_can_never_admit_is_refused_before_anything_runs(family, length, n, message):
    """A prompt whose blocks (with a copy of its last, partial one for each further sample) outnumber a pool: refused
    at submission, with the requests beside it; the engine then serves the next
    batch rather than failing at the same waiting sequence at every step."""
    model = tiny_model(family, WINDOW if family == "gemma2" else None, num_layers=2)
    engine = make_engine(model, block_size=2, num_kv_blocks=4 if length == 9 else 3)
    good = GenerationRequest(prompts([2])[0], SamplingParams(max_tokens=2, temperature=0.0))
    with pytest.raises(ValueError, match=message):
        engine.generate([good, GenerationRequest(prompts([length])[0], SamplingParams(max_tokens=1, n=n, seed=1))])
    (completion,), = engine.generate([good])
    assert completion.token_ids == hf_greedy(model, good.prompt_token_ids, 2)


def test_layers_group_by_window_only_when_full_and_sliding_layers_mix():
    assert layer_groups([None, None, None]) == [[0, 1, 2]]
    assert layer_groups([8, 8, 8]) == [[0, 1, 2]]
    assert layer_groups([8, 4, 8]) == [[0, 1, 2]]  # every layer slides: one pool, released behind the widest window
    assert layer_groups([6, None, 6, None]) == [[1, 3], [0, 2]]
    assert layer_groups([512, 512, None, 1024, None]) == [[2, 4], [0, 1], [3]]


def test_a_model_with_one_window_keeps_one_pool_and_one_cache_tensor():
    engine = make_engine(tiny_model("llama", num_layers=2))
    engine.wake_up()
    assert engine.scheduler.group_managers == () and isinstance(engine.runner.kv_cache, torch.Tensor)
    assert engine.runner.kv_cache.shape[0] == 2


def held_blocks(engine: NativeEngine) -> list[tuple[int, list[int]]]:
    """Wraps the scheduler's ``finish`` to record, as each sequence finishes (before it hands its blocks back), how
    many blocks it holds in the full pool and in each other pool (the list returned fills as it runs)."""
    scheduler = engine.scheduler
    record: list[tuple[int, list[int]]] = []
    original = scheduler.finish

    def finish(finished):
        for seq in finished:
            record.append((len([block for block in seq.block_table if block != RELEASED]),
                           [len([block for block in table if block != RELEASED]) for table in seq.group_tables]))
        original(finished)

    scheduler.finish = finish
    return record


@pytest.mark.parametrize("family, num_layers", GROUPED)
def test_sliding_layers_give_blocks_back_while_tokens_are_generates(family, num_layers):
    model = tiny_model(family, WINDOW, num_layers)
    engine = make_engine(model, block_size=2)
    engine.wake_up()
    assert [manager.sliding_window for manager in engine.scheduler.pools] == [None, WINDOW]
    record = held_blocks(engine)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    batch = prompts([13, 5, 21], seed=3)
    completions = engine.generate([GenerationRequest(prompt, greedy) for prompt in batch])
    for prompt, (completion,) in zip(batch, completions, strict=True):
        assert completion.token_ids == hf_greedy(model, prompt, 24)
    # the window's keys span at most WINDOW / 2 + 1 blocks of 2, and the full layers keep every block
    assert sorted(full for full, _ in record) == [-(-(length + 23) // 2) for length in (5, 13, 21)]
    assert all(0 < group[0] <= -(-WINDOW // 2) + 1 for _, group in record), record


@pytest.mark.parametrize("family, num_layers", GROUPED[:2])
def test_sampled_log_probs_through_layer_groups_are_a_transformers_forwards(family, num_layers):
    model = tiny_model(family, WINDOW, num_layers)
    engine = make_engine(model, block_size=2)
    sampling = SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=7)
    batch = prompts([13, 19], seed=2)
    completions = engine.generate([GenerationRequest(prompt, sampling) for prompt in batch])
    for prompt, samples in zip(batch, completions, strict=True):
        for sample in samples:
            expected = recomputed_log_probs(model, prompt, sample.token_ids)
            torch.testing.assert_close(torch.tensor(sample.log_probs), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_under_a_tiny_pool_with_layer_groups_resumes_as_generate_continues(prefix_caching):
    model = tiny_model("gemma2", WINDOW)
    engine = make_engine(model, block_size=2, num_kv_blocks=14, enable_prefix_caching=prefix_caching)
    greedy = SamplingParams(n=4, max_tokens=20, temperature=0.0)
    [prompt] = prompts([8], seed=8)
    [samples] = engine.generate([GenerationRequest(prompt, greedy)])
    assert engine.last_metrics["rollout/num_preempted"] > 0
    assert [completion.token_ids for completion in samples] == [hf_greedy(model, prompt, 20)] * 4


def test_a_prefix_cache_hit_takes_the_prefix_from_every_pool():
    model = tiny_model("gemma3_text", WINDOW, 6)
    engine = make_engine(model, block_size=2, enable_prefix_caching=True)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    first_prompt = prompts([17], seed=4)[0]
    (first,), = engine.generate([GenerationRequest(first_prompt, greedy)])
    second_prompt = first_prompt + first.token_ids + prompts([3], seed=5)[0]
    hits_before = engine.counters.prefix_hit_tokens
    (second,), = engine.generate([GenerationRequest(second_prompt, greedy)])
    assert engine.counters.prefix_hit_tokens > hits_before
    assert second.token_ids == hf_greedy(model, second_prompt, 8)
    torch.testing.assert_close(torch.tensor(second.log_probs), recomputed_log_probs(model, second_prompt, second.token_ids),
                               atol=1e-5, rtol=0)


def test_the_sliding_pool_is_no_larger_than_its_windows_need():
    """num_kv_blocks sizes the full layers' pool; the sliding layers' pool gets no more than one full-length
    sequence (with the token a decode step launched ahead writes) plus every other sequence's window and block
    being filled."""
    engine = NativeEngine(tiny_model("gemma2", WINDOW), eos_token_ids=[], max_model_len=64, use_triton=False,
                          block_size=2, max_num_seqs=4, num_kv_blocks=100)
    engine.wake_up()
    full, sliding = [manager.num_blocks for manager in engine.scheduler.pools]
    assert (full, sliding) == (100, 33 + 3 * (3 + 2))
    assert [cache.shape[2] for cache in engine.runner.kv_caches] == [101, sliding + 1]


@pytest.mark.gpu
@pytest.mark.parametrize("family, num_layers", GROUPED)
def test_on_the_gpu_layer_groups_through_kernels_and_graphs_equal_transformers(family, num_layers):
    """float32 through the Triton kernels and decode graphs (each group's tables and slots static inputs, padding
    rows in each group's spare block), a pool small enough to preempt: generate's tokens, the sliding pool holding
    its window's blocks."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = tiny_model(family, WINDOW, num_layers).cuda()
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, block_size=2, max_num_seqs=8, num_kv_blocks=40)
    assert engine.runner.decoder.use_triton and engine.runner.cuda_graph_batch_sizes
    engine.wake_up()
    record = held_blocks(engine)
    greedy = SamplingParams(n=3, max_tokens=24, temperature=0.0)
    batch = prompts([13, 21], seed=3)
    completions = engine.generate([GenerationRequest(prompt, greedy) for prompt in batch])
    assert engine.last_metrics["rollout/num_preempted"] > 0
    for prompt, samples in zip(batch, completions, strict=True):
        input_ids = torch.tensor([prompt], device="cuda")
        expected = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=24,
                                  min_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert [sample.token_ids for sample in samples] == [expected[0, len(prompt):].tolist()] * 3
    assert all(0 < group[0] <= -(-WINDOW // 2) + 1 for _, group in record), record


def test_a_cache_of_given_bytes_holds_more_full_layer_blocks_when_sliding_layers_need_fewer():
    """kv_cache_bytes (the memory planner's size) split between the pools: the sliding pool takes what its windows
    can use and the full pool the rest, more blocks than the same bytes give a single pool."""
    model = tiny_model("gemma2", WINDOW)
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, use_triton=False, block_size=2, max_num_seqs=4)
    per_block = engine.runner.kv_bytes_per_block()  # every layer's bytes; each group has half the layers
    engine.kv_cache_bytes = 60 * per_block
    engine.wake_up()
    assert [manager.num_blocks for manager in engine.scheduler.pools] == [120 - 48, 48]
    assert sum(cache.numel() * cache.element_size() for cache in engine.runner.kv_caches) <= 62 * per_block
    single = NativeEngine(tiny_model("llama"), eos_token_ids=[], max_model_len=64, use_triton=False, block_size=2,
                          max_num_seqs=4, kv_cache_bytes=60 * per_block)
    single.wake_up()
    assert single.scheduler.block_manager.num_blocks == 60 * per_block // single.runner.kv_bytes_per_block()


def test_a_sequence_that_outgrows_a_pool_is_refused_naming_the_pool():
    engine = make_engine(tiny_model("gemma2", WINDOW), block_size=2, num_kv_blocks=6)
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    with pytest.raises(RuntimeError, match=r"needs \d+ KV blocks but the cache has 6 \(the full-attention layers' pool\)"):
        engine.generate([GenerationRequest(prompts([5])[0], greedy)])


def test_block_metrics_count_every_pool():
    """kv_blocks_total and kv_blocks_used_peak add up the full and the sliding pool; the peak share is the fullest
    pool's, read at the same points as the engine reads its peaks (before sequences that finished hand blocks back)."""
    model = tiny_model("gemma2", WINDOW)
    engine = make_engine(model, block_size=2, num_kv_blocks=40)
    engine.wake_up()
    pools = engine.scheduler.pools
    used, full_used, shares = [], [], []
    original = engine.scheduler.finish

    def finish(finished):
        used.append(sum(manager.num_used_blocks for manager in pools))
        full_used.append(pools[0].num_used_blocks)
        shares.append(max(manager.num_used_blocks / manager.num_blocks for manager in pools))
        original(finished)

    engine.scheduler.finish = finish
    greedy = SamplingParams(n=2, max_tokens=20, temperature=0.0)
    engine.generate([GenerationRequest(prompt, greedy) for prompt in prompts([13, 5], seed=6)])
    metrics = engine.last_metrics
    assert [manager.sliding_window for manager in pools] == [None, WINDOW]
    assert metrics["rollout/kv_blocks_total"] == pools[0].num_blocks + pools[1].num_blocks
    assert metrics["rollout/kv_blocks_used_peak"] == max(used) > max(full_used)
    assert metrics["rollout/kv_blocks_used_peak_share"] == pytest.approx(max(shares))


@pytest.mark.parametrize(("family", "window"), [("llama", None), ("gemma2", WINDOW)])
def test_a_cache_that_fits_only_a_layer_at_a_time_runs_as_one_tensor_does(monkeypatch, family, window):
    """The device's free memory in pieces (cached segments partly in use after a training step): the one tensor
    of a layer group's cache fails to allocate, each layer's tensor is allocated instead, and preemption,
    copy-on-write of shared blocks and the prefix cache run on it as on one tensor."""
    zeros = torch.zeros

    def no_room_for_all_layers(*shape, **kwargs):
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if len(dims) == 6:  # (layers, 2, blocks, block size, KV heads, head dim): every layer's cache at once
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 61.51 GiB")
        return zeros(*shape, **kwargs)

    model = tiny_model(family, window)
    monkeypatch.setattr(torch, "zeros", no_room_for_all_layers)
    engine = make_engine(model, block_size=2, num_kv_blocks=14, enable_prefix_caching=True)
    greedy = SamplingParams(n=4, max_tokens=20, temperature=0.0)
    [prompt] = prompts([8], seed=8)
    [samples] = engine.generate([GenerationRequest(prompt, greedy)])
    monkeypatch.setattr(torch, "zeros", zeros)
    assert all(isinstance(cache, list) for cache in engine.runner.kv_caches)
    assert engine.last_metrics["rollout/num_preempted"] > 0
    assert [completion.token_ids for completion in samples] == [hf_greedy(model, prompt, 20)] * 4
    [again] = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=20, temperature=0.0))])
    assert again[0].token_ids == samples[0].token_ids
