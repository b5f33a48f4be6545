import torch

from reinforge.models import build_tiny_causal_lm
from reinforge.rollout.base import GenerationRequest, RolloutEngine, SamplingParams
from reinforge.rollout.hf import HFEngine

EOS = 2


def make_engine(seed: int = 0) -> HFEngine:
    model = build_tiny_causal_lm(vocab_size=64, seed=seed, pad_token_id=0, eos_token_id=EOS)
    return HFEngine(model, pad_token_id=0, eos_token_ids=[EOS])


def test_is_a_rollout_engine():
    assert isinstance(make_engine(), RolloutEngine)


def test_greedy_matches_generate_and_log_probs_match_a_forward_pass():
    engine = make_engine()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20]]
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results = engine.generate([GenerationRequest(p, sampling) for p in prompts])
    model = engine.model.eval()
    for prompt, [completion] in zip(prompts, results, strict=True):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert completion.token_ids == expected
        sequence = torch.tensor([prompt + completion.token_ids])
        logits = model(sequence).logits[0, len(prompt) - 1:-1].float()
        recomputed = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(completion.log_probs), recomputed, atol=1e-4, rtol=1e-4)
        assert completion.finish_reason == "length"


def test_n_samples_seed_and_stop_tokens():
    engine = make_engine()
    sampling = SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=7)
    first = engine.generate([GenerationRequest([5, 6], sampling)])[0]
    again = engine.generate([GenerationRequest([5, 6], sampling)])[0]
    assert len(first) == 3
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    stop_at = first[0].token_ids[2]
    stopped = engine.generate([GenerationRequest([5, 6], SamplingParams(
        max_tokens=12, temperature=1.0, n=1, seed=7, stop_token_ids=(stop_at,)))])[0][0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids[-1] == stop_at and stop_at not in stopped.token_ids[:-1]
    for completion in first:
        assert len(completion.token_ids) == len(completion.log_probs)
        assert all(lp <= 0 for lp in completion.log_probs)
