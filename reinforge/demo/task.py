"""What the demo trains on, and the shape of its model: one place for the numbers both stages share.

The task is the built-in arithmetic task restricted to subtraction of 1- and 2-digit numbers
(the larger first, so answers are never negative), answered with the number alone; train and
held-out problems never overlap. The model is a small Qwen2 with the character tokenizer, so
every digit is one token.

The SFT conversations the demo model is built from are flawed on purpose, the way imperfect
supervised data often is: about 60% of them give the answer with the wrong sign ("-25" for
"47 - 22"). The model learns to subtract, and learns the flaw: it writes the minus sign more
often than not, so its greedy answers are mostly wrong while its sampled answers are often
right. The RL rows, the reward (exact integer match) and the held-out accuracy know nothing
of the flaw; GRPO finds out from the reward which answers are right and unlearns it.
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
    operators: tuple[str, ...] = ("-",)
    num_train: int = 4000
    """Of the about 4,500 distinct 1- and 2-digit subtractions outside the held-out split."""
    num_test: int = 200
    seed: int = 0
    sft_wrong_sign_fraction: float = 0.6
    """The share of SFT conversations (not RL rows) answered with the wrong sign; see the module docstring."""
    max_prompt_length: int = 96
    max_response_length: int = 8
    """Answers have at most 3 characters, then <|im_end|>."""

    def write(self, out_dir: str | Path) -> dict[str, str]:
        """train.parquet and test.parquet (RL rows) and sft_train.parquet (conversations) under ``out_dir``."""
        return write_arithmetic_dataset(out_dir, num_train=self.num_train, num_test=self.num_test, seed=self.seed,
                                        min_digits=self.min_digits, max_digits=self.max_digits,
                                        operators=tuple(self.operators),
                                        sft_wrong_sign_fraction=self.sft_wrong_sign_fraction)


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
