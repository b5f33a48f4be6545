"""The reward setup fails before any model loads, and a dataset's extra columns reach a TRL-style reward in a run."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import reinforge.trainer.rl_trainer as rl_trainer
from reinforge.cli import main

REWARDS = '''
def compute_score(solution_str, ground_truth, /):
    return 0.0


def answer_is_yes(completions, answer, **kwargs):
    """TRL's kind: reads the dataset's 'answer' column, never the response."""
    return [1.0 if value == "yes" else 0.0 for value in answer]
'''


class NoModelsHere:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a model started loading before the reward setup was checked")


def run_args(model: Path, train_file: Path, run_dir: Path, reward: str) -> list[str]:
    return [f"model.path={model}", f"data.train_files=[{train_file}]", "data.train_batch_size=2",
            "data.max_prompt_length=64", "data.max_response_length=4", "rollout.n=2", f"trainer.output_dir={run_dir}",
            "trainer.loggers=[jsonl]", "trainer.total_steps=1", "trainer.val_before_train=false",
            "reward.num_workers=0", f"reward.custom_function={reward}"]


@pytest.fixture
def rewards_file(tmp_path) -> Path:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def write_rows(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_bad_reward_function_and_unscorable_rows_fail_before_any_model(tiny_model_dir, arithmetic_data_dir,
                                                                       rewards_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rl_trainer, "ActorRolloutWorker", NoModelsHere)
    train = arithmetic_data_dir / "train.parquet"
    # path.py without :name is path.py:compute_score, whose positional-only arguments we cannot pass
    assert main(["train", *run_args(tiny_model_dir, train, tmp_path / "a", str(rewards_file))]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: scorer compute_score in") and "by position only" in line

    rows = [{"prompt": [{"role": "user", "content": "hi"}], "data_source": "my/task"}] * 2
    unscorable = write_rows(tmp_path / "unscorable.parquet", rows)
    args = run_args(tiny_model_dir, unscorable, tmp_path / "b", "")
    assert main(["train", *[arg for arg in args if not arg.startswith("reward.custom_function")]]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: row 0 of {unscorable} has data_source 'my/task', which has no scorer")


def test_a_trl_reward_reads_the_datasets_columns(tiny_model_dir, rewards_file, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"say {index}"}], "answer": "yes"} for index in range(4)]
    train = write_rows(tmp_path / "train.parquet", rows)
    run_dir = tmp_path / "run"
    assert main(["train", *run_args(tiny_model_dir, train, run_dir, f"{rewards_file}:answer_is_yes")]) == 0
    [metrics] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics["critic/score/mean"] == 1.0
