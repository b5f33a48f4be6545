"""The native engine's KV blocks under pressure: preempted sequences resume with generate's tokens, and a sequence
re-admitted into its old row decodes through its new blocks."""

from __future__ import annotations

import pytest
import torch

from reinforge.models.tiny import build_tiny_causal_lm
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.native.sequence import Sequence


def tiny_model(family: str, window: int | None = None, num_layers: int = 4) -> torch.nn.Module:
    return build_tiny_causal_lm(family, vocab_size=128, num_layers=num_layers, sliding_window=window, seed=3).eval()


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (length,), generator=generator).tolist() for length in lengths]


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt])
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return output[0, len(prompt):].tolist()


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
