"""The model shapes of `reinforge bench train --model` (bench.shapes): published sizes, and each runs tiny on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from reinforge.bench.shapes import SHAPES
from reinforge.engine.memory_plan import ModelShape

PUBLISHED = {"gemma2-2b": 2.61, "phi3-mini": 3.82, "olmo2-1b": 1.48, "mistral-7b": 7.24, "olmoe-1b-7b": 6.92,
             "qwen3-30b-a3b": 30.53}
"""Parameters in billions, as the published models report them."""
NEW_SHAPES = tuple(PUBLISHED)


@pytest.mark.parametrize("name", NEW_SHAPES)
def test_each_shape_builds_its_family_with_the_published_parameter_count(name):
    shape = SHAPES[name]
    keys = {key: value for key, value in shape.config.items() if key != "model_type"}
    config = AutoConfig.for_model(shape.family, **keys)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    built = sum(parameter.numel() for parameter in {id(p): p for p in model.parameters()}.values())
    planned = ModelShape.from_hf_config(shape.config)
    assert built / 1e9 == pytest.approx(PUBLISHED[name], abs=0.01)
    assert planned.num_params == pytest.approx(built, rel=1e-3)  # the planner's count leaves out small norms only
    assert (planned.num_active_params < planned.num_params) == (shape.family in ("olmoe", "qwen3_moe"))
    assert shape.training == ("LoRA r32" if name == "qwen3-30b-a3b" else "full")


@pytest.mark.parametrize("name", NEW_SHAPES)
def test_each_shape_runs_a_grpo_step_tiny_on_the_cpu(name, tmp_path):
    from reinforge.bench.train import bench_train_main

    path = tmp_path / "result.json"
    assert bench_train_main(["--model", name, "--cpu", "--steps", "1", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["shape"]["family"] == SHAPES[name].family and result["median"]["step_s"] > 0
    moe = SHAPES[name].family in ("olmoe", "qwen3_moe")
    assert ("moe_aux_loss" in result["steps"][0]) == moe
