"""What the demo trains on, and the shape of its model: one place for the numbers both stages share.

The task is the built-in arithmetic task (addition and subtraction of 1- and 2-digit numbers,
answered with the number alone); train and held-out problems never overlap. The model is a
small Qwen2 with the character tokenizer, so every digit is one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from reinforge.data.tasks.arithmetic import write_arithmetic_dataset

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
MODEL_DIR = ASSETS_DIR / "model"
"""The committed demo model (weights, config, tokenizer.json with its chat template)."""
MODEL_CARD = "reinforge_demo.json"
"""Written into the model folder: how it was built and its held-out accuracy."""


@dataclass(frozen=True)
class DemoTask:
    min_digits: int = 1
    max_digits: int = 2
    num_train: int = 8000
    num_test: int = 200
    seed: int = 0
    max_prompt_length: int = 96
    max_response_length: int = 8
    """Answers have at most 3 digits, then <|im_end|>."""

    def write(self, out_dir: str | Path) -> dict[str, str]:
        """train.parquet and test.parquet (RL rows) and sft_train.parquet (conversations) under ``out_dir``."""
        return write_arithmetic_dataset(out_dir, num_train=self.num_train, num_test=self.num_test, seed=self.seed,
                                        min_digits=self.min_digits, max_digits=self.max_digits)


@dataclass(frozen=True)
class DemoModel:
    arch: str = "qwen2"
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 128
    seed: int = 0


TASK = DemoTask()
MODEL = DemoModel()
