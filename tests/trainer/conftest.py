"""Fixtures of the trainer tests: the command-line arguments of a tiny RL run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def rl_args(tiny_model_dir: Path, arithmetic_data_dir: Path) -> Callable[..., list[str]]:
    """``rl_args(run_dir, **{"a.b": value})``: ``a.b=c`` arguments of a 2-step GRPO run on the tiny model."""

    def build(run_dir: Path, **overrides: object) -> list[str]:
        settings = {
            "model.path": tiny_model_dir, "data.train_files": f"[{arithmetic_data_dir / 'train.parquet'}]",
            "data.train_batch_size": 4, "data.max_prompt_length": 64, "data.max_response_length": 8, "rollout.n": 4,
            "trainer.output_dir": run_dir, "trainer.loggers": "[jsonl]", "trainer.total_steps": 2,
            "trainer.val_before_train": False, "actor.optim.lr": 2e-3,
        }
        settings.update(overrides)
        return [f"{key}={value}" for key, value in settings.items()]

    return build
