"""``reinforge export`` of an SFT run: a checkpoint whose hf/ weights were removed, an output folder inside the run's
checkpoints folder."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from reinforge.config import load_sft_config
from reinforge.models import save_tiny_model
from reinforge.trainer.export import export_checkpoint
from reinforge.trainer.sft_trainer import SFTTrainer


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A one-step SFT run folder on the tiny model."""
    root = tmp_path_factory.mktemp("sft-export")
    model_dir = save_tiny_model(root / "model")
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{index}?"},
                                                      {"role": "assistant", "content": str(index)}]}) + "\n"
                             for index in range(4)))
    SFTTrainer(load_sft_config(None, [f"model.path={model_dir}", f"data.train_files=[{train}]", "data.batch_size=4",
                                      "data.max_length=64", "trainer.total_steps=1", "trainer.device=cpu",
                                      "trainer.loggers=[jsonl]", f"trainer.output_dir={root / 'run'}"])).fit()
    return root / "run"


def test_checkpoint_without_hf_weights_exports_from_actor_state(sft_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(sft_run, run)
    checkpoint = run / "checkpoints" / "step_000001"
    (checkpoint / "hf" / "model.safetensors").unlink()  # removed to save space, as the export docstring allows
    for source in (checkpoint, run):
        out = export_checkpoint(source, tmp_path / "out", force=True)
        exported = AutoModelForCausalLM.from_pretrained(out)
        trained = torch.load(checkpoint / "actor_state.pt", weights_only=True)["model"]
        torch.testing.assert_close(exported.lm_head.weight, trained["lm_head.weight"])


def test_checkpoint_with_a_damaged_file_is_still_refused(sft_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(sft_run, run)
    checkpoint = run / "checkpoints" / "step_000001"
    (checkpoint / "hf" / "model.safetensors").unlink()
    (checkpoint / "hf" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="hf/config.json has"):
        export_checkpoint(checkpoint, tmp_path / "out")
    with pytest.raises(ValueError, match="no checkpoint of .* is usable .*step_000001: hf/config.json has"):
        export_checkpoint(run, tmp_path / "out")


@pytest.mark.parametrize("name", ["step_000002", ".tmp-model", "exported"])
def test_output_inside_the_checkpoints_folder_is_refused(sft_run, name):
    out = sft_run / "checkpoints" / name
    with pytest.raises(FileExistsError, match="the run's checkpoints folder"):
        export_checkpoint(sft_run, out)
    assert not out.exists()
