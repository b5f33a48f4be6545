"""The sampler on hand-made logits: truncation thresholds, greedy, min-p, seeds and log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from reinforge.rollout.base import SamplingParams
from reinforge.rollout.native.sampling import Sampler, SamplingTensors, truncation_thresholds
from reinforge.rollout.native.sequence import Sequence

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0]])


def params_for(sampling: SamplingParams, rows: int = 1, position: int = 10) -> SamplingTensors:
    seqs = [Sequence(i, 0, i, [1] * position, sampling, request_seed=sampling.seed or 0, stop_token_ids=frozenset(),
                     max_model_len=1000) for i in range(rows)]
    params = SamplingTensors.from_sequences(seqs, torch.device("cpu"))
    params.positions = torch.full((rows,), position, dtype=torch.int64)
    return params


def test_thresholds_of_top_k_and_top_p():
    logits = LOGITS.repeat(3, 1)
    thresholds = truncation_thresholds(logits, top_k=torch.tensor([2, 0, 0]), top_p=torch.tensor([1.0, 0.5, 0.8]))
    probs = torch.softmax(LOGITS[0], 0)  # sorted: 3.0 (0.57), 2.0 (0.21), 1.0, ...
    assert thresholds[0] == 2.0  # two largest kept
    assert thresholds[1] == 3.0  # the top token alone holds more than half the mass
    assert probs[4] < 0.8 and thresholds[2] == 2.0


def test_top_k_one_and_min_p_one_are_greedy():
    sampler = Sampler(use_triton=False)
    for sampling in (SamplingParams(temperature=1.0, top_k=1, seed=3), SamplingParams(temperature=2.0, min_p=1.0)):
        tokens, log_probs = sampler(LOGITS.repeat(4, 1), params_for(sampling, rows=4))
        assert tokens.tolist() == [4, 4, 4, 4]
        expected = torch.log_softmax(LOGITS[0] / sampling.temperature, 0)[4]
        torch.testing.assert_close(log_probs, expected.repeat(4))


def test_greedy_log_prob_is_raw_log_softmax():
    tokens, log_probs = Sampler(use_triton=False)(LOGITS, params_for(SamplingParams(temperature=0.0)))
    assert tokens.tolist() == [4]
    assert math.isclose(log_probs.item(), torch.log_softmax(LOGITS[0], 0)[4].item(), rel_tol=1e-6)


def test_seed_reproduces_and_min_p_truncates():
    sampler = Sampler(use_triton=False)
    flat = torch.zeros(1, 1000)
    flat[0, :10] = 5.0  # ten likely tokens; min_p=0.5 leaves only them
    sampling = SamplingParams(temperature=1.0, min_p=0.5, seed=11)
    first, _ = sampler(flat.repeat(64, 1), params_for(sampling, rows=64))
    second, _ = sampler(flat.repeat(64, 1), params_for(sampling, rows=64))
    assert torch.equal(first, second)
    assert first.max() < 10 and len(set(first.tolist())) > 3  # samples differ by sample index
    other, _ = sampler(flat.repeat(64, 1), params_for(SamplingParams(temperature=1.0, min_p=0.5, seed=12), rows=64))
    assert not torch.equal(first, other)


def test_sampling_follows_the_tempered_distribution():
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    sampling = SamplingParams(temperature=0.5, seed=5)
    tokens, log_probs = Sampler(use_triton=False)(logits.repeat(4000, 1), params_for(sampling, rows=4000))
    frequencies = torch.bincount(tokens, minlength=4).float() / 4000
    expected = torch.softmax(logits[0] / 0.5, 0)
    assert (frequencies - expected).abs().max() < 0.03
    torch.testing.assert_close(log_probs, torch.log_softmax(logits[0] / 0.5, 0)[tokens])


def test_top_k_past_the_vocabulary_keeps_it_all_and_top_p_reads_the_ties_top_k_kept():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0, 0.0, 1.0, -0.5]]) / 1.5  # ids 1 and 6 tie at the 3rd logit
    assert truncation_thresholds(logits, top_k=torch.tensor([100]), top_p=torch.tensor([1.0]))[0] <= logits.min()
    # top-k 3 keeps 4 tokens (the tie); over them the top token holds 0.49 < 0.5, so top-p 0.5 keeps token 0 too
    kept = torch.softmax(logits[0][logits[0] >= logits[0, 1]], 0)
    assert kept.numel() == 4 and kept.max() < 0.5
    threshold = truncation_thresholds(logits, top_k=torch.tensor([3]), top_p=torch.tensor([0.5]))[0]
    assert threshold == logits[0, 0]


def test_a_temperature_whose_inverse_overflows_samples_the_argmax():
    # 1 / 1e-40 is inf in float32: the tempered logits were inf and nan, the log-probs nan
    sampler = Sampler(use_triton=False)
    for temperature in (1e-40, 1e-45, 1e-30):
        tokens, log_probs = sampler(LOGITS.repeat(4, 1), params_for(SamplingParams(temperature=temperature, seed=2),
                                                                     rows=4))
        assert tokens.tolist() == [4, 4, 4, 4] and log_probs.tolist() == [0.0] * 4
        top_values, top_ids = sampler.top_log_probs(LOGITS, params_for(SamplingParams(temperature=temperature,
                                                                                      num_top_log_probs=2)))
        assert top_ids[0, 0] == 4 and top_values[0, 0] == 0.0 and top_values[0, 1] < -1e29


def test_parameters_of_another_row_count_are_refused():
    # the kernel reads each row's parameters by row index: fewer would be read past their end on the device
    with pytest.raises(RuntimeError, match="sampling parameters of 2 rows"):
        Sampler(use_triton=False)(LOGITS.repeat(3, 1), params_for(SamplingParams(temperature=1.0), rows=2))
