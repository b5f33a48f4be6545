"""Packed passes of vision-language models against transformers' padded forward of the processor's batch."""

import pytest
import torch
from PIL import Image

from reinforge.data.multimodal import concat_image_inputs
from reinforge.engine.forward import response_log_probs
from reinforge.engine.fused import prepare_for_training
from reinforge.engine.packing import attach_plan, pack_vision_inputs, plan_packing
from reinforge.models.tiny_vlm import build_tiny_processor, build_tiny_vlm
from reinforge.models.vision import freeze_vision_tower
from reinforge.protocol import MULTI_MODAL_KEY, Batch

ARCHES = ("qwen2_5_vl", "qwen3_vl")
PROMPTS = [  # (text, images): two with images of different sizes, one with two images, one without
    ("How many red squares?", [Image.new("RGB", (32, 32), (200, 10, 10))]),
    ("Count them.", [Image.new("RGB", (48, 24), (10, 200, 10))]),
    ("Compare", [Image.new("RGB", (16, 32), (10, 10, 200)), Image.new("RGB", (32, 16), (90, 90, 9))]),
    ("Only text here.", []),
]


def vlm_batch(processor, samples: int = 2, response_width: int = 6, seed: int = 0) -> Batch:
    """GRPO-like rows: each prompt ``samples`` times (rows interleaved), responses of different lengths."""
    generator = torch.Generator().manual_seed(seed)
    texts, images = [], []
    for text, prompt_images in PROMPTS:
        content = [{"type": "image"} for _ in prompt_images] + [{"type": "text", "text": text}]
        texts.append(processor.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                             add_generation_prompt=True, tokenize=False))
        images.append(prompt_images)
    prompt_ids, inputs = [], []
    for text, prompt_images in zip(texts, images, strict=True):
        if prompt_images:
            out = processor(text=[text], images=prompt_images, return_tensors="pt")
            inputs.append({"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]})
        else:
            out = processor.tokenizer([text], return_tensors="pt")
            inputs.append({})
        prompt_ids.append(out["input_ids"][0])
    width = max(len(ids) for ids in prompt_ids)
    pad = processor.tokenizer.pad_token_id
    rows = len(PROMPTS) * samples
    prompts = torch.full((rows, width), pad)
    prompt_mask = torch.zeros(rows, width, dtype=torch.long)
    row_inputs = []
    for row in range(rows):
        ids = prompt_ids[row // samples]
        prompts[row, width - len(ids):] = ids
        prompt_mask[row, width - len(ids):] = 1
        row_inputs.append(inputs[row // samples])
    responses = torch.randint(3, 120, (rows, response_width), generator=generator)
    response_mask = torch.zeros(rows, response_width)
    for row in range(rows):
        response_mask[row, : 1 + (row * 5) % response_width] = 1
    responses = torch.where(response_mask.bool(), responses, pad)
    order = torch.randperm(rows, generator=generator)
    batch = Batch.from_dict(
        tensors={"prompts": prompts, "responses": responses, "response_mask": response_mask,
                 "input_ids": torch.cat([prompts, responses], 1),
                 "attention_mask": torch.cat([prompt_mask, response_mask.long()], 1),
                 "advantages": torch.randn(rows, response_width, generator=generator) * response_mask},
        non_tensors={MULTI_MODAL_KEY: row_inputs})
    return batch.index(order)


def padded_log_probs(model, batch: Batch) -> torch.Tensor:
    """transformers' own forward over the padded batch (the processor's layout), log-prob of each response token."""
    input_ids = batch["input_ids"]
    images = concat_image_inputs(list(batch[MULTI_MODAL_KEY]))
    logits = model(input_ids=input_ids, attention_mask=batch["attention_mask"],
                   mm_token_type_ids=(input_ids == model.config.image_token_id).int(), use_cache=False,
                   **images).logits.float()
    width = batch["responses"].shape[1]
    log_probs = torch.log_softmax(logits[:, -width - 1:-1], -1)
    return log_probs.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1) * batch["response_mask"]


def vlm(arch: str, seed: int = 0):
    model = build_tiny_vlm(arch, seed=seed)
    prepare_for_training(model, torch.device("cpu"))
    return model


@pytest.mark.parametrize("arch", ARCHES)
def test_packed_positions_and_pixels_are_the_processors(arch):
    model, processor = vlm(arch), build_tiny_processor(arch)
    batch = vlm_batch(processor)
    attention = batch["attention_mask"].bool()
    expected, _ = model.model.get_rope_index(batch["input_ids"], (batch["input_ids"] == model.config.image_token_id),
                                             concat_image_inputs(list(batch[MULTI_MODAL_KEY]))["image_grid_thw"],
                                             attention_mask=batch["attention_mask"])
    for share in (False, True):
        plan = plan_packing(batch, share_prompts=share)
        vision = pack_vision_inputs(batch, plan, model.config)
        flat_expected = expected.reshape(3, -1)[:, plan.source_index]
        assert torch.equal(vision.position_ids[:, 0], flat_expected)
        rows = (plan.source_index // attention.shape[1]).tolist()
        first_rows = list(dict.fromkeys(row for row, token in zip(rows, batch["input_ids"].reshape(-1)[
            plan.source_index].tolist(), strict=True) if token == model.config.image_token_id))
        images = concat_image_inputs([batch[MULTI_MODAL_KEY][row] for row in first_rows])
        assert torch.equal(vision.pixel_values, images["pixel_values"])
        assert torch.equal(vision.image_grid_thw, images["image_grid_thw"])
    shared = plan_packing(batch, share_prompts=True)
    assert len(shared.query_lengths) == len(PROMPTS) + int((batch["response_mask"].sum(-1) > 0).sum())


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("train_vision", [False, True])
def test_packed_loss_and_gradients_equal_the_padded_forward(arch, train_vision):
    packed_model, padded_model = vlm(arch, seed=1), build_tiny_vlm(arch, seed=1)  # transformers' modules as they are
    for model in (packed_model, padded_model):
        freeze_vision_tower(model, frozen=not train_vision)
    batch = vlm_batch(build_tiny_processor(arch))
    expected = padded_log_probs(padded_model, batch)
    (expected * batch["advantages"]).sum().backward()
    for share in (False, True):
        packed_model.zero_grad()
        log_probs, _ = response_log_probs(packed_model, attach_plan(Batch(dict(batch.tensors), dict(
            batch.non_tensors), {}), share_prompts=share))
        torch.testing.assert_close(log_probs * batch["response_mask"], expected, rtol=0, atol=1e-5)
        (log_probs * batch["advantages"]).sum().backward()
        for (name, packed), (_, padded) in zip(packed_model.named_parameters(), padded_model.named_parameters(),
                                               strict=True):
            assert (packed.grad is None) == (padded.grad is None), name
            if packed.grad is not None:
                torch.testing.assert_close(packed.grad, padded.grad, rtol=1e-4, atol=1e-5, msg=name)
    tower_grads = [parameter.grad for parameter in packed_model.model.visual.parameters()]
    assert all(grad is not None for grad in tower_grads) if train_vision else all(grad is None for grad in tower_grads)


def test_a_model_left_on_its_own_attention_refuses_rows_with_images():
    """Without reinforge's varlen attention a model's rows run padded, which would drop their pixels and M-RoPE
    positions and score the image tokens as text."""
    batch = vlm_batch(build_tiny_processor("qwen2_5_vl"), samples=1)
    with pytest.raises(ValueError, match="takes rows with images through the packed pass only.*prepare_for_training"):
        response_log_probs(build_tiny_vlm("qwen2_5_vl"), attach_plan(batch))


def test_same_text_with_other_images_is_another_prompt():
    processor = build_tiny_processor("qwen2_5_vl")
    batch = vlm_batch(processor, samples=1)
    rows = [row for row in range(len(batch)) if batch[MULTI_MODAL_KEY][row]][:2]
    twin = batch.index(rows + rows)
    twin.tensors["prompts"][2:] = twin["prompts"][0]
    twin.tensors["input_ids"][2:, :twin["prompts"].shape[1]] = twin["prompts"][0]
    twin.tensors["attention_mask"][2:, :twin["prompts"].shape[1]] = twin["attention_mask"][0, :twin["prompts"].shape[1]]
    from reinforge.engine.packing import prompt_groups

    assert len(prompt_groups(twin)) == 3  # row 2 has row 0's text and images; row 3 row 0's text, row 1's images


@pytest.mark.parametrize("arch", ARCHES)
def test_the_language_models_fast_path_gives_the_padded_forwards_loss_and_gradients(arch):
    """On CUDA the language model takes its text family's fused norms, MLP and packed attention layout (run eagerly
    here); the vision tower's modules are left to transformers or swapped for the same math."""
    from reinforge.engine.fused import fuse_elementwise, model_spec, use_packed_attention_layout

    packed_model, padded_model = vlm(arch, seed=4), build_tiny_vlm(arch, seed=4)
    assert model_spec(packed_model).model_type == {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}[arch]
    assert fuse_elementwise(packed_model, compile=False) > 0
    assert use_packed_attention_layout(packed_model) == packed_model.config.text_config.num_hidden_layers
    batch = vlm_batch(build_tiny_processor(arch), seed=1)
    expected = padded_log_probs(padded_model, batch)
    (expected * batch["advantages"]).sum().backward()
    log_probs, _ = response_log_probs(packed_model, attach_plan(Batch(dict(batch.tensors), dict(batch.non_tensors), {}),
                                                                share_prompts=True))
    torch.testing.assert_close(log_probs * batch["response_mask"], expected, rtol=0, atol=1e-5)
    (log_probs * batch["advantages"]).sum().backward()
    for (name, packed), (_, padded) in zip(packed_model.named_parameters(), padded_model.named_parameters(),
                                           strict=True):
        if packed.grad is not None or padded.grad is not None:
            torch.testing.assert_close(packed.grad, padded.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("arch", ARCHES)
def test_the_vision_towers_one_call_attention_is_transformers_per_image_attention(arch):
    from reinforge.models.vision import use_batched_vision_attention

    swapped, original = build_tiny_vlm(arch, seed=6), build_tiny_vlm(arch, seed=6)
    assert use_batched_vision_attention(swapped) == swapped.config.vision_config.depth
    images = concat_image_inputs([row for row in vlm_batch(build_tiny_processor(arch), samples=1)[MULTI_MODAL_KEY]
                                  if row])
    outputs = []
    for model in (swapped, original):
        pixels = images["pixel_values"].clone().requires_grad_()
        embeddings = model.model.get_image_features(pixels, images["image_grid_thw"], return_dict=True).pooler_output
        torch.cat(embeddings).square().sum().backward()
        outputs.append((torch.cat(embeddings), pixels.grad))
    torch.testing.assert_close(outputs[0][0], outputs[1][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(outputs[0][1], outputs[1][1], rtol=1e-5, atol=1e-6)
    for (name, a), (_, b) in zip(swapped.model.visual.named_parameters(), original.model.visual.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
