"""The vision demo: its pictures and rows, its reward, and a shortened SFT + GRPO run that raises held-out accuracy."""

from __future__ import annotations

import io
import random

import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from reinforge.demo.vision_reward import compute_score
from reinforge.demo.vision_task import BLUE, CELL, RED, VisionDemoTask, draw_picture


def test_pictures_hold_the_counted_red_squares():
    rng = random.Random(3)
    for _ in range(20):
        picture, num_red = draw_picture(rng)
        image = Image.open(io.BytesIO(picture)).convert("RGB")
        centres = [image.getpixel((x * CELL + CELL // 2, y * CELL + CELL // 2)) for y in range(2) for x in range(2)]
        assert image.size == (32, 32) and 1 <= num_red <= 3
        assert centres.count(RED) == num_red and centres.count(BLUE) <= 4 - num_red


def test_rows_are_verls_and_sft_answers_carry_the_flaw(tmp_path):
    files = VisionDemoTask(num_train=20, num_test=10, num_sft=400).write(tmp_path)
    row = pq.read_table(files["test"]).to_pylist()[0]
    assert row["prompt"][0]["content"] == "<image>How many red squares?" and len(row["images"]) == 1
    assert row["reward_model"]["ground_truth"] in ("1", "2", "3")
    conversations = pq.read_table(files["sft_train"]).to_pylist()
    overcounted = 0
    for conversation in conversations:
        image = Image.open(io.BytesIO(conversation["images"][0]["bytes"])).convert("RGB")
        count = [image.getpixel((x * CELL + 8, y * CELL + 8)) for y in range(2) for x in range(2)].count(RED)
        answer = int(conversation["messages"][1]["content"])
        assert answer in (count, count + 1)
        overcounted += answer == count + 1
    assert 0.5 < overcounted / len(conversations) < 0.7


def test_the_reward_is_the_exact_count():
    assert compute_score("2", "2") == {"score": 1.0, "acc": True}
    assert compute_score("3", "2")["score"] == 0.0 and not compute_score("2 squares", "2")["acc"]


@pytest.mark.slow
def test_a_short_sft_then_grpo_run_raises_held_out_accuracy(tmp_path):
    from reinforge.demo.vision_runner import VisionDemoSettings, run_vision_demo

    # SFT teaches the flaw (held-out accuracy 0 after it on a 2-core CPU); 3 GRPO steps took it to 0.67
    settings = VisionDemoSettings(sft_steps=200, total_steps=3, test_every=3, save_every=3, num_val=64)
    task = VisionDemoTask(num_train=200, num_test=64, num_sft=3000)
    result = run_vision_demo(tmp_path / "run", settings=settings, task=task, device="cpu", loggers=("jsonl",),
                             plots=False)
    assert result["after"] - result["before"] >= 0.25, result
    from transformers import AutoModelForImageTextToText

    from reinforge.models.vision import load_processor
    from reinforge.trainer.export import export_checkpoint

    models = []
    for folder in (tmp_path / "run" / "final_model", export_checkpoint(tmp_path / "run", tmp_path / "exported")):
        models.append(AutoModelForImageTextToText.from_pretrained(folder))
        assert type(models[-1]).__name__ == "Qwen2_5_VLForConditionalGeneration"
        assert load_processor(folder).image_processor.patch_size == 8
    for (name, final), (_, exported) in zip(models[0].state_dict().items(), models[1].state_dict().items(), strict=True):
        assert torch.equal(final, exported), name
