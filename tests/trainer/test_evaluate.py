"""reinforge eval: greedy accuracy of a model on RL-schema prompts, in the validation metrics' names."""

from __future__ import annotations

import json
from pathlib import Path

from reinforge.config import load_config
from reinforge.trainer.evaluate import eval_main, evaluate, is_override


def test_evaluate_reports_mean_accuracy(tiny_model_dir, arithmetic_data_dir):
    config = load_config(None, [f"model.path={tiny_model_dir}", f"data.val_files=[{arithmetic_data_dir / 'test.parquet'}]",
                                "data.max_response_length=4", "trainer.device=cpu", "reward.num_workers=0"])
    metrics = evaluate(config)
    assert 0.0 <= metrics["val-core/arithmetic/acc/mean@1"] <= 1.0


def test_eval_command_prints_json(tiny_model_dir, arithmetic_data_dir, capsys):
    assert eval_main([str(tiny_model_dir), str(arithmetic_data_dir / "test.parquet"), "data.max_response_length=4",
                      "rollout.val_kwargs.n=2", "rollout.val_kwargs.temperature=1.0", "reward.num_workers=0"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert "val-core/arithmetic/acc/best@2" in metrics


def test_eval_names_a_missing_file_or_model_folder_as_given_on_its_command_line(tiny_model_dir, arithmetic_data_dir,
                                                                                 tmp_path):
    import pytest

    from reinforge.config import ConfigError

    with pytest.raises(ConfigError, match=r"^reinforge eval: data file 'nosuch.parquet' does not exist .*give a "
                                          r"parquet or JSONL file of prompts$"):
        eval_main([str(tiny_model_dir), "nosuch.parquet"])
    with pytest.raises(ConfigError, match=r"^reinforge eval: model folder '.*no_model' does not exist"):
        eval_main([str(tmp_path / "no_model"), str(arithmetic_data_dir / "test.parquet")])
    partitioned = tmp_path / "split=test"  # a data file whose path holds '=' was taken for an a.b=c override
    partitioned.mkdir()
    (partitioned / "test.parquet").write_bytes((arithmetic_data_dir / "test.parquet").read_bytes())
    with pytest.raises(ConfigError, match=r"^reinforge eval: data file '.*split=test/nosuch.parquet' does not exist"):
        eval_main([str(tiny_model_dir), str(partitioned / "nosuch.parquet")])
    assert is_override("data.max_response_length=4") and not is_override(str(partitioned / "test.parquet"))
    assert not is_override(f"{partitioned}/*.parquet")


def sealed_checkpoint(run: Path, step: int, model: Path) -> Path:
    """RUN/checkpoints/step_N with ``model`` as its hf/ and a manifest of its files, as a run writes it."""
    import shutil

    import torch

    from reinforge.trainer.checkpoint import seal

    checkpoint = run / "checkpoints" / f"step_{step:06d}"
    shutil.copytree(model, checkpoint / "hf")
    torch.save({"step": step}, checkpoint / "trainer_state.pt")
    seal(checkpoint, step)
    return checkpoint


def test_eval_of_a_run_folder_takes_its_newest_complete_checkpoint_and_refuses_a_damaged_one_before_loading(
        tiny_model_dir, arithmetic_data_dir, tmp_path, caplog, monkeypatch):
    """The newest checkpoint was read whatever its state: one cut off mid-copy failed once the data and the memory
    plan were done, where resume and export take the newest complete one; weights of other shapes than the config
    failed as the model loaded."""
    import logging

    import pytest

    from reinforge.config import ConfigError
    from reinforge.trainer import evaluate as evaluate_module

    monkeypatch.setattr(evaluate_module, "evaluate", lambda config: {"model": config.model.path})
    data = str(arithmetic_data_dir / "test.parquet")
    run = tmp_path / "run"
    older = sealed_checkpoint(run, 1, tiny_model_dir)
    newest = sealed_checkpoint(run, 2, tiny_model_dir)
    weights = newest / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # cut off after its manifest was written
    with caplog.at_level(logging.WARNING, logger="reinforge.trainer.evaluate"):
        assert eval_main([str(run), data]) == 0
    assert [record.getMessage() for record in caplog.records] == [
        f"evaluating step_000001, the newest complete checkpoint of {run}; skipped step_000002: hf/model.safetensors "
        f"has 1000 bytes, the manifest says {(older / 'hf' / 'model.safetensors').stat().st_size} (truncated or "
        "changed)"]
    with pytest.raises(ConfigError, match=r"^reinforge eval: checkpoint .*step_000002 is incomplete: "
                                          r"hf/model.safetensors has 1000 bytes, .*; give another checkpoint, or the "
                                          r"run folder .*run for its newest complete one$"):
        eval_main([str(newest), data])
    with pytest.raises(ConfigError, match=r"^reinforge eval: model folder .*step_000002/hf is half-written"):
        eval_main([str(newest / "hf"), data])
    weights.unlink()  # removed to save space: export writes the model from actor_state.pt
    with pytest.raises(ConfigError, match=r"^reinforge eval: .*step_000002/hf holds no weights; run `reinforge export"):
        eval_main([str(newest), data])
    (older / "hf" / "config.json").write_text((older / "hf" / "config.json").read_text().replace(
        '"intermediate_size": ', '"intermediate_size": 1'))  # shapes the weights do not have
    with pytest.raises(ConfigError, match=r"^reinforge eval: .*step_000001/hf: its weights do not fit its "
                                          r"config.json \(.* in the weights, .* in the model config.json builds"):
        eval_main([str(older / "hf"), data])
    with pytest.raises(ConfigError, match=r"^reinforge eval: run folder .*run has no complete checkpoint "
                                          r"\(step_000002: .*; step_000001: .*\)"):
        eval_main([str(run), data])


def test_eval_reads_a_checkpoint_folder_or_a_run_folder_as_serve_does(tiny_model_dir, arithmetic_data_dir, tmp_path,
                                                                      capsys):
    """A checkpoint folder was refused as a tokenizer folder without tokenizer files; a run folder the same."""

    import pytest

    from reinforge.config import ConfigError
    from reinforge.trainer.evaluate import model_folder

    run = tmp_path / "run"
    checkpoint = sealed_checkpoint(run, 3, tiny_model_dir)
    assert model_folder(str(checkpoint)) == str(checkpoint / "hf")
    assert model_folder(str(run)) == str(checkpoint / "hf")
    assert eval_main([str(run), str(arithmetic_data_dir / "test.parquet"), "data.max_response_length=4",
                      "reward.num_workers=0"]) == 0
    assert "val-core/arithmetic/acc/mean@1" in json.loads(capsys.readouterr().out)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model_dir)}))
    with pytest.raises(ConfigError, match=r"^reinforge eval: .*adapter is a LoRA adapter folder; give the HF folder"):
        eval_main([str(tmp_path / "adapter"), str(arithmetic_data_dir / "test.parquet")])
    with pytest.raises(ConfigError, match=r"^reinforge eval: .* is neither an HF model folder"):
        eval_main([str(tmp_path), str(arithmetic_data_dir / "test.parquet")])
