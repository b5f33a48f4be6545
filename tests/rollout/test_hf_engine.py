import pytest
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


def test_greedy_search_with_n_samples_gives_n_copies_of_the_greedy_sample():
    engine = make_engine()
    [one] = engine.generate([GenerationRequest([5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0))])
    [three] = engine.generate([GenerationRequest([5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0, n=3))])
    assert [sample.token_ids for sample in three] == [one[0].token_ids] * 3
    assert [sample.log_probs for sample in three] == [one[0].log_probs] * 3
    three[0].token_ids.append(1)  # each sample is its own
    assert three[1].token_ids == one[0].token_ids


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


def test_seeded_samples_depend_on_the_seed_alone_and_follow_the_tempered_distribution():
    engine = make_engine(seed=3)
    sampling = SamplingParams(max_tokens=5, temperature=0.8, n=2, seed=11)
    alone = engine.generate([GenerationRequest([5, 6, 7], sampling)])[0]
    other = GenerationRequest([9, 10], SamplingParams(max_tokens=5, temperature=0.8, n=2, seed=12))
    together = engine.generate([other, GenerationRequest([5, 6, 7], sampling)])[1]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert alone[0].token_ids != alone[1].token_ids or len(alone[0].token_ids) < 5

    # the first token of 20,000 samples against softmax(logits / T): sampling noise alone gives a
    # total variation of about 0.022 over these 64 tokens
    many = engine.generate([GenerationRequest([5, 6, 7], SamplingParams(max_tokens=1, temperature=0.8, n=20_000, seed=1,
                                                                         ignore_eos=True))])[0]
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in many]), minlength=64).float()
    with torch.no_grad():
        probs = torch.softmax(engine.model(torch.tensor([[5, 6, 7]])).logits[0, -1].float() / 0.8, -1)
    assert 0.5 * (counts / counts.sum() - probs).abs().sum() < 0.04
    first = many[0]
    torch.testing.assert_close(torch.tensor(first.log_probs[0]), probs[first.token_ids[0]].log(), atol=1e-4, rtol=1e-4)


def test_seeded_top_k_keeps_to_the_k_most_likely_tokens():
    engine = make_engine(seed=4)
    samples = engine.generate([GenerationRequest([5, 6], SamplingParams(max_tokens=1, temperature=1.5, top_k=3, n=200,
                                                                        seed=5, ignore_eos=True))])[0]
    with torch.no_grad():
        top3 = set(engine.model(torch.tensor([[5, 6]])).logits[0, -1].topk(3).indices.tolist())
    drawn = {c.token_ids[0] for c in samples}
    assert drawn <= top3 and len(drawn) > 1


def test_the_models_generation_config_does_not_shape_the_samples(caplog):
    """A checkpoint's generation_config (forced EOS, a repetition penalty, suppressed tokens, its own top-k) is left
    out, and an unset rollout top-k keeps every token: with equal logits, samples spread over the whole vocabulary."""
    import logging

    model = build_tiny_causal_lm(vocab_size=128, pad_token_id=0, eos_token_id=EOS)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every token equally likely (the head is tied to the embeddings)
    model.generation_config.update(forced_eos_token_id=EOS, repetition_penalty=5.0, suppress_tokens=list(range(3, 100)),
                                   top_k=4)
    with caplog.at_level(logging.INFO, logger="reinforge.rollout.hf"):
        engine = HFEngine(model, pad_token_id=0, eos_token_ids=[EOS])
    assert "generation_config settings forced_eos_token_id=2, repetition_penalty=5.0" in caplog.text
    sampling = SamplingParams(max_tokens=16, temperature=1.0, n=16, ignore_eos=True)
    [samples] = engine.generate([GenerationRequest([5, 6], sampling)])
    tokens = {token for completion in samples for token in completion.token_ids}
    assert len(tokens) > 80 and any(token < 100 for token in tokens)
    torch.testing.assert_close(torch.tensor([lp for c in samples for lp in c.log_probs]),
                               torch.full((16 * 16,), -torch.log(torch.tensor(128.0)).item()), atol=1e-4, rtol=0)
    assert model.generation_config.repetition_penalty == 5.0  # the model's own config is back after the rollout


def test_a_model_that_transformers_cannot_generate_with_is_named_in_one_line():
    engine = make_engine()

    def fails(*args, **kwargs):
        raise ValueError("`get_mask_sizes` can only be called on Attention layers\nmore detail")

    engine.model.generate = fails
    with pytest.raises(RuntimeError, match=r"transformers' generate fails on Qwen2ForCausalLM \(model_type='qwen2', "
                                           r"from model.path's config.json\) in rollout.name=hf \(ValueError: "
                                           r"`get_mask_sizes` can only be called on Attention layers\); set "
                                           r"rollout.name=native") as failed:
        engine.generate([GenerationRequest([5, 6], SamplingParams(max_tokens=2))])
    assert "\n" not in str(failed.value)


def test_unseeded_samples_are_fresh_draws_from_call_to_call():
    """generate runs inside fork_rng, which puts the global generator back after it: requests without a seed get
    theirs from the engine, so two calls (and two prompts) do not repeat one stream."""
    engine = make_engine()
    sampling = SamplingParams(max_tokens=8, temperature=1.0, n=4)
    first = [sample.token_ids for sample in engine.generate([GenerationRequest([5, 6, 7], sampling)])[0]]
    second = [sample.token_ids for sample in engine.generate([GenerationRequest([5, 6, 7], sampling)])[0]]
    assert first != second and len({tuple(ids) for ids in first}) > 1


@pytest.mark.parametrize("prompt, sampling, message", [
    ([5, 64], SamplingParams(max_tokens=2), r"prompt token id 64, outside the model's vocabulary \[0, 64\)"),
    ([-1, 5], SamplingParams(max_tokens=2), r"prompt token id -1, outside the model's vocabulary \[0, 64\)"),
    ([], SamplingParams(max_tokens=2), "an empty prompt"),
    ([5, 6], SamplingParams(max_tokens=2, temperature=-1.0), r"temperature=-1.0, which must be a finite number >= 0"),
    ([5, 6], SamplingParams(max_tokens=2, min_p=2.0), r"min_p=2.0, which must be in \[0, 1\]"),
    ([5, 6], SamplingParams(max_tokens=2, top_p=0.0), r"top_p=0.0, which must be in \(0, 1\]"),
])
def test_prompts_outside_the_vocabulary_and_sampling_out_of_range_are_refused_as_the_native_engine_does(
        prompt, sampling, message):
    # not as transformers' failure (an IndexError named as a model generate cannot run), nor sampled silently
    # (a negative temperature samples the least likely tokens, min_p above 1 always token 0)
    with pytest.raises(ValueError, match=message):
        make_engine().generate([GenerationRequest([5, 6], SamplingParams(max_tokens=2)),
                                GenerationRequest(prompt, sampling)])


def test_the_vocabulary_bound_reads_an_embedding_that_lora_wraps():
    peft = pytest.importorskip("peft")
    engine = make_engine()
    engine.model = peft.get_peft_model(engine.model, peft.LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]))
    assert len(engine.generate([GenerationRequest([5, 63], SamplingParams(max_tokens=2))])[0][0].token_ids) == 2
    with pytest.raises(ValueError, match=r"prompt token id 64, outside the model's vocabulary \[0, 64\)"):
        engine.generate([GenerationRequest([5, 64], SamplingParams(max_tokens=2))])


def test_a_temperature_whose_inverse_overflows_samples_the_argmax():
    # logits / 1e-40 were inf and nan in float32: tokens off the argmax, log-probs nan
    engine = make_engine()
    greedy = engine.generate([GenerationRequest([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0,
                                                                          ignore_eos=True))])[0][0]
    sampled = engine.generate([GenerationRequest([5, 6, 7], SamplingParams(max_tokens=4, temperature=1e-40, seed=1,
                                                                           ignore_eos=True))])[0][0]
    assert sampled.token_ids == greedy.token_ids and sampled.log_probs == [0.0] * 4


HF_ROUNDS = [  # each round's requests: (prompt, sampling); None marks a round interrupted at its third forward
    [([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0)),
     ([9, 10, 11, 12, 13, 14, 15], SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=(7, 9)))],
    None,
    [([20, 21], SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=1, top_k=5, num_top_log_probs=2)),
     ([30], SamplingParams(max_tokens=3, temperature=0.0, num_top_log_probs=1))],
    [([5, 6, 7, 8, 9, 10, 11, 12, 13], SamplingParams(max_tokens=7, temperature=0.7, n=2, seed=2, top_p=0.9,
                                                     min_p=0.05)),
     ([4, 3], SamplingParams(max_tokens=5, temperature=1.3, seed=3, ignore_eos=True))],
]


def test_every_round_generates_what_a_fresh_engine_does():
    # rounds of other requests on one engine, one interrupted midway, the weights changed in place (as the actor's
    # update changes them) before the last: each round's tokens and log-probs are a fresh engine's on those weights
    import copy
    import threading

    from reinforge.rollout.base import GenerationInterrupted

    engine = make_engine(seed=6)
    forward, interrupted, calls = engine.model.forward, threading.Event(), []

    def interrupting_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            interrupted.set()
        return forward(*args, **kwargs)

    for index, requests in enumerate(HF_ROUNDS):
        if requests is None:
            engine.model.forward = interrupting_forward
            with pytest.raises(GenerationInterrupted):
                engine.generate([GenerationRequest([8, 9], SamplingParams(max_tokens=8, n=2, seed=4))], interrupted)
            del engine.model.forward
            continue
        if index == len(HF_ROUNDS) - 1:
            with torch.no_grad():
                for parameter in engine.model.parameters():
                    parameter.add_(torch.randn_like(parameter) * 0.05)
        batch = [GenerationRequest(prompt, sampling) for prompt, sampling in requests]
        fresh = HFEngine(copy.deepcopy(engine.model), pad_token_id=0, eos_token_ids=[EOS])
        assert engine.generate(batch) == fresh.generate(batch), f"round {index}"


def assert_samples_have_each_sequences_own_log_probs(engine: HFEngine, prompts: list[list[int]],
                                                     sampling: SamplingParams) -> None:
    """The engine's samples of ``prompts``, generated in one call, have the log-probs of a forward of each sequence
    alone (float32, within 1e-5)."""
    for prompt, samples in zip(prompts, engine.generate([GenerationRequest(p, sampling) for p in prompts]), strict=True):
        for sample in samples:
            with torch.no_grad():
                logits = engine.model(torch.tensor([prompt + sample.token_ids])).logits[0, len(prompt) - 1:-1].float()
            recomputed = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(sample.log_probs), recomputed, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("family", "cache_implementation"),
                         [("llama", None), ("olmo2", None), ("olmoe", None), ("llama", "static")])
def test_a_window_the_models_masks_never_apply_is_not_applied_to_the_cache_either(family, cache_implementation):
    """Llama, OLMo 2 and OLMoE with a ``sliding_window`` left in their config: their forward attends to every earlier
    token, and transformers' default cache would keep only the window; the samples' log-probs are the forward's. A
    cache its generation_config names (generate refuses it beside a cache passed in) gives way to the full one."""
    model = build_tiny_causal_lm(family, vocab_size=64, seed=0).eval()
    model.config.sliding_window = 4
    model.generation_config.cache_implementation = cache_implementation
    engine = HFEngine(model, pad_token_id=0, eos_token_ids=[EOS])
    prompts = [list(range(3, 15)), list(range(20, 29))]
    for sampling in (SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                     SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=3, ignore_eos=True)):
        assert_samples_have_each_sequences_own_log_probs(engine, prompts, sampling)


LONGROPE_ORIGINAL = 10


def longrope_model(family: str):
    """A tiny model whose rotary embedding is LongRoPE, original length 10 (Phi-3's and PhiMoE's own; a Llama reads it
    from its config), prepared as the actor prepares it: its rotary module picks each sequence's factors by that
    sequence's length (PhiMoE's factors are always the short ones; its long_mscale scales a long sequence's)."""
    from reinforge.engine.fused import prepare_for_training

    factors = 4 if family == "phi3" else 8  # half the rotary dims: Phi-3's tiny models rotate half of each head
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0, 3.0] * (factors // 4),
            "long_factor": [2.0, 4.0, 8.0, 16.0] * (factors // 4), "original_max_position_embeddings": LONGROPE_ORIGINAL}
    if family == "phi3":
        rope["partial_rotary_factor"] = 0.5
    if family == "phimoe":
        rope |= {"short_mscale": 1.0, "long_mscale": 1.2}
    model = build_tiny_causal_lm(family, vocab_size=64, seed=1, max_position_embeddings=40, head_dim=16,
                                 rope_parameters=rope, original_max_position_embeddings=LONGROPE_ORIGINAL).eval()
    with torch.no_grad():  # larger weights than the init's, so that the factors move the log-probs by nats
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.mul_(1.5 / (parameter.std() * parameter.shape[-1] ** 0.5))
    prepare_for_training(model, torch.device("cpu"))
    return model.eval()


@pytest.mark.parametrize("family", ["phi3", "phimoe", "llama"])
def test_a_row_passing_longropes_original_length_is_computed_again_with_the_long_factors(family):
    """LongRoPE takes its long factors at every position once a forward's sequence passes the original length. Each
    token sampled after a row passes it has the log-prob of a forward over the whole sequence (the trainer's), each
    one before it that of a forward over the sequence as it was then. transformers' Phi-3 and PhiMoE drop the cache
    only when the padded width passes the length (not where a shorter, left-padded row does), a Llama never; and
    PhiMoE's forward, wrapped for training (``engine.moe.without_router_logits_output``), must still show generate
    that it takes position_ids, or a left-padded row's positions count its padding and it switches early."""
    model = longrope_model(family)
    engine = HFEngine(model, pad_token_id=0, eos_token_ids=[EOS])
    long, passing = list(range(3, 14)), list(range(20, 26))  # 11 tokens: past the length from the start; 6: at the 5th
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, n=2, seed=3, ignore_eos=True)  # two unpadded rows
    calls = [([long, passing], greedy), ([passing], seeded)]
    for prompts, sampling in calls:
        for prompt, samples in zip(prompts, engine.generate([GenerationRequest(p, sampling) for p in prompts]),
                                   strict=True):
            for sample in samples:
                tokens = sample.token_ids
                with torch.no_grad():
                    whole = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1], -1)
                    then = torch.stack([torch.log_softmax(model(torch.tensor([prompt + tokens[:index]])).logits[0, -1],
                                                          -1) for index in range(len(tokens))])
                before = (torch.arange(len(tokens)) + len(prompt) <= LONGROPE_ORIGINAL)[:, None]
                expected = torch.where(before, then, whole).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
                torch.testing.assert_close(torch.tensor(sample.log_probs), expected, atol=1e-5, rtol=0)


def test_a_model_that_numbers_its_positions_itself_generates_each_prompt_as_if_alone():
    """BART's decoder takes no position ids and numbers positions from a row's first column: prompts of several
    lengths in one call would count their left padding. The samples' log-probs are those of each sequence alone."""
    from transformers import BartConfig, BartForCausalLM

    torch.manual_seed(0)
    model = BartForCausalLM(BartConfig(vocab_size=64, d_model=64, decoder_layers=2, decoder_attention_heads=4,
                                       decoder_ffn_dim=128, encoder_layers=2, encoder_attention_heads=4,
                                       encoder_ffn_dim=128, max_position_embeddings=128, dropout=0.0,
                                       pad_token_id=1)).eval()
    engine = HFEngine(model, pad_token_id=1, eos_token_ids=[EOS])
    prompts = [[5, 6, 7], list(range(9, 20)), [20, 21]]
    for sampling in (SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                     SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=5, ignore_eos=True)):
        assert_samples_have_each_sequences_own_log_probs(engine, prompts, sampling)
