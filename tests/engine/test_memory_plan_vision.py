import dataclasses
import json

import pytest
import torch
from transformers import AutoConfig

from reinforge.bench.shapes import shape_config
from reinforge.engine.memory_plan import GiB, ModelShape, RunShape, Settings, VisionShape, estimate

TEXT = dict(hidden_size=96, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=100,
            bos_token_id=None, eos_token_id=None)
TOWER_PARAMS_3B = 668_684_288
"""Qwen2.5-VL-3B's vision tower as transformers builds it (0.67B)."""


def vl_config(family: str, vision: dict) -> dict:
    return json.loads(AutoConfig.for_model(family, vision_config=vision, text_config=TEXT).to_json_string())


def tower_of(family: str, vision: dict):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    cls = {"qwen2_vl": Qwen2VisionTransformerPretrainedModel, "qwen2_5_vl": Qwen2_5_VisionTransformerPretrainedModel,
           "qwen3_vl": Qwen3VLVisionModel}[family]
    with torch.device("meta"):
        return cls._from_config(AutoConfig.for_model(family, vision_config=vision, text_config=TEXT).vision_config)


@pytest.mark.parametrize("family, vision", [
    ("qwen2_vl", dict(depth=3, embed_dim=64, hidden_size=96, num_heads=4, mlp_ratio=4)),
    ("qwen2_5_vl", dict(depth=3, hidden_size=64, intermediate_size=80, num_heads=4, out_hidden_size=96)),
    ("qwen3_vl", dict(depth=3, hidden_size=64, intermediate_size=80, num_heads=4, out_hidden_size=96,
                      num_position_embeddings=144, deepstack_visual_indexes=[0, 2])),
    ("qwen2_5_vl", shape_config("qwen2.5-vl-3b")["vision_config"]),
])
def test_the_towers_parameters_are_those_transformers_builds(family, vision):
    config = vl_config(family, vision)
    tower = VisionShape.from_hf_config(config)
    assert tower is not None and tower.family == family
    assert tower.num_params == sum(parameter.numel() for parameter in tower_of(family, vision).parameters())
    assert ModelShape.from_hf_config(config).vision == tower


def test_a_text_model_has_no_tower_and_no_vision_consumers():
    shape = ModelShape.from_hf_config({"model_type": "qwen2", **TEXT})
    assert shape.vision is None
    phases, _ = estimate(shape, RunShape(8, 4, 64, 64, image_tokens=64), Settings())
    assert not any("vision" in name for phase in phases.values() for name in phase)


def bench_shape() -> tuple[ModelShape, RunShape]:
    """The qwen2.5-vl-3b bench: 64 prompts x 8, one 448 x 448 image (256 image tokens) and 128 letters a prompt."""
    shape = ModelShape.from_hf_config(vl_config("qwen2_5_vl", shape_config("qwen2.5-vl-3b")["vision_config"])
                                      | {"text_config": {k: v for k, v in shape_config("qwen2.5-vl-3b").items()
                                                         if k != "vision_config"}})
    return shape, RunShape(64, 8, 400, 512, image_tokens=256)


def test_the_bench_shapes_tower_is_counted_frozen_or_trained():
    shape, run = bench_shape()
    tower = shape.vision
    assert tower is not None and tower.num_params == TOWER_PARAMS_3B and tower.patches(256) == 1024  # (448/14)^2
    settings = Settings(micro_batch_tokens=24576)
    text_only, _ = estimate(dataclasses.replace(shape, vision=None), run, settings)
    frozen, _ = estimate(shape, run, settings)
    trained, _ = estimate(shape, dataclasses.replace(run, train_vision=True), settings)
    for phases in (frozen, trained):
        assert phases["update"]["vision tower"] == phases["rollout"]["vision tower"] == 4 * TOWER_PARAMS_3B
        assert phases["rollout"]["vision tower copy"] == phases["update"]["vision tower copy"] == 2 * TOWER_PARAMS_3B
        for name, value in text_only["update"].items():  # the language model's consumers are as they were
            assert phases["update"][name] == value
    assert "vision gradients" not in frozen["update"] and "vision optimizer state" not in frozen["update"]
    assert trained["update"]["vision gradients"] == 4 * TOWER_PARAMS_3B
    assert trained["update"]["vision optimizer state"] == trained["rollout"]["vision optimizer state"] == (
        8 * TOWER_PARAMS_3B)
    assert "vision gradients" not in trained["rollout"]
    # 24k-token micro-batches hold five prompts (400 + 8 x 512 tokens each): 5120 patches, kept by every block
    # when trained; frozen, the step's 64 images go through the tower once, 4096 patches a call, one block's
    # working set, and their 64 x 256 embeddings of the language model's width stay for the step
    assert frozen["update"]["vision activations"] == 4096 * tower.working_bytes_per_patch(2)
    assert frozen["update"]["image embeddings"] == 64 * 256 * 2048 * 2
    assert "image embeddings" not in trained["update"]
    with_reference, _ = estimate(shape, dataclasses.replace(run, reference=True), settings)
    assert with_reference["update"]["image embeddings"] == 2 * frozen["update"]["image embeddings"]
    assert trained["update"]["vision activations"] == 5120 * tower.activation_bytes_per_patch(2)
    assert 3 * GiB < trained["update"]["vision activations"] < 10 * GiB
    assert frozen["update"]["vision activations"] < 0.5 * GiB
    # the rollout's prefill encodes at most the engine's batched tokens of images at once
    assert frozen["rollout"]["vision activations"] == 4 * 16384 * tower.working_bytes_per_patch(2)


def test_lora_and_offload_move_the_tower_as_the_language_model():
    shape, run = bench_shape()
    lora, _ = estimate(shape, dataclasses.replace(run, lora_rank=32, train_vision=True), Settings())
    assert lora["update"]["vision tower"] == 2 * TOWER_PARAMS_3B and "vision gradients" not in lora["update"]
    phases, host = estimate(shape, dataclasses.replace(run, train_vision=True), Settings(param_offload=True))
    assert host["vision tower"] == 4 * TOWER_PARAMS_3B and host["vision optimizer state"] == 8 * TOWER_PARAMS_3B
    assert "vision tower" not in phases["update"] and "vision gradients" not in phases["update"]
    two, _ = estimate(shape, dataclasses.replace(run, num_devices=2, reference=True), Settings())
    assert two["update"]["vision tower"] == 2 * TOWER_PARAMS_3B  # sharded
    assert two["rollout"]["vision tower copy"] == 2 * TOWER_PARAMS_3B  # the engine's copy is whole
    one, _ = estimate(shape, dataclasses.replace(run, num_devices=2), Settings())
    assert two["update"]["reference"] - one["update"].get("reference", 0) > TOWER_PARAMS_3B


def test_plan_of_the_vl_bench_shape_shows_the_tower(capsys):
    from reinforge.cli import main

    arguments = ["plan", "--model", "qwen2.5-vl-3b", "--gpu-memory-gib", "141", "--host-memory-gib", "1000",
                 "trainer.device=cuda"]
    assert main(arguments) == 0
    frozen = capsys.readouterr().out
    # the standard workload's one 448 x 448 image a prompt: 256 image tokens, not every one of its 128 + 256 tokens
    assert ("vision tower: 0.67B parameters, frozen (actor.freeze_vision_tower), up to 1024 patches a prompt (256 "
            "image tokens of 4 patches, data.max_image_tokens)") in frozen
    assert "vision tower 2.5" in frozen and "vision optimizer state" not in frozen
    assert main([*arguments, "actor.freeze_vision_tower=false"]) == 0
    trained = capsys.readouterr().out
    assert "0.67B parameters, trained" in trained and "vision optimizer state 5.0" in trained


@pytest.mark.parametrize("flags, image_tokens, prompt_length", [
    ([], 256, 128 + 256),
    (["--image-size", "224"], 64, 128 + 64),
    (["--image-size", "640x480", "--prompt-tokens", "300"], 23 * 17, 300 + 23 * 17),  # sides rounded to 28 pixels
])
def test_plan_of_the_vl_bench_shape_counts_the_image_tokens_of_its_image_size(monkeypatch, flags, image_tokens,
                                                                             prompt_length):
    from reinforge.cli import main
    from reinforge.workers import memory_settings

    seen = []
    monkeypatch.setattr(memory_settings, "memory_plan", lambda config: seen.append(config) or _Plan())
    assert main(["plan", "--model", "qwen2.5-vl-3b", *flags, "--gpu-memory-gib", "141", "trainer.device=cuda"]) == 0
    [config] = seen
    assert (config.data.max_image_tokens, config.data.max_prompt_length) == (image_tokens, prompt_length)
    assert memory_settings.run_shape(config).image_tokens == image_tokens


class _Plan:
    def table(self) -> str:
        return "a plan"


def test_plan_of_a_model_folder_takes_the_image_size_or_else_counts_every_prompt_token(tmp_path, capsys):
    """A folder of the shape's config.json: --image-size counts one image's tokens, which must fit the prompt;
    without it every prompt token counts as an image token, and the line says how to count fewer."""
    from reinforge.bench.shapes import write_shape_config
    from reinforge.cli import main
    from reinforge.config import ConfigError, load_config
    from reinforge.config.validate import validate_config

    folder = write_shape_config("qwen2.5-vl-3b", tmp_path / "vl")
    arguments = ["plan", f"model.path={folder}", "data.max_prompt_length=400", "--gpu-memory-gib", "141",
                 "--host-memory-gib", "1000", "trainer.device=cuda"]
    assert main([*arguments, "--image-size", "448"]) == 0
    assert "up to 1024 patches a prompt (256 image tokens of 4 patches, data.max_image_tokens)" in capsys.readouterr().out
    assert main(arguments) == 0
    assert ("up to 1600 patches a prompt (400 image tokens of 4 patches, every prompt token; data.max_image_tokens "
            "counts fewer)") in capsys.readouterr().out
    assert main([*arguments, "--image-size", "1036"]) == 2  # 37 x 37 merged patches, scaled down to at most 1280
    assert ("--image-size 1036 (command line) makes 1225 image tokens a prompt, more than data.max_prompt_length=400; "
            "raise max_prompt_length") in capsys.readouterr().err
    text = write_shape_config("0.5b", tmp_path / "text")
    assert main(["plan", f"model.path={text}", "--image-size", "448", "--gpu-memory-gib", "141",
                 "trainer.device=cuda"]) == 2
    assert (f"--image-size 448 (command line) counts a vision-language model's image tokens, and model.path={text} "
            "has no vision tower; drop --image-size") in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"data.max_image_tokens=500 must be between 1 and "
                                          r"data.max_prompt_length=400"):
        validate_config(load_config(None, [f"model.path={folder}", "data.max_prompt_length=400",
                                           "data.max_image_tokens=500"]))


def processor_image_tokens(processor, width: int, height: int) -> int:
    """The image tokens the processor expands one ``width`` x ``height`` image's placeholder to."""
    from PIL import Image

    text = f"<|vision_start|>{processor.image_token}<|vision_end|>"
    encoded = processor(text=[text], images=[Image.new("RGB", (width, height))], return_tensors="pt")
    return int((encoded["input_ids"] == processor.image_token_id).sum())


@pytest.fixture(scope="module")
def tiny_vlm_folder(tmp_path_factory):
    from reinforge.models.tiny_vlm import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp("plan") / "vlm")


@pytest.mark.parametrize("image_size, bounds", [
    ("100x80", []),  # above the folder's max_pixels (64 x 64): scaled down, as the processor does by itself
    ("100x80", ["data.max_pixels=1024"]),  # above data.max_pixels
    ("64", ["data.max_pixels=1024"]),
    ("8", []),  # below the folder's min_pixels (16 x 16): scaled up
    ("8x20", ["data.min_pixels=1024"]),  # below data.min_pixels
    ("40x24", ["data.min_pixels=512", "data.max_pixels=2048"]),  # between: sides rounded to whole merged patches
    ("200x10", []),  # a thin image: its short side rounds to no merged patch, scaled up
])
def test_plan_counts_the_image_tokens_the_processor_makes_within_the_runs_pixel_bounds(tiny_vlm_folder, monkeypatch,
                                                                                        image_size, bounds):
    """--image-size counts the tokens of the image as the model's processor resizes it, within data.min_pixels and
    data.max_pixels and the folder's own bounds where those bind, not of the image's raw size."""
    from reinforge.cli import _image_side, main
    from reinforge.models.vision import processor_for
    from reinforge.workers import memory_settings

    seen = []
    monkeypatch.setattr(memory_settings, "memory_plan", lambda config: seen.append(config) or _Plan())
    assert main(["plan", f"model.path={tiny_vlm_folder}", "--image-size", image_size, "trainer.device=cpu",
                 "--host-memory-gib", "1000", *bounds]) == 0
    values = dict(bound.split("=") for bound in bounds)
    processor = processor_for(tiny_vlm_folder, min_pixels=int(values.get("data.min_pixels", 0)) or None,
                              max_pixels=int(values.get("data.max_pixels", 0)) or None)
    assert seen[0].data.max_image_tokens == processor_image_tokens(processor, *_image_side(image_size))


@pytest.mark.parametrize("flags, bounds", [
    (["--image-size", "1036"], []),  # above transformers' default max_pixels of the family's image processor
    (["--image-size", "1036"], ["data.max_pixels=200704"]),
    (["--image-size", "56"], ["data.min_pixels=50176"]),
    ([], ["data.max_pixels=100352"]),  # the bench's 448 x 448 image, scaled down
])
def test_plan_of_the_vl_bench_shape_resizes_its_image_as_the_familys_processor(monkeypatch, flags, bounds):
    """A shape is config.json alone: its image is resized as transformers' Qwen2-VL image processor resizes it (the
    tower's patches, transformers' default bounds) within the command line's pixel bounds, and the prompt holds the
    resized image's tokens beside its text."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from reinforge.bench.vision import IMAGE_SIDE
    from reinforge.cli import _image_side, main
    from reinforge.models.tiny_vlm import build_vision_tokenizer
    from reinforge.models.vision import PROCESSOR_CLASSES, image_only_processor
    from reinforge.workers import memory_settings

    seen = []
    monkeypatch.setattr(memory_settings, "memory_plan", lambda config: seen.append(config) or _Plan())
    assert main(["plan", "--model", "qwen2.5-vl-3b", *flags, "--gpu-memory-gib", "141", "trainer.device=cuda",
                 *bounds]) == 0
    image_processor = Qwen2VLImageProcessorPil(**{key[len("data."):]: int(value)
                                                  for key, value in (bound.split("=") for bound in bounds)})
    processor = image_only_processor(PROCESSOR_CLASSES["qwen2_5_vl"], image_processor, build_vision_tokenizer())
    expected = processor_image_tokens(processor, *_image_side(flags[-1] if flags else str(IMAGE_SIDE)))
    assert (seen[0].data.max_image_tokens, seen[0].data.max_prompt_length) == (expected, 128 + expected)


GEMMA3_4B_VISION = dict(hidden_size=1152, image_size=896, intermediate_size=4304, model_type="siglip_vision_model",
                        num_attention_heads=16, num_hidden_layers=27, patch_size=14, vision_use_head=False)
GEMMA3_4B_TEXT = dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262208)


def test_a_multimodal_wrapper_trained_on_text_counts_its_towers_frozen_weights(tmp_path, capsys):
    """Gemma 3 4B-27B load as their multimodal wrapper, whose SigLIP tower and projector (0.42B at 4B, 10% of the
    model) the text prompts never run but every copy of the model holds."""
    from reinforge.cli import main

    config = dict(model_type="gemma3", vision_config=GEMMA3_4B_VISION, text_config=GEMMA3_4B_TEXT,
                  mm_tokens_per_image=256)
    shape = ModelShape.from_hf_config(config)
    assert shape.vision is None and shape.wrapper_params == 419_816_304  # the tower and projector transformers builds
    assert 3.8e9 < shape.num_params < 3.95e9  # the language model's own count is unchanged
    text_only = dataclasses.replace(shape, wrapper_params=0)
    run = RunShape(prompts=8, samples_per_prompt=4, prompt_length=256, response_length=256, reference=True)
    for lora, masters in ((0, 4), (16, 2)):
        phases, _ = estimate(shape, dataclasses.replace(run, lora_rank=lora), Settings())
        without, _ = estimate(text_only, dataclasses.replace(run, lora_rank=lora), Settings())
        grown = sum(phases["update"].values()) - sum(without["update"].values())
        reference = 0 if lora else 2
        assert grown == pytest.approx((masters + reference) * shape.wrapper_params)
    assert ModelShape.from_hf_config(GEMMA3_4B_TEXT).wrapper_params == 0  # Gemma 3 1B's text model has none
    folder = tmp_path / "gemma3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["plan", f"model.path={folder}", "--gpu-memory-gib", "141", "--host-memory-gib", "1000",
                 "trainer.device=cuda"]) == 0
    assert ("multimodal wrapper: 0.42B parameters beside the language model (its vision tower and projector), "
            "loaded and frozen; prompts are text") in capsys.readouterr().out
