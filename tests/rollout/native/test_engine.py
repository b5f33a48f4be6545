"""NativeEngine on the CPU against transformers: greedy equality, log-probs, batching, the entry points."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
import transformers

from reinforge.rollout.base import GenerationRequest, RolloutEngine, SamplingParams
from reinforge.rollout.native import NativeEngine, supports_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
LENGTHS = [3, 17, 16, 40, 9]


@pytest.fixture(scope="module")
def qwen2(tiny):
    return tiny.build("qwen2")


def make_engine(model, **kwargs) -> NativeEngine:
    return NativeEngine(model, eos_token_ids=kwargs.pop("eos_token_ids", []), max_model_len=128, block_size=8,
                        **{"max_num_seqs": 16, **kwargs})


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "llama"])
def test_greedy_matches_generate_and_log_probs_match_a_forward(architecture, tiny):
    model = tiny.build(architecture)
    prompts = tiny.prompts(LENGTHS)
    engine = make_engine(model)
    assert isinstance(engine, RolloutEngine) and supports_model(model)
    completions = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=12, temperature=0.0, n=2))
                                   for p in prompts])
    for prompt, samples in zip(prompts, completions, strict=True):
        reference = tiny.hf_greedy(model, prompt, 12)
        assert [sample.token_ids for sample in samples] == [reference, reference]
        assert samples[0].finish_reason == "length"
        expected = tiny.recomputed_log_probs(model, prompt, reference)
        torch.testing.assert_close(torch.tensor(samples[0].log_probs), expected, atol=1e-5, rtol=0)


def test_sampled_log_probs_are_under_the_tempered_distribution(qwen2, tiny):
    prompts = tiny.prompts([5, 20])
    sampling = SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9, n=3, seed=0)
    completions = make_engine(qwen2).generate([GenerationRequest(p, sampling) for p in prompts])
    for prompt, samples in zip(prompts, completions, strict=True):
        assert len({tuple(sample.token_ids) for sample in samples}) > 1
        for sample in samples:
            expected = tiny.recomputed_log_probs(qwen2, prompt, sample.token_ids, temperature=0.7)
            torch.testing.assert_close(torch.tensor(sample.log_probs), expected, atol=1e-5, rtol=0)


def test_more_sequences_than_slots_and_preemption_keep_greedy_results(qwen2, tiny):
    prompts = tiny.prompts([5, 30, 12, 7, 22, 3])
    references = [tiny.hf_greedy(qwen2, prompt, 20) for prompt in prompts]
    sampling = SamplingParams(max_tokens=20, temperature=0.0)
    few_slots = make_engine(qwen2, max_num_seqs=2)
    assert [c[0].token_ids for c in few_slots.generate([GenerationRequest(p, sampling) for p in prompts])] == references
    few_blocks = make_engine(qwen2, num_kv_blocks=10)  # 80 token slots for 6 sequences of up to 50 tokens
    completions = few_blocks.generate([GenerationRequest(p, sampling) for p in prompts])
    assert [c[0].token_ids for c in completions] == references
    assert few_blocks.last_metrics["rollout/num_preempted"] > 0
    assert few_blocks.scheduler.block_manager.num_free_blocks == 10


def test_a_request_of_more_samples_than_slots_runs_them_in_groups_with_the_same_tokens(qwen2, tiny):
    """n=9 on an engine of 4 sequence slots (a validation's rollout.val_kwargs.n past what the trainer sized the
    engine for): three groups of 4, 4 and 1, each sample seeded by its own index, so the completions are an engine
    with room's; synchronous and through generate_async."""
    prompts = tiny.prompts([5, 11])
    requests = [GenerationRequest(prompts[0], SamplingParams(max_tokens=8, temperature=1.0, n=9, seed=3)),
                GenerationRequest(prompts[1], SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=4))]
    roomy = [[c.token_ids for c in samples] for samples in make_engine(qwen2).generate(requests)]
    few_slots = make_engine(qwen2, max_num_seqs=4)
    assert [[c.token_ids for c in samples] for samples in few_slots.generate(requests)] == roomy
    assert len({tuple(tokens) for tokens in roomy[0]}) > 1  # the samples differ: each has its own seed

    async def both():
        return await asyncio.gather(*(few_slots.generate_async(request) for request in requests))

    assert [[c.token_ids for c in samples] for samples in asyncio.run(both())] == roomy


def test_top_k_one_is_greedy_and_seeds_reproduce(qwen2, tiny):
    prompts = tiny.prompts([4, 11])
    engine = make_engine(qwen2)
    greedy = engine.generate([GenerationRequest(p, GREEDY) for p in prompts])
    top1 = engine.generate([GenerationRequest(p, SamplingParams(max_tokens=12, top_k=1, seed=1)) for p in prompts])
    assert [c[0].token_ids for c in top1] == [c[0].token_ids for c in greedy]

    def sample(seed, order):
        sampling = SamplingParams(max_tokens=12, temperature=1.0, n=2, seed=seed)
        return engine.generate([GenerationRequest(prompts[i], sampling) for i in order])

    first, again, reordered, other = sample(5, [0, 1]), sample(5, [0, 1]), sample(5, [1, 0]), sample(6, [0, 1])
    tokens = [[c.token_ids for c in samples] for samples in first]
    assert tokens == [[c.token_ids for c in samples] for samples in again]
    assert tokens == [[c.token_ids for c in samples] for samples in reversed(reordered)]
    assert tokens != [[c.token_ids for c in samples] for samples in other]


def test_stop_tokens_max_tokens_and_ignore_eos(qwen2, tiny):
    prompt = tiny.prompts([6])[0]
    reference = tiny.hf_greedy(qwen2, prompt, 12)
    stop = reference[4]
    first_stop = reference.index(stop)
    engine = make_engine(qwen2, eos_token_ids=[stop])
    eos_stopped = engine.generate([GenerationRequest(prompt, GREEDY)])[0][0]
    assert eos_stopped.token_ids == reference[:first_stop + 1] and eos_stopped.finish_reason == "stop"
    assert len(eos_stopped.log_probs) == len(eos_stopped.token_ids)
    ignored = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                                        ignore_eos=True))])[0][0]
    assert ignored.token_ids == reference and ignored.finish_reason == "length"
    plain = make_engine(qwen2)
    stopped = plain.generate([GenerationRequest(prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                                       stop_token_ids=(stop,)))])[0][0]
    assert stopped.token_ids == eos_stopped.token_ids and stopped.finish_reason == "stop"
    short = plain.generate([GenerationRequest(prompt, SamplingParams(max_tokens=3, temperature=0.0))])[0][0]
    assert short.token_ids == reference[:3] and short.finish_reason == "length"
    metrics = plain.last_metrics
    assert metrics["rollout/num_generated_tokens"] == 3
    assert metrics["rollout/tokens_per_s"] == pytest.approx(3 / metrics["rollout/time_s"])


def test_async_requests_join_mid_flight(qwen2, tiny):
    prompts = tiny.prompts([8, 15, 5])
    engine = make_engine(qwen2)
    finished: list[str] = []

    async def one(name: str, prompt: list[int], max_tokens: int) -> list[int]:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        samples = await engine.generate_async(GenerationRequest(prompt, sampling))
        finished.append(name)
        return samples[0].token_ids

    async def after_long_started(name: str, prompt: list[int], max_tokens: int) -> tuple[int, list[int]]:
        while not (engine.scheduler and engine.scheduler.running and engine.scheduler.running[0].num_generated >= 2):
            await asyncio.sleep(0.001)
        long_progress = engine.scheduler.running[0].num_generated
        return long_progress, await one(name, prompt, max_tokens)

    async def main():
        return await asyncio.gather(one("long", prompts[0], 100), after_long_started("short", prompts[1], 3),
                                    after_long_started("medium", prompts[2], 10))

    long_tokens, (progress, short_tokens), (_, medium_tokens) = asyncio.run(main())
    assert long_tokens == tiny.hf_greedy(qwen2, prompts[0], 100)
    assert short_tokens == tiny.hf_greedy(qwen2, prompts[1], 3)
    assert medium_tokens == tiny.hf_greedy(qwen2, prompts[2], 10)
    assert 2 <= progress < 100 - 10  # they joined while the long one was generating ...
    assert finished[-1] == "long"  # ... and did not wait for it
    assert not engine.scheduler.has_unfinished
    assert engine.last_metrics["rollout/num_generated_tokens"] == 113


def test_sleep_frees_the_cache_and_sync_weights_sees_updates(tiny):
    model = tiny.build("qwen2", seed=3)
    prompt = tiny.prompts([10])[0]
    engine = make_engine(model)
    engine.wake_up()
    assert engine.runner.kv_cache is not None
    before = engine.generate([GenerationRequest(prompt, GREEDY)])[0][0].token_ids
    engine.sleep()
    assert engine.runner.kv_cache is None and not engine.is_awake
    with torch.no_grad():  # an optimizer step, in place
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    engine.sync_weights(model)
    after = engine.generate([GenerationRequest(prompt, GREEDY)])[0][0].token_ids
    assert after == tiny.hf_greedy(model, prompt, 12) and after != before


def test_a_later_round_with_other_prompts_uses_its_own_block_tables(tiny):
    # the scheduler of each wake-up numbers sequences from 1: in round 2, sequence 1 has as many blocks
    # as round 1's sequence 1 ended with (4), but other ones; the runner must not reuse the old row
    model = tiny.build("qwen2", seed=3)
    engine = make_engine(model)
    engine.generate([GenerationRequest(p, GREEDY) for p in tiny.prompts([20, 20], seed=1)])
    engine.sleep()
    second = tiny.prompts([25], seed=2)
    assert engine.generate([GenerationRequest(second[0], GREEDY)])[0][0].token_ids == tiny.hf_greedy(model, second[0], 12)


@pytest.mark.parametrize("first_round_tokens, num_later_requests", [
    ([12], 1),  # round 1's last decode steps ran at the version of round 2's: greedy parameters, same rows
    ([2, 12], 3),  # round 1's last steps had one row (at version 3), round 2's steps at version 3 have three
])
def test_a_later_round_samples_with_its_own_parameters(qwen2, tiny, first_round_tokens, num_later_requests):
    # each wake-up's scheduler counts versions from 0; the decode steps' parameters are kept by version
    engine = make_engine(qwen2)
    prompts = tiny.prompts([10, 6, 13], seed=4)
    engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=tokens, temperature=0.0))
                     for prompt, tokens in zip(prompts, first_round_tokens, strict=False)])
    engine.sleep()
    later = [GenerationRequest(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=index))
             for index, prompt in enumerate(prompts[:num_later_requests])]
    assert engine.generate(later) == make_engine(qwen2).generate(later)


ROUNDS = [  # each round's requests: (prompt length, sampling); None marks a round whose third decode step fails
    [(20, GREEDY), (20, SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=(5, 9)))],
    None,
    [(25, SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=1, top_k=5, num_top_log_probs=2)),
     (6, SamplingParams(max_tokens=2, temperature=0.0))],
    [(13, SamplingParams(max_tokens=9, temperature=0.7, n=2, seed=2, top_p=0.9, min_p=0.05)), (31, GREEDY),
     (4, SamplingParams(max_tokens=1, temperature=1.0, seed=3))],
]


def failing_at_third_call(decode):
    """``decode`` raising at its third call, as a decode step that fails mid-generation (out of memory, say)."""
    calls = []

    def failing_decode(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("decode failed")
        return decode(*args, **kwargs)

    return failing_decode


@pytest.mark.parametrize("architecture, options", [
    ("qwen2", {}),
    ("qwen2", {"free_on_sleep": False, "enable_prefix_caching": False, "num_kv_blocks": 8}),  # kept cache, preemption
    ("gemma3_text", {}),  # a sliding layer group beside the full one
])
def test_every_round_generates_what_a_fresh_engine_does(tiny, architecture, options):
    # rounds of other requests, one failing mid-generation and abandoned, weights changing between some: each
    # round's tokens and log-probs are a fresh engine's on the same weights (no round leaves state to the next)
    model = tiny.build(architecture, seed=5)
    engine = make_engine(model, **options)
    decode = engine.runner.decode
    failing_decode = failing_at_third_call(decode)

    for index, requests in enumerate(ROUNDS):
        if requests is None:
            engine.runner.decode = failing_decode
            with pytest.raises(RuntimeError, match="decode failed"):
                engine.generate([GenerationRequest(p, SamplingParams(max_tokens=8, n=3, seed=4))
                                 for p in tiny.prompts([9, 17], seed=9)])
            engine.runner.decode = decode
            engine.sleep(abandon=True)
            continue
        if index == 2:
            with torch.no_grad():  # an optimizer step, in place
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter) * 0.05)
            engine.sync_weights(model)
        batch = [GenerationRequest(prompt, sampling)
                 for prompt, (_, sampling) in zip(tiny.prompts([length for length, _ in requests], seed=index),
                                                  requests, strict=True)]
        completions = engine.generate(batch)
        engine.sleep()
        assert completions == make_engine(model, **options).generate(batch), f"round {index}"


def test_subclasses_of_supported_models_are_supported(tiny):
    class MyQwen2(transformers.Qwen2ForCausalLM):
        def describe(self) -> str:
            return "a wrapper adding methods"

    base = tiny.build("qwen2")
    model = MyQwen2(base.config)
    assert supports_model(model)


def test_unsupported_models_are_refused():
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    assert not supports_model(model)
    with pytest.raises(ValueError, match="hf rollout backend"):
        NativeEngine(model, eos_token_ids=[0], max_model_len=64)


def test_requests_longer_than_the_model_length_are_refused(qwen2):
    engine = make_engine(qwen2)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([GenerationRequest(list(range(128)), GREEDY)])


@pytest.mark.parametrize("prompt_length, max_tokens, expected", [(124, 4, 4), (124, 5, 4), (127, 12, 1)])
def test_samples_end_where_prompt_and_sample_fill_max_model_len(qwen2, tiny, prompt_length, max_tokens, expected):
    # prompt + max_tokens at max_model_len and past it: the sample ends at max_model_len, finish_reason 'length'
    prompt = tiny.prompts([prompt_length])[0]
    (completion,), = make_engine(qwen2).generate([GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens,
                                                                                          temperature=0.0))])
    assert completion.finish_reason == "length"
    assert completion.token_ids == tiny.hf_greedy(qwen2, prompt, expected)


@pytest.mark.parametrize("bad_id", [-1, 128])
def test_prompt_ids_outside_the_vocabulary_are_refused_before_anything_runs(qwen2, tiny, bad_id):
    # the whole batch is refused (the good request before the bad one is not left queued), and the engine still
    # serves the next batch
    engine = make_engine(qwen2)
    good = tiny.prompts([5])[0]
    with pytest.raises(ValueError, match=rf"prompt token id {bad_id}, outside the model's vocabulary \[0, 128\)"):
        engine.generate([GenerationRequest(good, GREEDY), GenerationRequest([3, bad_id, 4], GREEDY)])
    (completion,), = engine.generate([GenerationRequest(good, GREEDY)])
    assert completion.token_ids == tiny.hf_greedy(qwen2, good, 12)
    assert engine.counts()["rollout/prefill_tokens"] == len(good)


def test_the_vocabulary_bound_reads_an_embedding_that_lora_wraps(tiny):
    # peft's LoRA embedding has no num_embeddings: the bound is its weight's rows
    peft = pytest.importorskip("peft")
    model = tiny.build("qwen2")
    peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]))
    engine = make_engine(model)
    assert engine.vocab_size == 128
    with pytest.raises(ValueError, match=r"prompt token id 128, outside the model's vocabulary \[0, 128\)"):
        engine.generate([GenerationRequest([3, 128], GREEDY)])


@pytest.mark.parametrize("option, message", [
    ({"temperature": -1.0}, r"temperature=-1.0, which must be a finite number >= 0"),
    ({"temperature": float("nan")}, r"temperature=nan, which must be a finite number >= 0"),
    ({"top_p": 0.0}, r"top_p=0.0, which must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p=1.5, which must be in \(0, 1\]"),
    ({"min_p": 2.0}, r"min_p=2.0, which must be in \[0, 1\]"),
    ({"num_top_log_probs": -1}, r"num_top_log_probs=-1, which must be at least 0"),
])
def test_sampling_options_out_of_range_are_refused(qwen2, option, message):
    # a negative temperature samples the least likely tokens and min_p above 1 leaves no token to sample: each is
    # one line naming the option, before anything runs
    engine = make_engine(qwen2)
    with pytest.raises(ValueError, match=message):
        engine.generate([GenerationRequest([1, 2, 3], SamplingParams(max_tokens=2, **option))])


def test_a_stop_string_or_stop_id_alone_or_in_a_list_is_taken_as_a_tuple_of_them(qwen2):
    # vLLM's stop="###": not its characters, each a stop string; lists (hashable once tuples) work on both engines
    from reinforge.models.tiny import build_char_tokenizer
    from reinforge.rollout.hf import HFEngine

    tokenizer = build_char_tokenizer()
    sampling = SamplingParams(max_tokens=12, temperature=0.7, top_k=5, seed=7)
    for engine in (make_engine(qwen2, tokenizer=tokenizer),
                   HFEngine(qwen2, pad_token_id=0, eos_token_ids=[], tokenizer=tokenizer)):
        [[free]] = engine.generate([GenerationRequest([5, 6, 7], sampling)])
        absent = "zzz" + tokenizer.decode(free.token_ids)[4]  # its last character is in the text, the whole is not
        for stop in (absent, [absent]):
            [[sample]] = engine.generate([GenerationRequest([5, 6, 7], dataclasses.replace(sampling, stop=stop))])
            assert (sample.token_ids, sample.finish_reason) == (free.token_ids, "length")
        stop_id = free.token_ids[2]
        for stop_ids in (stop_id, [stop_id]):
            [[sample]] = engine.generate([GenerationRequest([5, 6, 7],
                                                            dataclasses.replace(sampling, stop_token_ids=stop_ids))])
            assert sample.token_ids == free.token_ids[:free.token_ids.index(stop_id) + 1]
            assert sample.finish_reason == "stop"
        with pytest.raises(ValueError, match=r"stop=\('###', ''\) with an empty string, which every text holds"):
            engine.generate([GenerationRequest([5, 6, 7], dataclasses.replace(sampling, stop=["###", ""]))])


def test_seeded_samples_are_the_hf_backends(qwen2, tiny):
    # both backends draw with rollout.noise: the same seed gives the same tokens (float32, the same logits
    # up to rounding), for prompts of several lengths (the hf backend pads them to the left)
    from reinforge.rollout.hf import HFEngine

    prompts = tiny.prompts([5, 19, 11])
    sampling = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, n=3, seed=1234, ignore_eos=True)
    requests = [GenerationRequest(p, dataclasses.replace(sampling, seed=1234 + i)) for i, p in enumerate(prompts)]
    native = make_engine(qwen2).generate(requests)
    hf = HFEngine(qwen2, pad_token_id=0, eos_token_ids=[]).generate(requests)
    assert [[s.token_ids for s in samples] for samples in native] == [[s.token_ids for s in samples] for samples in hf]
    assert len({tuple(s.token_ids) for s in native[0]}) > 1
    for native_samples, hf_samples in zip(native, hf, strict=True):
        for a, b in zip(native_samples, hf_samples, strict=True):
            torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5, rtol=0)


def test_a_failed_generation_keeps_its_error_and_the_engine_recovers(qwen2, tiny, monkeypatch):
    # a decode step that fails mid-generation (an out-of-memory error, say): the worker's cleanup,
    # sleep(abandon=True), drops the unfinished requests instead of raising over the real error
    prompts = tiny.prompts([10, 12])
    engine = make_engine(qwen2)
    decode = engine.runner.decode
    failing_decode = failing_at_third_call(decode)

    monkeypatch.setattr(engine.runner, "decode", failing_decode)
    with pytest.raises(RuntimeError, match="decode failed"):
        engine.generate([GenerationRequest(p, GREEDY) for p in prompts])
    with pytest.raises(RuntimeError, match="still generating"):
        engine.sleep()
    engine.sleep(abandon=True)
    assert engine.runner.kv_cache is None and not engine.is_awake
    monkeypatch.setattr(engine.runner, "decode", decode)
    again = engine.generate([GenerationRequest(p, GREEDY) for p in prompts])
    assert [samples[0].token_ids for samples in again] == [tiny.hf_greedy(qwen2, p, 12) for p in prompts]


def test_a_driver_step_after_sleep_finds_nothing_to_run(qwen2, tiny):
    # the async driver's thread may step once more after the last request's future resolved and its caller
    # put the engine to sleep
    engine = make_engine(qwen2)
    request = GenerationRequest(tiny.prompts([6])[0], SamplingParams(max_tokens=3, temperature=0.0))
    asyncio.run(engine.generate_async(request))
    engine.sleep()
    assert engine._step(batch_arrivals=True) is False


def test_sleep_refuses_while_a_submitted_request_waits_for_admission(qwen2, tiny):
    # a request submitted (as generate_async's driver does) and not yet admitted would otherwise run after the sleep,
    # in the next round; once its caller gives up (aborted), the engine sleeps and the next round is a fresh one's
    prompts = tiny.prompts([6, 9])
    engine = make_engine(qwen2)
    engine.wake_up()
    waiting = engine._submit(GenerationRequest(prompts[0], SamplingParams(max_tokens=3, temperature=0.0)))
    with pytest.raises(RuntimeError, match="still generating"):
        engine.sleep()
    engine._abort(waiting)
    engine.sleep()
    assert not engine.is_awake
    samples = engine.generate([GenerationRequest(prompts[1], GREEDY)])
    assert len(samples) == 1 and samples[0][0].token_ids == tiny.hf_greedy(qwen2, prompts[1], 12)


def test_no_requests_give_no_completions_without_waking_the_engine(qwen2):
    engine = make_engine(qwen2)
    assert engine.generate([]) == []
    assert not engine.is_awake and engine.runner.kv_cache is None and engine.runner.decoder.weights is None
