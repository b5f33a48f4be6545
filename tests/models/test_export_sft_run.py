"""``reinforge export`` of an SFT run computing in bfloat16: the dtypes of hf/ and of the export, a checkpoint whose
hf/ weights were removed, an output folder inside the run's checkpoints folder."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from reinforge.cli import main
from reinforge.config import load_sft_config
from reinforge.models import save_tiny_model
from reinforge.trainer.export import export_checkpoint
from reinforge.trainer.sft_trainer import SFTTrainer


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A one-step SFT run folder on the tiny model, computing in bfloat16."""
    root = tmp_path_factory.mktemp("sft-export")
    model_dir = save_tiny_model(root / "model")
    train = root / "train.jsonl"
    train.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{index}?"},
                                                      {"role": "assistant", "content": str(index)}]}) + "\n"
                             for index in range(4)))
    SFTTrainer(load_sft_config(None, [f"model.path={model_dir}", f"data.train_files=[{train}]", "data.batch_size=4",
                                      "data.max_length=64", "trainer.total_steps=1", "trainer.device=cpu", "model.dtype=bfloat16",
                                      "trainer.loggers=[jsonl]", f"trainer.output_dir={root / 'run'}"])).fit()
    return root / "run"


def test_checkpoint_without_hf_weights_exports_from_actor_state(sft_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(sft_run, run)
    checkpoint = run / "checkpoints" / "step_000001"
    (checkpoint / "hf" / "model.safetensors").unlink()  # removed to save space, as the export docstring allows
    for source in (checkpoint, run):
        out = export_checkpoint(source, tmp_path / "out", force=True)
        exported = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
        trained = torch.load(checkpoint / "actor_state.pt", weights_only=True)["model"]
        assert torch.equal(exported.lm_head.weight, trained["lm_head.weight"].to(torch.bfloat16))


def test_checkpoint_and_export_are_in_the_compute_dtype_and_float32_exports_the_master_weights(sft_run, tmp_path):
    """hf/ and the default export hold the trained weights in the run's compute dtype, bfloat16, as their config.json
    says; actor_state.pt keeps the float32 master weights, which ``reinforge export --dtype float32`` writes as they
    are."""
    checkpoint = sft_run / "checkpoints" / "step_000001"
    trained = torch.load(checkpoint / "actor_state.pt", weights_only=True)["model"]
    assert {tensor.dtype for tensor in trained.values()} == {torch.float32}
    assert main(["export", str(sft_run), str(tmp_path / "master"), "--dtype", "float32"]) == 0
    for folder, dtype in ((checkpoint / "hf", torch.bfloat16), (export_checkpoint(sft_run, tmp_path / "out"), torch.bfloat16),
                          (tmp_path / "master", torch.float32)):
        assert json.loads((folder / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
        with safe_open(folder / "model.safetensors", framework="pt") as weights:
            saved = {name: weights.get_tensor(name) for name in weights.keys()}
        assert saved.keys() == trained.keys() - {"lm_head.weight"}, "the tied head is written once"
        for name, tensor in saved.items():
            assert tensor.dtype == dtype and torch.equal(tensor, trained[name].to(dtype)), (folder, name)


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


def test_export_into_the_working_folder_given_as_a_dot(sft_run, tmp_path, monkeypatch):
    out = tmp_path / "model"
    out.mkdir()
    monkeypatch.chdir(out)  # `reinforge export RUN .` from the empty folder the model is meant for
    assert main(["export", str(sft_run), "."]) == 0
    assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type
