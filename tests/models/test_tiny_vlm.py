import pytest
import torch
from PIL import Image
from transformers import (
    AutoModelForImageTextToText,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from reinforge.models.tiny_vlm import (
    VISION_TOKENS,
    build_tiny_processor,
    build_tiny_vlm,
    build_vision_tokenizer,
    save_tiny_vlm,
)
from reinforge.models.vision import is_vision_language, load_processor, sequence_rope_positions

ARCHES = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen3_vl": Qwen3VLForConditionalGeneration}

MESSAGES = [
    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many?"}]}],
    [{"role": "system", "content": "count"},
     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"},
                                  {"type": "image"}]}],
]


def images():
    return [[Image.new("RGB", (40, 40), (255, 0, 0))],
            [Image.new("RGB", (64, 32), (0, 255, 0)), Image.new("RGB", (20, 50), (0, 0, 255))]]


def processed(processor):
    texts = [processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
             for messages in MESSAGES]
    return processor(text=texts, images=images(), return_tensors="pt", padding=True)


def test_chat_template_renders_image_parts_and_plain_strings():
    tokenizer = build_vision_tokenizer()
    text = tokenizer.apply_chat_template(MESSAGES[1], add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\ncount<|im_end|>\n<|im_start|>user\na<|vision_start|><|image_pad|>"
                    "<|vision_end|>b<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n<|im_start|>assistant\n")
    tool_turn = [{"role": "user", "content": "crop it"}, {"role": "tool", "content": [{"type": "image"}]}]
    assert "<tool_response>\n<|vision_start|><|image_pad|><|vision_end|>\n</tool_response>" in \
        tokenizer.apply_chat_template(tool_turn, tokenize=False)
    ids = tokenizer("<|image_pad|>x")["input_ids"]
    assert len(ids) == 2 and tokenizer.decode(ids, skip_special_tokens=True) == "x"
    assert all(token in tokenizer.all_special_tokens for token in VISION_TOKENS)


@pytest.mark.parametrize("arch", ARCHES)
def test_tiny_vlm_runs_forward_and_generate_on_processor_output(arch):
    model = build_tiny_vlm(arch)
    assert isinstance(model, ARCHES[arch]) and is_vision_language(model.config)
    assert model.config.text_config.num_hidden_layers == 2 and model.config.text_config.hidden_size == 64
    assert model.config.vision_config.depth == 2 and model.config.vision_config.spatial_merge_size == 2
    processor = build_tiny_processor(arch)
    inputs = processed(processor)
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8], [1, 6, 2]]
    image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert image_tokens == int(inputs["image_grid_thw"].prod(-1).sum()) // 4
    logits = model(**inputs).logits
    assert logits.shape == (*inputs["input_ids"].shape, len(processor.tokenizer))
    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert generated.shape == (2, inputs["input_ids"].shape[1] + 3)


@pytest.mark.parametrize("arch", ARCHES)
def test_saved_folder_loads_with_auto_classes(tmp_path, arch):
    folder = save_tiny_vlm(tmp_path / "vlm", arch, seed=3)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    processor = load_processor(folder)
    inputs = processed(processor)
    expected = processed(build_tiny_processor(arch))
    assert all(torch.equal(inputs[key], expected[key]) for key in expected)
    torch.testing.assert_close(model(**inputs).logits, build_tiny_vlm(arch, seed=3)(**inputs).logits)


@pytest.mark.parametrize("arch", ARCHES)
def test_rope_positions_of_one_sequence_match_the_models_rope_index(arch):
    model = build_tiny_vlm(arch)
    inputs = processed(build_tiny_processor(arch))
    expected, deltas = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                  inputs["image_grid_thw"], attention_mask=inputs["attention_mask"])
    grids = [inputs["image_grid_thw"][:1], inputs["image_grid_thw"][1:]]
    for row in range(2):
        attended = inputs["attention_mask"][row].bool()
        positions, delta = sequence_rope_positions(model.config, inputs["input_ids"][row][attended], grids[row])
        assert torch.equal(positions, expected[:, row][:, attended])
        assert delta == int(deltas[row]) and delta < 0


def test_load_causal_lm_loads_a_vlm_with_its_vision_tower(tmp_path):
    from reinforge.models import load_causal_lm

    folder = save_tiny_vlm(tmp_path / "vlm", "qwen2_5_vl")
    model = load_causal_lm(str(folder), dtype=torch.float32, device="cpu")
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration) and model.config.use_cache is False
