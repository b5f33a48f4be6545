"""Graphed prefill: the padded layout (CPU) and the graphs against eager prefill steps (GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reinforge.models.tiny import build_tiny_causal_lm
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.native.prefill_graphs import MAX_SEQS, PrefillKey, bucket, pad_prefill


def test_bucket_is_the_smallest_that_holds_the_value():
    assert bucket(1, (128, 512)) == 128
    assert bucket(128, (128, 512)) == 128
    assert bucket(129, (128, 512)) == 512
    assert bucket(513, (128, 512)) is None


def step(seq_lens, context_lens):
    """A packed step: sequence i's new tokens are the last seq_lens[i] of its context; slots 1000 * (i + 1) + position."""
    token_ids, positions, slots, context_slots = [], [], [], []
    for index, (length, context) in enumerate(zip(seq_lens, context_lens, strict=True)):
        token_ids += [7 + index] * length
        positions += list(range(context - length, context))
        slots += [1000 * (index + 1) + p for p in range(context - length, context)]
        context_slots += [1000 * (index + 1) + p for p in range(context)]
    return [np.array(values, dtype=np.int64) for values in (token_ids, positions, slots)], np.array(context_slots)


def test_pad_prefill_lays_out_the_step_for_its_graph():
    (token_ids, positions, slots), context_slots = step([3, 5], [10, 5])
    padded = pad_prefill(token_ids, positions, [slots], [3, 5], [context_slots], [10, 5], spare_slots=[99])
    assert padded.key == PrefillKey(tokens=128, queries=128, contexts=4096, num_pools=1)
    assert padded.num_seqs == 2
    ids, pos, slot = padded.section("token_ids"), padded.section("positions"), padded.section("slots_0")
    rows, context = padded.section("rows"), padded.section("context_slots_0")
    assert len(padded.int64) == padded.key.int64_size == 3 * 128 + MAX_SEQS + 4096
    assert len(context) == 4096 and len(rows) == MAX_SEQS
    assert ids[:8].tolist() == [7, 7, 7, 8, 8, 8, 8, 8] and not ids[8:].any()
    assert pos[:8].tolist() == [7, 8, 9, 0, 1, 2, 3, 4] and not pos[8:].any()
    # padding tokens write their keys and values to the spare slot only
    assert slot[:8].tolist() == slots.tolist() and set(slot[8:].tolist()) == {99}
    # each sequence's logits row is its last token; empty sequences read row 0
    assert rows[:2].tolist() == [2, 7] and not rows[2:].any()
    assert context[:15].tolist() == context_slots.tolist() and set(context[15:].tolist()) == {99}
    cu_q, cu_k = padded.int32[:MAX_SEQS + 1], padded.int32[MAX_SEQS + 1:]
    # the padding tokens belong to no sequence: the offsets stop at the real tokens and contexts
    assert cu_q[:3].tolist() == [0, 3, 8] and set(cu_q[3:].tolist()) == {8}
    assert cu_k[:3].tolist() == [0, 10, 15] and set(cu_k[3:].tolist()) == {15}


def test_pad_prefill_gives_each_pool_its_slots_and_its_spare_block():
    """Two KV pools (full and sliding layers): each pool's new-token and context slots, its padding in its own
    spare slot, the sections side by side without overlap."""
    (token_ids, positions, slots), context_slots = step([3, 5], [10, 5])
    padded = pad_prefill(token_ids, positions, [slots, slots + 50_000], [3, 5],
                         [context_slots, context_slots + 50_000], [10, 5], spare_slots=[99, 77])
    assert padded.key == PrefillKey(tokens=128, queries=128, contexts=4096, num_pools=2)
    sections = padded.key.sections()
    covered = sorted(index for part in sections.values() for index in range(part.start, part.stop))
    assert covered == list(range(padded.key.int64_size)) == list(range(len(padded.int64)))
    for pool, (offset, spare) in enumerate([(0, 99), (50_000, 77)]):
        pool_slots, pool_context = padded.section(f"slots_{pool}"), padded.section(f"context_slots_{pool}")
        assert pool_slots[:8].tolist() == (slots + offset).tolist() and set(pool_slots[8:].tolist()) == {spare}
        assert pool_context[:15].tolist() == (context_slots + offset).tolist()
        assert set(pool_context[15:].tolist()) == {spare}


def test_pad_prefill_buckets_each_dimension():
    (token_ids, positions, slots), context_slots = step([600, 100], [5000, 100])
    padded = pad_prefill(token_ids, positions, [slots], [600, 100], [context_slots], [5000, 100], spare_slots=[0])
    assert padded.key == PrefillKey(tokens=1024, queries=2048, contexts=16384)


@pytest.mark.parametrize("seq_lens, context_lens", [
    ([2049], [2049]),                  # more tokens than the largest token bucket
    ([1] * (MAX_SEQS + 1), [200] * (MAX_SEQS + 1)),  # more sequences than a graph holds
    ([16, 16], [100_000, 40_000]),     # more context than the largest context bucket
])
def test_steps_beyond_every_bucket_run_eagerly(seq_lens, context_lens):
    (token_ids, positions, slots), context_slots = step(seq_lens, context_lens)
    assert pad_prefill(token_ids, positions, [slots], seq_lens, [context_slots], context_lens, spare_slots=[0]) is None


class RecordingGraphs:
    """Stands in for the prefill graphs on the CPU: records each padded step and hands it back to the eager path."""

    capture_seconds = 0.0

    def __init__(self):
        self.steps = []

    def wants(self, key):
        return True

    def run(self, padded, kv_cache):
        self.steps.append(padded)
        return None


def test_a_model_with_several_kv_pools_pads_each_pools_slots_for_its_prefill_graph(tiny):
    """Gemma 2 with a window smaller than the prompts: its full and sliding layers keep separate pools, and each
    graphed prefill step (a first turn, then a turn after a prefix-cache hit) carries both pools' slots, those the
    eager forward of the same step writes and reads, padding in each pool's spare block."""
    model = build_tiny_causal_lm("gemma2", vocab_size=128, num_layers=4, sliding_window=6, seed=3).eval()
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=64, use_triton=False, block_size=2, max_num_seqs=4,
                          num_kv_blocks=64, enable_prefix_caching=True)
    engine.wake_up()
    engine.scheduler.pools[1].allocate(10)  # held: the sliding pool's blocks are then never the full pool's
    runner = engine.runner
    recorder = RecordingGraphs()
    runner._graphs_for_prefill = lambda: recorder
    eager = []
    forward = runner.decoder.forward

    def record_eager(input_ids, positions, kv_cache, meta, **options):
        eager.append([(group.slot_mapping.tolist(), None if group.context_slots is None else group.context_slots.tolist())
                      for group in (meta.per_layer[layers[0]] for layers in runner.layer_groups)])
        return forward(input_ids, positions, kv_cache, meta, **options)

    runner.decoder.forward = record_eager
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    first_prompts = tiny.prompts([13, 9], seed=4)
    first = engine.generate([GenerationRequest(prompt, greedy) for prompt in first_prompts])
    second_prompts = [prompt + samples[0].token_ids + [5, 6, 7] for prompt, samples in zip(first_prompts, first,
                                                                                            strict=True)]
    engine.generate([GenerationRequest(prompt, greedy) for prompt in second_prompts])
    assert engine.counters.prefix_hit_tokens > 0
    assert len(recorder.steps) == 2 and all(step.key.num_pools == 2 for step in recorder.steps)
    prefills = [groups for groups in eager if len(groups[0][0]) > 2]  # decode steps write one slot per sequence
    spares = [spare * 2 for spare in runner.spare_blocks]
    for padded, groups in zip(recorder.steps, prefills, strict=True):
        num_tokens, num_contexts = int(padded.int32[MAX_SEQS]), int(padded.int32[-1])
        for pool, (slots, context_slots) in enumerate(groups):
            pool_slots = padded.section(f"slots_{pool}")
            assert pool_slots[:num_tokens].tolist() == slots and set(pool_slots[num_tokens:].tolist()) == {spares[pool]}
            if context_slots is not None:  # the step after the prefix-cache hit reads the cached keys by slot
                assert padded.section(f"context_slots_{pool}")[:num_contexts].tolist() == context_slots
        assert groups[0] != groups[1]
    assert prefills[1][0][1] is not None


def multi_turn_runs(model: torch.nn.Module, prompts: list[list[int]]) -> list[list]:
    """A multi-turn pattern run three times, with prefill graphs and without (two lists of each round's second
    turns): a prefill shape met once runs eagerly, the second time it is captured (against an eager forward of
    the same inputs), the third time replayed."""
    results = []
    for graphs in (True, False):
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=256, max_num_seqs=16, enable_prefix_caching=True,
                              cuda_graph_batch_sizes=(1, 2, 4, 8, 16) if graphs else ())
        assert engine.runner.packed_prefill_on_device()
        outputs = []
        for _ in range(3):
            first = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=12, temperature=0.0)) for p in prompts])
            second = [p + samples[0].token_ids + [5, 6, 7] for p, samples in zip(prompts, first, strict=True)]
            outputs.append(engine.generate([GenerationRequest(p, SamplingParams(max_tokens=12, temperature=0.0))
                                            for p in second]))
        graphs_used = engine.runner._prefill_graphs
        assert (graphs_used is not None and len(graphs_used._graphs) > 0) == graphs
        results.append(outputs)
        engine.sleep()
    return results


def assert_runs_agree(graphed_runs: list, eager_runs: list, exact: bool) -> None:
    """Every sample's greedy tokens and log-probs equal (exact: float32, log-probs within 1e-4); in bf16, equal
    for at least 4 tokens (a near tie may part them) and log-probs within 5e-2 until they part."""
    for graphed_run, eager_run in zip(graphed_runs, eager_runs, strict=True):
        for graphed, eager in zip(graphed_run, eager_run, strict=True):
            a, b = graphed[0], eager[0]
            common = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y),
                          len(a.token_ids))
            assert common == len(a.token_ids) if exact else common >= 4
            torch.testing.assert_close(torch.tensor(a.log_probs[:common]), torch.tensor(b.log_probs[:common]),
                                       atol=1e-4 if exact else 5e-2, rtol=0)


@pytest.mark.gpu
def test_graphed_prefill_steps_match_eager_ones(tiny):
    model = tiny.build("qwen2", device="cuda").to(torch.bfloat16)
    assert_runs_agree(*multi_turn_runs(model, tiny.prompts([9, 30, 17, 44])), exact=False)


@pytest.mark.gpu
@pytest.mark.parametrize("family, num_layers, dtype", [("gemma2", 4, torch.float32),
                                                       ("gemma3_text", 6, torch.bfloat16)])
def test_graphed_prefill_steps_of_a_model_with_several_kv_pools_match_eager_ones(tiny, family, num_layers, dtype):
    """Full and sliding layers in separate pools, a window (6) smaller than every prompt: prefill graphs are
    captured and replayed (Gemma 2's soft-capped layers through the soft-cap kernels, in float32; Gemma 3's
    through the flash kernel, in bf16), with the eager steps' greedy tokens and log-probs."""
    model = build_tiny_causal_lm(family, vocab_size=128, num_layers=num_layers, sliding_window=6, seed=3)
    model = model.to("cuda", dtype).eval()
    assert len(NativeEngine(model, eos_token_ids=[], max_model_len=256).runner.layer_groups) == 2
    assert_runs_agree(*multi_turn_runs(model, tiny.prompts([9, 30, 17, 44])), exact=dtype == torch.float32)
