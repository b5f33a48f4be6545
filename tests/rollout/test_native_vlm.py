"""NativeEngine on vision-language prompts (tiny Qwen2.5-VL and Qwen3-VL, float32, CPU) against transformers:
greedy tokens equal ``generate``'s and log-probs a plain forward's, for prompts with 0, 1 and 2 images."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from reinforge.models.tiny import build_tiny_causal_lm
from reinforge.models.tiny_vlm import build_tiny_processor, build_tiny_vlm
from reinforge.rollout.base import GenerationRequest, SamplingParams
from reinforge.rollout.native import NativeEngine, supports_model
from reinforge.rollout.native.model import whole
from reinforge.rollout.native.multimodal import VISION_FLASH, VisionTower

ARCHITECTURES = ["qwen2_5_vl", "qwen3_vl"]
SIZES = {0: [], 1: [(40, 56)], 2: [(32, 32), (48, 24)]}
"""Images (height, width) of each prompt, by number of images."""


def tiny_qwen2_vl() -> torch.nn.Module:
    """Qwen2-VL with the text model of the tiny Qwen2.5-VL and a vision tower of 2 blocks (no windows)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    reference = build_tiny_vlm("qwen2_5_vl").config
    text = {key: value for key, value in reference.text_config.to_dict().items()
            if key not in ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype")}
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2)
    ids = {key: getattr(reference, key) for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                     "vision_end_token_id")}
    config = AutoConfig.for_model("qwen2_vl", text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config).float()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = reference.text_config.eos_token_id
    return model


@pytest.fixture(scope="module", params=[*ARCHITECTURES, "qwen2_vl"])
def vlm(request):
    if request.param == "qwen2_vl":  # its processor's outputs are Qwen2.5-VL's for images
        return tiny_qwen2_vl(), build_tiny_processor("qwen2_5_vl")
    return build_tiny_vlm(request.param), build_tiny_processor(request.param)


def image(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def encode(processor, num_images: int, text: str = "how many squares?", seed: int = 0) -> dict:
    """The processor's outputs for a user turn with ``num_images`` images and ``text``."""
    images = [image(height, width, seed + index) for index, (height, width) in enumerate(SIZES[num_images])]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    return dict(processor(text=[prompt], images=images or None, return_tensors="pt"))


def request_of(inputs: dict, sampling: SamplingParams, keep_prefix: bool = False) -> GenerationRequest:
    images = {name: inputs[name] for name in ("pixel_values", "image_grid_thw") if name in inputs}
    return GenerationRequest(inputs["input_ids"][0].tolist(), sampling, keep_prefix=keep_prefix,
                             multi_modal_inputs=images or None)


def make_engine(model, **kwargs) -> NativeEngine:
    return NativeEngine(model, eos_token_ids=[], max_model_len=256, block_size=8, max_num_seqs=16,
                        **{"enable_prefix_caching": True, **kwargs})


def forward_log_probs(model, inputs: dict, response: list[int]) -> torch.Tensor:
    """log p(response[i] | prompt, response[:i]) from one transformers forward over prompt + response."""
    prompt = inputs["input_ids"]
    ids = torch.cat([prompt, torch.tensor([response], device=prompt.device)], dim=1)
    extra = {name: inputs[name] for name in ("pixel_values", "image_grid_thw") if name in inputs}
    types = inputs.get("mm_token_type_ids")
    if types is not None:
        extra["mm_token_type_ids"] = torch.cat([types, types.new_zeros(1, len(response))], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0].float()
    start = prompt.shape[1]
    log_probs = torch.log_softmax(logits[start - 1:-1], dim=-1)
    return log_probs.gather(1, torch.tensor(response, device=ids.device)[:, None])[:, 0]


def greedy_reference(model, inputs: dict, max_tokens: int) -> list[int]:
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return output[0, inputs["input_ids"].shape[1]:].tolist()


def test_the_engine_runs_vision_language_models(vlm):
    model, _ = vlm
    assert supports_model(model)


def test_the_engines_vision_tower_copy_encodes_as_the_models_own_in_bfloat16(vlm):
    """Parameters in the engine's dtype, buffers (the rotary frequencies) kept in float32 as the model keeps them."""
    model, processor = vlm
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    for name, buffer in model.model.visual.named_buffers():  # as from_pretrained(dtype=bfloat16) leaves them
        owner, _, leaf = name.rpartition(".")
        bf16.model.visual.get_submodule(owner)._buffers[leaf] = buffer.clone()
    inputs = encode(processor, 2, seed=8)
    tower = VisionTower(torch.bfloat16, torch.device("cpu"))
    tower.load(bf16, whole)
    assert {buffer.dtype for buffer in tower.module.buffers()} == {torch.float32}
    assert {parameter.dtype for parameter in tower.module.parameters()} == {torch.bfloat16}
    embeddings, _ = tower.encode(inputs["pixel_values"], inputs["image_grid_thw"])
    with torch.no_grad():
        expected = bf16.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    assert torch.equal(embeddings, torch.cat(expected))


def test_greedy_matches_generate_and_log_probs_match_a_forward(vlm):
    model, processor = vlm
    engine = make_engine(model)
    encoded = [encode(processor, num_images, seed=10 * num_images) for num_images in (0, 1, 2)]
    sampling = SamplingParams(max_tokens=10, temperature=0.0, n=2, ignore_eos=True)
    completions = engine.generate([request_of(inputs, sampling) for inputs in encoded])
    for inputs, samples in zip(encoded, completions, strict=True):
        reference = greedy_reference(model, inputs, 10)
        assert [sample.token_ids for sample in samples] == [reference, reference]
        expected = forward_log_probs(model, inputs, reference)
        torch.testing.assert_close(torch.tensor(samples[0].log_probs), expected, atol=1e-5, rtol=0)
    counts = engine.runner.multimodal
    assert counts.num_images_encoded == 3 and not counts.prompts  # once per image; released with the requests


def test_sampled_log_probs_match_a_forward(vlm):
    model, processor = vlm
    encoded = [encode(processor, 2, seed=3), encode(processor, 1, text="what colour?", seed=4)]
    sampling = SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=7, ignore_eos=True)
    completions = make_engine(model).generate([request_of(inputs, sampling) for inputs in encoded])
    for inputs, samples in zip(encoded, completions, strict=True):
        assert len({tuple(sample.token_ids) for sample in samples}) > 1
        for sample in samples:
            expected = forward_log_probs(model, inputs, sample.token_ids)
            torch.testing.assert_close(torch.tensor(sample.log_probs), expected, atol=1e-5, rtol=0)


def test_prompts_that_differ_only_in_their_image_share_no_cached_blocks(vlm):
    """Equal token ids (same image size), different pixels: the second prompt must not reuse the first's keys."""
    model, processor = vlm
    engine = make_engine(model)
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first, second = encode(processor, 1, seed=1), encode(processor, 1, seed=2)
    assert torch.equal(first["input_ids"], second["input_ids"])
    for inputs in (first, second):
        [[sample]] = engine.generate([request_of(inputs, sampling, keep_prefix=True)])
        assert sample.token_ids == greedy_reference(model, inputs, 6)
    assert engine.counts()["rollout/prefix_cache_hit_tokens"] == 0
    # the same image again: its blocks are reused and its embeddings not computed again
    encoded_before = engine.runner.multimodal.num_images_encoded
    [[again]] = engine.generate([request_of(second, sampling, keep_prefix=True)])
    assert again.token_ids == greedy_reference(model, second, 6)
    assert engine.counts()["rollout/prefix_cache_hit_tokens"] > 0
    assert engine.runner.multimodal.num_images_encoded == encoded_before


def test_a_kept_prefix_names_images_of_bfloat16_pixels(vlm):
    """Pixel values in bfloat16 (as a caller that casts the processor's outputs to the model's dtype sends them):
    a request that keeps its prefix names its images by their bytes, which numpy cannot read as bfloat16."""
    model, processor = vlm
    engine = make_engine(model)
    inputs = encode(processor, 1, seed=1)
    inputs["pixel_values"] = inputs["pixel_values"].to(torch.bfloat16)
    sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    [[plain]] = engine.generate([request_of(inputs, sampling)])
    [[kept]], [[again]] = (engine.generate([request_of(inputs, sampling, keep_prefix=True)]) for _ in range(2))
    assert kept.token_ids == again.token_ids == plain.token_ids
    assert engine.counts()["rollout/prefix_cache_hit_tokens"] > 0


def test_preempted_sequences_recompute_with_their_images(vlm):
    model, processor = vlm
    encoded = [encode(processor, count, seed=20 + count) for count in (2, 1, 2)]
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = make_engine(model, num_kv_blocks=14, enable_prefix_caching=False)
    completions = engine.generate([request_of(inputs, sampling) for inputs in encoded])
    assert engine.last_metrics["rollout/num_preempted"] > 0
    for inputs, [sample] in zip(encoded, completions, strict=True):
        assert sample.token_ids == greedy_reference(model, inputs, 24)


IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
"""An image's place in a prompt written by hand (the processor expands its pad token to the image's tokens)."""


def encode_text(processor, text: str, images: list[Image.Image]) -> dict:
    """The processor's outputs for the raw ``text`` (no chat template), its ``IMAGE`` places filled by ``images``."""
    return dict(processor(text=[text], images=images or None, return_tensors="pt"))


def assert_greedy_matches(model, encoded: list[dict], completions, n: int) -> None:
    for inputs, samples in zip(encoded, completions, strict=True):
        reference = greedy_reference(model, inputs, len(samples[0].token_ids))
        assert [sample.token_ids for sample in samples] == [reference] * n
        torch.testing.assert_close(torch.tensor(samples[0].log_probs), forward_log_probs(model, inputs, reference),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk, use_triton", [(1, False), (5, False), pytest.param(5, True, marks=pytest.mark.slow)])
def test_prefill_chunks_that_cut_through_images_match_generate(vlm, chunk, use_triton):
    """Prefill forwards of a few tokens each: an image's tokens (and Qwen3-VL's deepstack rows) split over several,
    images first and last in a prompt, side by side, and a text prompt in the same steps; n = 2 share the prefill."""
    model, processor = vlm
    encoded = [encode_text(processor, IMAGE + "ab" + IMAGE, [image(32, 48, 5), image(64, 16, 6)]),
               encode_text(processor, "a" + IMAGE + IMAGE + "b<|image_pad|>", [image(16, 16, 7), image(40, 24, 8),
                                                                               image(24, 40, 9)]),
               encode(processor, 0, text="hi")]
    sampling = SamplingParams(max_tokens=3 if use_triton else 6, temperature=0.0, n=2, ignore_eos=True)
    engine = make_engine(model, max_prefill_chunk_tokens=chunk, use_triton=use_triton)
    assert_greedy_matches(model, encoded, engine.generate([request_of(inputs, sampling) for inputs in encoded]), 2)


@pytest.mark.parametrize("prefix", ["h", "hello there"])
def test_a_prefix_cache_hit_may_end_inside_an_image(vlm, prefix):
    """Two prompts with the same text and image before different questions share the blocks of the image's first
    tokens; the second computes the image's last tokens from its own encoding. A different image stops the hit
    before its tokens."""
    model, processor = vlm
    pictures = [image(64, 64, 7)]  # 16 tokens: two blocks of 8
    first = encode_text(processor, prefix + IMAGE + "first question", pictures)
    second = encode_text(processor, prefix + IMAGE + "another one", pictures)
    other = encode_text(processor, prefix + IMAGE + "another one", [image(64, 64, 8)])
    image_start = len(prefix) + 1  # after the text and <|vision_start|>
    engine = make_engine(model)
    sampling = SamplingParams(max_tokens=6, temperature=0.0, n=2, ignore_eos=True)
    hits = []
    for inputs in (first, second, other):
        completions = engine.generate([request_of(inputs, sampling, keep_prefix=True)])
        assert_greedy_matches(model, [inputs], completions, 2)
        hits.append(engine.counts()["rollout/prefix_cache_hit_tokens"])
    assert hits[0] == 0 and image_start < hits[1] < image_start + 16  # the hit ends inside the image
    assert hits[2] - hits[1] == image_start // 8 * 8  # only the blocks before the image

def test_a_text_model_refuses_images_and_a_mismatched_grid_is_named(vlm):
    model, processor = vlm
    inputs = encode(processor, 1)
    text_engine = make_engine(build_tiny_causal_lm("qwen2"))
    with pytest.raises(ValueError, match="text model"):
        text_engine.generate([request_of(inputs, SamplingParams(max_tokens=2))])
    wrong = dict(inputs, image_grid_thw=inputs["image_grid_thw"] * torch.tensor([[1, 2, 1]]))
    with pytest.raises(ValueError, match="image tokens"):
        make_engine(model).generate([request_of(wrong, SamplingParams(max_tokens=2))])


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_triton_path_and_cuda_graphs_match_transformers_on_the_gpu(architecture):
    """Triton kernels, decode CUDA graphs (rope positions shifted by the rope delta) and the vision tower on CUDA."""
    model = build_tiny_vlm(architecture).cuda()
    processor = build_tiny_processor(architecture)
    engine = make_engine(model, cuda_graph_batch_sizes=(1, 2, 4, 8))
    assert engine.runner.cuda_graph_batch_sizes
    encoded = [encode(processor, num_images, seed=30 + num_images) for num_images in (0, 1, 2)]
    sampling = SamplingParams(max_tokens=10, temperature=0.0, n=2, ignore_eos=True)
    completions = engine.generate([request_of(inputs, sampling) for inputs in encoded])
    assert engine.runner._graphs  # decode steps replayed graphs
    for inputs, samples in zip(encoded, completions, strict=True):
        on_device = {name: value.cuda() for name, value in inputs.items()}
        reference = greedy_reference(model, on_device, 10)
        assert [sample.token_ids for sample in samples] == [reference, reference]
        expected = forward_log_probs(model, on_device, reference).cpu()
        torch.testing.assert_close(torch.tensor(samples[0].log_probs), expected, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_triton_path_samples_what_a_forward_gives(vlm):
    """The Triton kernels (Triton's interpreter on the CPU) read each token's M-RoPE row of the step's table."""
    pytest.importorskip("triton")
    model, processor = vlm
    # short questions: the interpreter runs a program per prompt token in each kernel of the prefill
    encoded = [encode(processor, 2, text="how many?", seed=5), encode(processor, 0, text="hi")]
    sampling = SamplingParams(max_tokens=3, temperature=1.0, n=2, seed=3, ignore_eos=True)
    completions = make_engine(model, use_triton=True).generate([request_of(inputs, sampling) for inputs in encoded])
    for inputs, samples in zip(encoded, completions, strict=True):
        for sample in samples:
            expected = forward_log_probs(model, inputs, sample.token_ids)
            torch.testing.assert_close(torch.tensor(sample.log_probs), expected, atol=1e-5, rtol=0)


def test_the_vision_tower_hands_each_layers_windows_to_one_varlen_call(vlm, monkeypatch):
    """The flash path's plumbing on the CPU, its kernel stood in for by SDPA per segment: transformers hands the
    attention every window (or image) of a layer at once, and the embeddings are SDPA's."""
    model, processor = vlm
    segments_per_call = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug_mask, scale=None):
        segments_per_call.append(len(cu_q) - 1)
        bounds = cu_q.tolist()
        return (torch.cat([torch.nn.functional.scaled_dot_product_attention(
            *(tensor[start:stop].transpose(0, 1) for tensor in (q, k, v)), scale=scale).transpose(0, 1)
            for start, stop in zip(bounds, bounds[1:], strict=False)]),)

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", varlen, raising=False)
    tower = VisionTower(torch.float32, torch.device("cpu"))
    monkeypatch.setattr(tower, "_flash_may_apply", lambda: True)
    tower.load(model, whole)
    assert tower.attention == VISION_FLASH
    inputs = encode(processor, 2, seed=4)
    segments_per_call.clear()
    embeddings, _ = tower.encode(inputs["pixel_values"], inputs["image_grid_thw"])
    layers = len(tower.module.blocks)
    assert len(segments_per_call) == layers and max(segments_per_call) >= 2  # one call a layer, both images in it
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    torch.testing.assert_close(embeddings, torch.cat(expected), atol=1e-5, rtol=0)


def test_the_vision_tower_copy_on_sdpa_makes_one_attention_call_a_layer(vlm, monkeypatch):
    """Without the flash path (the CPU, or a probe that disagrees) the copy attends over all the images and windows
    of a layer in one SDPA call, as packed training runs the tower, not one call per window; same embeddings."""
    model, processor = vlm
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return sdpa(*args, **kwargs)

    tower = VisionTower(torch.float32, torch.device("cpu"))
    tower.load(model, whole)
    assert tower.attention == "sdpa" and tower.batched
    inputs = encode(processor, 2, seed=4)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    embeddings, _ = tower.encode(inputs["pixel_values"], inputs["image_grid_thw"])
    assert len(calls) == len(tower.module.blocks)  # one a layer, every image (and window) in it
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    torch.testing.assert_close(embeddings, torch.cat(expected), atol=1e-5, rtol=0)
    tower.free()  # a copy made again (after the engine's memory was freed) attends the same way
    tower.load(model, whole)
    calls.clear()
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    tower.encode(inputs["pixel_values"], inputs["image_grid_thw"])
    assert len(calls) == len(tower.module.blocks)


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_vision_tower_copy_attends_with_flash_varlen_in_bfloat16_on_the_gpu(architecture):
    """One flash varlen call per layer (not one SDPA call per window) once the probe agrees, and the embeddings
    are the model's own tower's within bf16 rounding."""
    model = build_tiny_vlm(architecture).cuda().to(torch.bfloat16)
    inputs = encode(build_tiny_processor(architecture), 2, seed=9)
    tower = VisionTower(torch.bfloat16, torch.device("cuda"))
    tower.load(model, whole)
    assert tower.attention == VISION_FLASH
    embeddings, _ = tower.encode(inputs["pixel_values"], inputs["image_grid_thw"])
    with torch.no_grad():
        expected = torch.cat(model.model.get_image_features(inputs["pixel_values"].cuda(),
                                                            inputs["image_grid_thw"].cuda()).pooler_output)
    torch.testing.assert_close(embeddings.float(), expected.float(), atol=2e-2 * expected.abs().max().item(), rtol=0)


def test_a_lora_actors_adapters_reach_the_decoder_and_the_vision_tower_copies(vlm):
    """LoRA on every matching linear layer, the vision tower's included: the engine's copies get W + s B A."""
    from reinforge.config.schema import LoraConfig
    from reinforge.engine.lora import add_lora, lora_deltas

    model, processor = copy.deepcopy(vlm[0]), vlm[1]
    peft_model = add_lora(model, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "gate_proj",
                                                                               "up_proj", "qkv"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3)
    assert any(".visual." in name and "lora_A" in name for name, _ in model.named_parameters())
    engine = make_engine(model)
    engine.sync_weights(model)
    engine.wake_up()
    engine.add_to_weights(lora_deltas(peft_model))
    encoded = [encode(processor, 1, seed=12), encode(processor, 2, seed=13)]
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    completions = engine.generate([request_of(inputs, sampling) for inputs in encoded])
    for inputs, [sample] in zip(encoded, completions, strict=True):
        reference = greedy_reference(model, inputs, 8)  # peft's layers, adapters applied unmerged
        assert sample.token_ids == reference
        torch.testing.assert_close(torch.tensor(sample.log_probs), forward_log_probs(model, inputs, reference),
                                   atol=1e-4, rtol=0)
