"""The vision-language case of `reinforge bench train` (bench.vision): the Qwen2.5-VL-3B shape, its prompts, and a
tiny step on the CPU through the native engine."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from reinforge.bench.shapes import SHAPES
from reinforge.bench.train import bench_train_main, build_config, parse_args, run_variant, write_model
from reinforge.bench.vision import VisionPrompts

QWEN25_VL_3B_PARAMS = 3.75
"""Billions, as the published Qwen2.5-VL-3B-Instruct reports them (vision tower included)."""


def test_the_shape_builds_qwen25_vl_3b_with_the_published_parameter_count():
    shape = SHAPES["qwen2.5-vl-3b"]
    assert shape.vision and shape.trl_script == "trl_grpo_vl.py"
    config = AutoConfig.for_model(shape.family, **{k: v for k, v in shape.config.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    built = sum(parameter.numel() for parameter in {id(p): p for p in model.parameters()}.values())
    assert built / 1e9 == pytest.approx(QWEN25_VL_3B_PARAMS, abs=0.01)
    assert config.text_config.hidden_size == 2048 and config.vision_config.out_hidden_size == 2048


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("vl"), tiny=True, size="qwen2.5-vl-3b")


def test_prompts_are_the_processors_with_one_image_each(tiny_vl_dir):
    args = parse_args(["--model", "qwen2.5-vl-3b", "--cpu"])
    prompts = VisionPrompts(tiny_vl_dir, args)
    batch = prompts.batch(0)
    assert len(batch) == args.prompts * args.n
    config = AutoConfig.from_pretrained(tiny_vl_dir)
    merge = config.vision_config.spatial_merge_size
    for row, images in zip(batch["input_ids"], batch.non_tensors["multi_modal_inputs"], strict=True):
        grid = images["image_grid_thw"]
        assert grid.shape == (1, 3) and images["pixel_values"].shape[0] == int(grid.prod())
        assert int((row == config.image_token_id).sum()) == int(grid.prod()) // merge**2
    assert batch["input_ids"].shape[1] == prompts.prompt_length
    assert torch.equal(prompts.batch(0)["input_ids"], batch["input_ids"])  # the same prompts when asked again
    # the run's plan counts the tower's patches of these image tokens, not of every prompt token
    assert prompts.image_tokens == int(batch.non_tensors["multi_modal_inputs"][0]["image_grid_thw"].prod()) // merge**2
    args.vision_prompts = prompts
    assert build_config(tiny_vl_dir, args).data.max_image_tokens == prompts.image_tokens < prompts.prompt_length


@pytest.mark.slow
def test_a_tiny_step_rolls_out_with_the_native_engine_and_times_the_vision_tower(tiny_vl_dir):
    args = parse_args(["--model", "qwen2.5-vl-3b", "--cpu", "--steps", "1"])
    args.rollout = "native"
    result = run_variant(args, tiny_vl_dir)
    [step] = result["steps"]
    assert step["response_tokens"] == args.prompts * args.n * args.response_tokens
    assert 0 < step["rollout_vision_encode_s"] < step["rollout_s"]


@pytest.mark.slow
def test_the_results_file_holds_the_options_and_not_the_prompt_objects(tiny_vl_dir, tmp_path):
    path = tmp_path / "result.json"
    assert bench_train_main(["--model", "qwen2.5-vl-3b", "--cpu", "--steps", "1", "--model-dir", str(tiny_vl_dir),
                             "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert len(result["steps"]) == 1 and result["settings"]["model"] == "qwen2.5-vl-3b"
    assert "vision_prompts" not in result["settings"]


def test_the_shape_folder_loads_and_its_processor_makes_256_image_tokens_of_a_448_image(tmp_path, monkeypatch):
    """The GPU path's folder (the shape's config with fewer and narrower layers, to build on the CPU): the model
    class loads it, and each 448 x 448 image is 32 x 32 patches of 14 pixels, 256 tokens once merged."""
    import dataclasses

    from reinforge.bench import shapes

    small = dict(shapes.SHAPES["qwen2.5-vl-3b"].config, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=64, vocab_size=512,
                 vision_config=dict(shapes.SHAPES["qwen2.5-vl-3b"].config["vision_config"], depth=1, hidden_size=32,
                                    intermediate_size=32, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[0]))
    monkeypatch.setitem(shapes.SHAPES, "qwen2.5-vl-3b", dataclasses.replace(shapes.SHAPES["qwen2.5-vl-3b"],
                                                                            config=small))
    model_dir = write_model(tmp_path, tiny=False, size="qwen2.5-vl-3b")
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    assert model.config.vision_config.patch_size == 14 and model.config.text_config.rope_parameters["mrope_section"]
    args = parse_args(["--model", "qwen2.5-vl-3b", "--prompts", "2", "--n", "1", "--prompt-tokens", "16"])
    batch = VisionPrompts(model_dir, args).batch(0)
    for row, images in zip(batch["input_ids"], batch.non_tensors["multi_modal_inputs"], strict=True):
        assert images["image_grid_thw"].tolist() == [[1, 32, 32]]
        assert int((row == model.config.image_token_id).sum()) == 256


def test_trl_runs_its_vision_language_script_beside_the_shape(tmp_path, monkeypatch):
    from pathlib import Path

    from reinforge.bench import sizes

    args = parse_args(["--model", "qwen2.5-vl-3b", "--trl", "--steps", "2"])
    runner = sizes.CaseRunner(args, [], tmp_path, {})
    commands = []
    monkeypatch.setattr(runner, "run_case", lambda kind, size, command, path, env=None: commands.append(command))
    runner.run_trl("qwen2.5-vl-3b", tmp_path / "model", Path("benchmarks") / "trl_grpo.py")
    runner.run_trl("3b", tmp_path / "model", Path("benchmarks") / "trl_grpo.py")
    assert [Path(command[1]).name for command in commands] == ["trl_grpo_vl.py", "trl_grpo.py"]
    assert commands[0][commands[0].index("--steps") + 1] == "2"
    assert (Path(__file__).parents[2] / "benchmarks" / "trl_grpo_vl.py").is_file()
