"""LongRoPE and dynamic NTK in packed passes: each sequence's log-probs are those of transformers' forward over it
alone, from a fresh model (dynamic NTK's module keeps the frequencies of its longest forward so far)."""

from __future__ import annotations

import copy

import pytest
import torch

from reinforge.engine.attention import use_varlen_attention
from reinforge.engine.forward import response_log_probs
from reinforge.engine.longrope import sequence_lengths
from reinforge.engine.packing import attach_plan
from reinforge.models.tiny import build_tiny_causal_lm
from reinforge.protocol import Batch
from tests.engine.test_packing import grouped_batch

ORIGINAL = 10
ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0],
        "original_max_position_embeddings": ORIGINAL}


DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
"""Rescaled past max_position_embeddings (ORIGINAL here) to each forward's length."""


def tiny_phi3():
    return build_tiny_causal_lm("phi3", vocab_size=64, num_layers=2, max_position_embeddings=64,
                                rope_parameters=ROPE, original_max_position_embeddings=ORIGINAL, seed=1).eval()


def tiny_dynamic_llama():
    return build_tiny_causal_lm("llama", vocab_size=64, num_layers=2, max_position_embeddings=ORIGINAL,
                                rope_parameters=DYNAMIC, seed=1).eval()


LENGTH_DEPENDENT = {"longrope": tiny_phi3, "dynamic": tiny_dynamic_llama}


def alone(model, batch: Batch) -> torch.Tensor:
    """transformers' forward over each sequence alone (its real tokens, eager attention): response log-probs."""
    width = batch["prompts"].shape[1]
    rows = []
    with torch.no_grad():
        for row in range(batch["input_ids"].shape[0]):
            mask = batch["attention_mask"][row].bool()
            fresh = copy.deepcopy(model)
            log_probs = torch.log_softmax(fresh(batch["input_ids"][row][mask][None]).logits[0].float(), dim=-1)
            num_prompt = int(mask[:width].sum())
            responses = batch["responses"][row][batch["response_mask"][row].bool()]
            picked = log_probs[num_prompt - 1:-1].gather(1, responses[:, None])[:, 0]
            rows.append(torch.cat([picked, picked.new_zeros(batch["responses"].shape[1] - len(picked))]))
    return torch.stack(rows)


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("rope_type", list(LENGTH_DEPENDENT))
def test_packed_sequences_on_both_sides_of_the_original_length_keep_their_own_factors(rope_type, share_prompts):
    model = LENGTH_DEPENDENT[rope_type]()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    use_varlen_attention(model)
    batch = grouped_batch(num_prompts=2, samples=3, prompt_width=6, response_width=7)
    lengths = batch["attention_mask"].sum(-1)
    assert (lengths > ORIGINAL).any() and (lengths <= ORIGINAL).any()
    assert len(set(lengths[lengths > ORIGINAL].tolist())) > 1  # dynamic NTK: several lengths past the original
    micro = attach_plan(Batch(dict(batch.tensors), {}, {}), share_prompts=share_prompts)
    with torch.no_grad():
        log_probs, _ = response_log_probs(model, micro)
    torch.testing.assert_close(log_probs, alone(reference, batch), atol=1e-5, rtol=0)


def test_dynamic_ntk_log_probs_do_not_depend_on_the_micro_batches_before():
    """transformers' dynamic module keeps the frequencies of the longest forward until one fits the original length:
    a micro-batch after a longer one would be scored with the longer one's frequencies."""
    model = tiny_dynamic_llama()
    reference = copy.deepcopy(model)
    use_varlen_attention(model)
    batch = grouped_batch(num_prompts=2, samples=3, prompt_width=6, response_width=7)
    lengths = batch["attention_mask"].sum(-1)
    shorter = batch.index(torch.nonzero((lengths > ORIGINAL) & (lengths < lengths.max()))[:, 0])
    with torch.no_grad():
        for micro in (batch, shorter):
            log_probs, _ = response_log_probs(model, attach_plan(Batch(dict(micro.tensors), {}, {})))
            torch.testing.assert_close(log_probs, alone(reference, micro), atol=1e-5, rtol=0)


def test_sequence_lengths_follow_the_positions():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 3, 4],  # packed: 3, 2, 4 tokens, then a shared response
                              [0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 0]])  # left padding, 4 tokens, right padding
    assert sequence_lengths(positions).tolist() == [[3, 3, 3, 2, 2, 4, 4, 4, 4, 5, 5],
                                                    [1, 1, 4, 4, 4, 4, 1, 1, 1, 1, 1]]
