"""What a one-step GRPO run writes: the checkpoint's hf/ and ``reinforge export``'s folder."""

from __future__ import annotations

import json
from pathlib import Path

from reinforge.cli import main
from reinforge.models import save_tiny_model

GENERATION = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "eos_token_id": [2, 1]}
"""Sampling defaults a released model ships with, which the folders must keep."""

LORA_RANK, LORA_ALPHA = 4, 64.0


def train_and_export(root: Path, arch: str, data: Path, lora: bool) -> tuple[Path, Path, Path]:
    """(the input model, the checkpoint, the exported folder) of a one-step run on a tiny ``arch`` model."""
    model_dir = save_tiny_model(root / "model", arch)
    generation_file = model_dir / "generation_config.json"
    generation_file.write_text(json.dumps(json.loads(generation_file.read_text()) | GENERATION))
    run_dir = root / "run"
    args = {"model.path": model_dir, "data.train_files": f"[{data / 'train.parquet'}]", "data.train_batch_size": 2,
            "data.max_prompt_length": 64, "data.max_response_length": 4, "rollout.n": 2,
            "trainer.output_dir": run_dir, "trainer.loggers": "[jsonl]", "trainer.total_steps": 1,
            "trainer.val_before_train": False, "actor.optim.lr": 1e-2, "actor.entropy_coeff": 0.5,
            "reward.num_workers": 0}
    if lora:
        args |= {"model.lora.rank": LORA_RANK, "model.lora.alpha": LORA_ALPHA}
    assert main(["train", *(f"{key}={value}" for key, value in args.items())]) == 0
    assert main(["export", str(run_dir), str(root / "exported")]) == 0
    [checkpoint] = (run_dir / "checkpoints").glob("step_*")
    return model_dir, checkpoint, root / "exported"


def test_export_keeps_the_generation_config_of_the_checkpoint(arithmetic_data_dir, tmp_path):
    model_dir, checkpoint, exported = train_and_export(tmp_path, "qwen2", arithmetic_data_dir, lora=False)
    for folder in (checkpoint / "hf", exported):
        saved = json.loads((folder / "generation_config.json").read_text())
        assert {key: saved.get(key) for key in GENERATION} == GENERATION, folder
