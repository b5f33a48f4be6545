"""Graphed prefill: the padded layout (CPU) and the graphs against eager prefill steps (GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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
    padded = pad_prefill(token_ids, positions, slots, [3, 5], context_slots, [10, 5], spare_slot=99)
    assert padded.key == PrefillKey(tokens=128, queries=128, contexts=4096)
    assert padded.num_seqs == 2
    tokens = padded.key.tokens
    ids, pos, slot = padded.int64[:tokens], padded.int64[tokens:2 * tokens], padded.int64[2 * tokens:3 * tokens]
    rows = padded.int64[3 * tokens:3 * tokens + MAX_SEQS]
    context = padded.int64[3 * tokens + MAX_SEQS:]
    assert len(context) == 4096
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


def test_pad_prefill_buckets_each_dimension():
    (token_ids, positions, slots), context_slots = step([600, 100], [5000, 100])
    padded = pad_prefill(token_ids, positions, slots, [600, 100], context_slots, [5000, 100], spare_slot=0)
    assert padded.key == PrefillKey(tokens=1024, queries=2048, contexts=16384)


@pytest.mark.parametrize("seq_lens, context_lens", [
    ([2049], [2049]),                  # more tokens than the largest token bucket
    ([1] * (MAX_SEQS + 1), [200] * (MAX_SEQS + 1)),  # more sequences than a graph holds
    ([16, 16], [100_000, 40_000]),     # more context than the largest context bucket
])
def test_steps_beyond_every_bucket_run_eagerly(seq_lens, context_lens):
    (token_ids, positions, slots), context_slots = step(seq_lens, context_lens)
    assert pad_prefill(token_ids, positions, slots, seq_lens, context_slots, context_lens, spare_slot=0) is None


@pytest.mark.gpu
def test_graphed_prefill_steps_match_eager_ones(tiny):
    # a multi-turn pattern run three times: a prefill shape met once runs eagerly, the second time it is
    # captured (against an eager forward of the same inputs), the third time replayed
    model = tiny.build("qwen2", device="cuda").to(torch.bfloat16)
    prompts = tiny.prompts([9, 30, 17, 44])
    results = []
    for graphs in (True, False):
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=256, max_num_seqs=16, enable_prefix_caching=True,
                              cuda_graph_batch_sizes=(1, 2, 4, 8, 16) if graphs else ())
        assert engine.runner.decoder.flash_prefix
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
    for graphed_run, eager_run in zip(*results, strict=True):
        for graphed, eager in zip(graphed_run, eager_run, strict=True):
            a, b = graphed[0], eager[0]
            common = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y),
                          len(a.token_ids))
            assert common >= 4  # bf16 may part ways at a near tie, not at once
            torch.testing.assert_close(torch.tensor(a.log_probs[:common]), torch.tensor(b.log_probs[:common]),
                                       atol=5e-2, rtol=0)
