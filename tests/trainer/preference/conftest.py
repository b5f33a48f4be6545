"""Fixtures of the preference trainers' tests: synthetic pairs that prefer answers saying yes, and run arguments."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

CHOSEN = ("yes", "yes, sure", "ok yes")
REJECTED = ("no", "no, sorry", "ok no")


def write_pairs(path: Path, num_pairs: int, seed: int, first_question: int = 0) -> Path:
    """Conversational pairs with an explicit prompt: the chosen answer says yes, the rejected one no."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for index in range(num_pairs):
            row = {"prompt": [{"role": "user", "content": f"question {first_question + index}?"}],
                   "chosen": [{"role": "assistant", "content": rng.choice(CHOSEN)}],
                   "rejected": [{"role": "assistant", "content": rng.choice(REJECTED)}]}
            handle.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="session")
def pairs_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pairs")
    write_pairs(folder / "train.jsonl", 32, seed=0)
    write_pairs(folder / "val.jsonl", 16, seed=1, first_question=1000)
    return folder


@pytest.fixture
def pair_args(tiny_model_dir: Path, pairs_dir: Path) -> Callable[..., list[str]]:
    """``pair_args(run_dir, **{"a.b": value})``: ``a.b=c`` arguments of a 2-step rm or dpo run on the tiny model."""

    def build(run_dir: Path, **overrides: object) -> list[str]:
        settings = {"model.path": tiny_model_dir, "data.train_files": f"[{pairs_dir / 'train.jsonl'}]",
                    "data.batch_size": 8, "data.max_length": 48, "trainer.max_tokens_per_micro_batch": 256,
                    "trainer.output_dir": run_dir, "trainer.loggers": "[jsonl]", "trainer.total_steps": 2,
                    "trainer.device": "cpu", "optim.lr": 1e-3, "optim.warmup_ratio": 0, "optim.schedule": "constant"}
        settings.update(overrides)
        return [f"{key}={value}" for key, value in settings.items()]

    return build
