"""What a one-step GRPO run writes: the checkpoint's hf/ and ``reinforge export``'s folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from reinforge.cli import main
from reinforge.models import save_tiny_model

GENERATION = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "eos_token_id": [2, 1]}
"""Sampling defaults a released model ships with, which the folders must keep."""

LORA_RANK, LORA_ALPHA = 4, 64.0


def train(root: Path, arch: str, data: Path, lora: bool) -> tuple[Path, Path]:
    """(the input model, the run folder) of a one-step run on a tiny ``arch`` model."""
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
    return model_dir, run_dir


def train_and_export(root: Path, arch: str, data: Path, lora: bool) -> tuple[Path, Path, Path]:
    """(the input model, the checkpoint, the exported folder) of a one-step run on a tiny ``arch`` model."""
    model_dir, run_dir = train(root, arch, data, lora)
    assert main(["export", str(run_dir), str(root / "exported")]) == 0
    [checkpoint] = (run_dir / "checkpoints").glob("step_*")
    return model_dir, checkpoint, root / "exported"


def test_export_keeps_the_generation_config_of_the_checkpoint(arithmetic_data_dir, tmp_path):
    model_dir, checkpoint, exported = train_and_export(tmp_path, "qwen2", arithmetic_data_dir, lora=False)
    for folder in (checkpoint / "hf", exported):
        saved = json.loads((folder / "generation_config.json").read_text())
        assert {key: saved.get(key) for key in GENERATION} == GENERATION, folder


def test_a_lora_export_interrupted_while_copying_the_adapters_leaves_no_folder(arithmetic_data_dir, tmp_path,
                                                                              monkeypatch):
    """The merged model and its adapter/ appear together: a failure half-way through the adapters leaves no
    model folder without them (a fresh export) and the previous export whole (one written over with --force)."""
    _, run_dir = train(tmp_path, "qwen2", arithmetic_data_dir, lora=True)
    previous = tmp_path / "previous"
    assert main(["export", str(run_dir), str(previous)]) == 0
    before = {path.relative_to(previous): path.read_bytes() for path in previous.rglob("*") if path.is_file()}
    copytree = shutil.copytree

    def fails_half_way(source, target, **kwargs):
        Path(target).mkdir(parents=True)
        shutil.copyfile(Path(source) / "adapter_config.json", Path(target) / "adapter_config.json")
        raise OSError("no space left on device")

    monkeypatch.setattr(shutil, "copytree", fails_half_way)
    for out, force in ((tmp_path / "fresh", []), (previous, ["--force"])):
        assert main(["export", str(run_dir), str(out), *force]) != 0
    monkeypatch.setattr(shutil, "copytree", copytree)
    assert not (tmp_path / "fresh").exists()
    assert {path.relative_to(previous): path.read_bytes() for path in previous.rglob("*") if path.is_file()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model", "previous", "run"]
