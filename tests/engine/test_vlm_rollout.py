"""The hf rollout backend on vision-language models: transformers' greedy tokens, and log-probs the packed engine
computes for the same samples."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from reinforge.engine.forward import response_log_probs
from reinforge.engine.packing import attach_plan
from reinforge.models.tiny_vlm import build_tiny_processor
from reinforge.models.vision import vision_tower
from reinforge.protocol import MULTI_MODAL_KEY, Batch
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.hf import HFEngine

sys.path.insert(0, str(Path(__file__).parent))
from test_vlm_packing import vlm, vlm_batch  # noqa: E402

ARCHES = ("qwen2_5_vl", "qwen3_vl")


def requests_of(batch: Batch, sampling: SamplingParams) -> list[GenerationRequest]:
    prompts = batch["prompts"]
    mask = batch["attention_mask"][:, :prompts.shape[1]].bool()
    return [GenerationRequest(prompts[row][mask[row]].tolist(), sampling,
                              multi_modal_inputs=batch[MULTI_MODAL_KEY][row] or None) for row in range(len(batch))]


def sampled_batch(prompts: Batch, completions, pad_id: int) -> Batch:
    """The rollout layout of the samples: [left-padded prompt | right-padded response]."""
    rows = [(row, sample) for row in range(len(prompts)) for sample in completions[row]]
    width = max(len(sample.token_ids) for _, sample in rows)
    responses = torch.full((len(rows), width), pad_id)
    response_mask = torch.zeros(len(rows), width)
    for index, (_, sample) in enumerate(rows):
        responses[index, :len(sample.token_ids)] = torch.tensor(sample.token_ids)
        response_mask[index, :len(sample.token_ids)] = 1
    source = [row for row, _ in rows]
    prompt_ids = prompts["prompts"][source]
    prompt_mask = prompts["attention_mask"][source, :prompt_ids.shape[1]]
    return Batch.from_dict(tensors={"prompts": prompt_ids, "responses": responses, "response_mask": response_mask,
                                    "input_ids": torch.cat([prompt_ids, responses], 1),
                                    "attention_mask": torch.cat([prompt_mask, response_mask.long()], 1)},
                           non_tensors={MULTI_MODAL_KEY: [prompts[MULTI_MODAL_KEY][row] for row in source]})


@pytest.mark.parametrize("arch", ARCHES)
def test_greedy_tokens_are_transformers_and_log_probs_the_packed_engines(arch):
    model, processor = vlm(arch, seed=2), build_tiny_processor(arch)
    prompts = vlm_batch(processor, samples=1)
    pad_id = processor.tokenizer.pad_token_id
    engine = HFEngine(model, pad_token_id=pad_id, eos_token_ids=[processor.tokenizer.eos_token_id])
    sampling = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    completions = engine.generate(requests_of(prompts, sampling))
    for row in range(len(prompts)):  # each prompt alone through transformers' generate, as the processor gives it
        request = requests_of(prompts.index([row]), sampling)[0]
        input_ids = torch.tensor([request.prompt_token_ids])
        images = request.multi_modal_inputs or {}
        alone = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                               mm_token_type_ids=(input_ids == model.config.image_token_id).int(), **images,
                               max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=pad_id)
        assert completions[row][0].token_ids == alone[0, input_ids.shape[1]:].tolist()
    samples = sampled_batch(prompts, completions, pad_id)
    with torch.no_grad():
        log_probs, _ = response_log_probs(model, attach_plan(samples, share_prompts=True))
    rollout = torch.tensor([sample.log_probs for row in completions for sample in row])
    torch.testing.assert_close(log_probs, rollout, rtol=0, atol=1e-4)


def test_seeded_samples_of_a_prompt_with_images_keep_their_seed_and_see_the_images():
    model, processor = vlm("qwen2_5_vl", seed=2), build_tiny_processor("qwen2_5_vl")
    prompts = vlm_batch(processor, samples=1)
    engine = HFEngine(model, pad_token_id=processor.tokenizer.pad_token_id,
                      eos_token_ids=[processor.tokenizer.eos_token_id])
    sampling = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, n=3, seed=7)
    together = engine.generate(requests_of(prompts, sampling))
    alone = [engine.generate(requests_of(prompts.index([row]), sampling))[0] for row in range(len(prompts))]
    assert [[sample.token_ids for sample in row] for row in together] == \
        [[sample.token_ids for sample in row] for row in alone]
    with_images = [row for row in range(len(prompts)) if prompts[MULTI_MODAL_KEY][row]][0]
    request = requests_of(prompts.index([with_images]), sampling)[0]
    other = {key: value.clone() for key, value in request.multi_modal_inputs.items()}
    other["pixel_values"] = -other["pixel_values"]
    changed = engine.generate([GenerationRequest(request.prompt_token_ids, SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True), multi_modal_inputs=other)])[0][0]
    same = engine.generate([GenerationRequest(request.prompt_token_ids, SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True), multi_modal_inputs=request.multi_modal_inputs)])[0][0]
    assert changed.log_probs != same.log_probs


@pytest.mark.parametrize("arch, sampling", [
    ("qwen2_5_vl", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, n=2)),
    ("qwen2_5_vl", SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, n=3, seed=7)),
    ("qwen3_vl", SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, n=3, seed=7)),
])
def test_the_vision_tower_encodes_each_prompts_images_once_for_its_n_samples(arch, sampling):
    """n samples of prompts with images: the tower embeds every image patch once, and each sample is the one
    generated alone (n=1 at its sample index; greedy: transformers' greedy tokens), log-probs included."""
    model, processor = vlm(arch, seed=2), build_tiny_processor(arch)
    prompts = vlm_batch(processor, samples=1)
    engine = HFEngine(model, pad_token_id=processor.tokenizer.pad_token_id,
                      eos_token_ids=[processor.tokenizer.eos_token_id])
    encoded = []
    handle = vision_tower(model).patch_embed.register_forward_pre_hook(
        lambda module, args: encoded.append(args[0].shape[0]))
    try:
        together = engine.generate(requests_of(prompts, sampling))
    finally:
        handle.remove()
    patches = sum(int(row["image_grid_thw"].prod(-1).sum()) for row in prompts[MULTI_MODAL_KEY] if row)
    assert encoded == [patches]
    for sample in range(sampling.n):
        alone = engine.generate(requests_of(prompts, dataclasses.replace(sampling, n=1, first_sample=sample)))
        for row in range(len(prompts)):
            assert together[row][sample].token_ids == alone[row][0].token_ids
            torch.testing.assert_close(torch.tensor(together[row][sample].log_probs),
                                       torch.tensor(alone[row][0].log_probs), atol=1e-5, rtol=0)
