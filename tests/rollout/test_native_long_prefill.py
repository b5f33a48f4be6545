"""Chunked prefill: a prefill longer than max_prefill_chunk_tokens runs in forwards over the cache of the earlier
chunks, and samples what one forward does (and what transformers does)."""

from __future__ import annotations

import pytest
import torch

from reinforge.models.tiny import build_tiny_causal_lm
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine
from reinforge.rollout.native.model_runner import ModelRunner, prefill_chunks


def test_prefill_chunks_cover_every_token_once_in_order_within_the_budget():
    starts, stops = [0, 4, 0], [10, 5, 3]
    chunks = prefill_chunks(starts, stops, 4)
    assert all(sum(stop - start for _, start, stop in chunk) <= 4 for chunk in chunks)
    pieces = [piece for chunk in chunks for piece in chunk]
    assert pieces == [(0, 0, 4), (0, 4, 8), (0, 8, 10), (1, 4, 5), (2, 0, 1), (2, 1, 3)]
    assert [len(chunk) for chunk in chunks] == [1, 1, 3, 1]
    assert prefill_chunks(starts, stops, 14) == [[(0, 0, 10), (1, 4, 5), (2, 0, 3)]]
    assert prefill_chunks(starts, stops, None) == prefill_chunks(starts, stops, 10**9)


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (length,), generator=generator).tolist() for length in lengths]


def run(model, requests, chunk: int | None, monkeypatch=None, **engine_kwargs):
    forwards = []
    if monkeypatch is not None:
        forward = ModelRunner._prefill_forward

        def counting(self, seqs, starts, stops):
            forwards.append(sum(stop - start for start, stop in zip(starts, stops, strict=True)))
            return forward(self, seqs, starts, stops)

        monkeypatch.setattr(ModelRunner, "_prefill_forward", counting)
    engine = NativeEngine(model, eos_token_ids=[], max_model_len=96, block_size=4, max_num_seqs=8,
                          max_prefill_chunk_tokens=chunk, **engine_kwargs)
    outputs = engine.generate(requests)
    if monkeypatch is not None:
        monkeypatch.undo()
    return outputs, forwards


@pytest.mark.parametrize(("family", "window"), [("qwen2", None), ("mistral", 6)])
def test_chunked_prefill_samples_what_one_forward_does(family, window, monkeypatch):
    """Prompts of 37, 5 and 23 tokens in chunks of 7 (chunks that end mid-block and straddle prompts; a window
    smaller than a chunk): the same greedy tokens and sampled log-probs as one forward, and as transformers."""
    model = build_tiny_causal_lm(family, vocab_size=128, num_layers=2, sliding_window=window, seed=3,
                                 max_position_embeddings=128).eval()
    batch = prompts([37, 5, 23])
    requests = [GenerationRequest(p, SamplingParams(max_tokens=6, temperature=0.0)) for p in batch] + \
        [GenerationRequest(batch[0], SamplingParams(max_tokens=6, temperature=0.9, seed=4))]
    chunked, forwards = run(model, requests, 7, monkeypatch)
    whole, _ = run(model, requests, None)
    assert max(forwards) <= 7 and sum(forwards) >= 37 + 5 + 23
    for got, expected in zip(chunked, whole, strict=True):
        assert got[0].token_ids == expected[0].token_ids
        torch.testing.assert_close(torch.tensor(got[0].log_probs), torch.tensor(expected[0].log_probs),
                                   atol=1e-5, rtol=0)
    with torch.no_grad():
        input_ids = torch.tensor([batch[0] + chunked[0][0].token_ids])
        logits = model(input_ids).logits[0, len(batch[0]) - 1:-1]
    assert chunked[0][0].token_ids == logits.argmax(-1).tolist()


def test_chunked_prefill_after_a_prefix_cache_hit():
    """A second turn that starts with the first's tokens prefills only its new tokens, still in chunks."""
    model = build_tiny_causal_lm("qwen2", vocab_size=128, num_layers=2, seed=5, max_position_embeddings=128).eval()
    first, extra = prompts([30, 25], seed=2)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    results = []
    for chunk in (6, None):
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=96, block_size=4, max_num_seqs=4,
                              max_prefill_chunk_tokens=chunk)
        turn = engine.generate([GenerationRequest(first, greedy)])[0][0]
        second = first + turn.token_ids + extra
        results.append(engine.generate([GenerationRequest(second, greedy)])[0][0])
        assert engine.counts()["rollout/prefix_cache_hit_tokens"] > 0
    assert results[0].token_ids == results[1].token_ids
    torch.testing.assert_close(torch.tensor(results[0].log_probs), torch.tensor(results[1].log_probs), atol=1e-5,
                               rtol=0)


def test_a_chunk_budget_below_one_token_is_refused():
    model = build_tiny_causal_lm("qwen2", vocab_size=128, num_layers=1, max_position_embeddings=64)
    with pytest.raises(ValueError, match="max_prefill_chunk_tokens=0 must be at least 1"):
        NativeEngine(model, eos_token_ids=[], max_model_len=64, max_prefill_chunk_tokens=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefill_of_an_8k_prompt_on_gpu(dtype):
    """An 8k prompt in chunks of 2,048 (bf16: the flash prefix kernel, graphed where it fits) samples as one
    forward does: float32 greedy tokens equal and log-probs within 1e-4; bf16 first log-probs within rounding
    (a near tie may pick the other token, whose log-prob is then as close)."""
    model = build_tiny_causal_lm("qwen2", vocab_size=128, num_layers=2, seed=3,
                                 max_position_embeddings=8192 + 64).to("cuda", dtype).eval()
    prompt = prompts([8000], seed=9)[0]
    outputs = []
    for chunk in (2048, None):
        engine = NativeEngine(model, eos_token_ids=[], max_model_len=8192 + 64, max_num_seqs=4,
                              max_prefill_chunk_tokens=chunk)
        outputs.append(engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=4,
                                                                                 temperature=0.0))])[0][0])
        engine.sleep()
    chunked, whole = outputs
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    assert abs(chunked.log_probs[0] - whole.log_probs[0]) < tolerance
    if dtype == torch.float32:
        assert chunked.token_ids == whole.token_ids


def test_the_config_refuses_a_chunk_budget_below_one_token():
    from reinforge.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"rollout.max_prefill_chunk_tokens=0 must be a positive token count"):
        load_config(None, ["rollout.max_prefill_chunk_tokens=0"])
    assert load_config(None, ["rollout.max_prefill_chunk_tokens=4096"]).rollout.max_prefill_chunk_tokens == 4096
