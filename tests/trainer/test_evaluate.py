"""reinforge eval: greedy accuracy of a model on RL-schema prompts, in the validation metrics' names."""

from __future__ import annotations

import json

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


def test_eval_reads_a_checkpoint_folder_or_a_run_folder_as_serve_does(tiny_model_dir, arithmetic_data_dir, tmp_path,
                                                                      capsys):
    """A checkpoint folder was refused as a tokenizer folder without tokenizer files; a run folder the same."""
    import shutil

    import pytest

    from reinforge.config import ConfigError
    from reinforge.trainer.evaluate import model_folder

    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_000003"
    shutil.copytree(tiny_model_dir, checkpoint / "hf")
    (checkpoint / "manifest.json").write_text("{}")
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
