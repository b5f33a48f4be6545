"""The built-in arithmetic task: multi-digit addition and subtraction as chat questions.

A problem reads "What is 47 + 385? Answer with the number only." and its ground truth is
"432". Difficulty is set by the number of digits of each operand and the operators used;
subtraction puts the larger operand first unless negative answers are allowed, which keeps
the task within reach of a tiny model.

Train and held-out problems never overlap: a hash of the problem's text decides its split,
so a problem lands in the same split whatever the seed or the number of rows asked for.
Rows come in the RL schema (``data_source`` "arithmetic", scored by exact integer match) and
as SFT conversations (``messages`` with the assistant's answer) for a supervised warm-up.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reinforge.atomic_files import replaced_atomically

DATA_SOURCE = "arithmetic"
ANSWER_FORMAT = "Answer with the number only."
OPERATORS = ("+", "-")
SPLITS = ("train", "test")


@dataclass(frozen=True)
class ArithmeticProblem:
    left: int
    operator: str
    right: int

    @property
    def expression(self) -> str:
        return f"{self.left} {self.operator} {self.right}"

    @property
    def question(self) -> str:
        return f"What is {self.expression}? {ANSWER_FORMAT}"

    @property
    def answer(self) -> int:
        return self.left + self.right if self.operator == "+" else self.left - self.right


def split_of(problem: ArithmeticProblem, test_fraction: float = 0.1) -> str:
    """'test' for a fixed ``test_fraction`` of all problems (chosen by hash), 'train' for the rest."""
    digest = hashlib.sha256(problem.expression.encode()).digest()
    bucket = int.from_bytes(digest[:8], "big") / 2**64
    return "test" if bucket < test_fraction else "train"


def generate_problems(num_problems: int, split: str, seed: int = 0, min_digits: int = 1, max_digits: int = 3,
                      operators: tuple[str, ...] = OPERATORS, allow_negative: bool = False,
                      test_fraction: float = 0.1) -> list[ArithmeticProblem]:
    """``num_problems`` distinct problems of ``split``, each operand with min..max digits."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    if num_problems < 0:
        raise ValueError(f"num_problems={num_problems} must be 0 or more")
    unknown = [operator for operator in operators if operator not in OPERATORS]
    if unknown or not operators:
        raise ValueError(f"operators {list(operators)} must be a non-empty selection of {', '.join(OPERATORS)}")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"digits must satisfy 1 <= min_digits ({min_digits}) <= max_digits ({max_digits})")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} must lie strictly between 0 and 1")
    rng = random.Random(f"arithmetic-{split}-{seed}")
    problems: dict[ArithmeticProblem, None] = {}
    for _ in range(50 * num_problems + 1000):
        if len(problems) == num_problems:
            break
        problem = _random_problem(rng, min_digits, max_digits, operators, allow_negative)
        if split_of(problem, test_fraction) == split:
            problems[problem] = None
    if len(problems) < num_problems:
        raise ValueError(f"found only {len(problems)} distinct {split} problems with {min_digits}-{max_digits} "
                         f"digits, fewer than the {num_problems} asked for; allow more digits or ask for fewer")
    return list(problems)


def _random_problem(rng: random.Random, min_digits: int, max_digits: int, operators: tuple[str, ...],
                    allow_negative: bool) -> ArithmeticProblem:
    def operand() -> int:
        digits = rng.randint(min_digits, max_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    left, right, operator = operand(), operand(), rng.choice(operators)
    if operator == "-" and not allow_negative and left < right:
        left, right = right, left
    return ArithmeticProblem(left, operator, right)


def make_rl_rows(problems: list[ArithmeticProblem], split: str) -> list[dict[str, Any]]:
    """Rows in the RL schema; the ground truth is the answer as a string."""
    return [{
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"split": split, "index": index, "expression": problem.expression},
    } for index, problem in enumerate(problems)]


def make_sft_rows(problems: list[ArithmeticProblem], wrong_sign_fraction: float = 0.0,
                  seed: int = 0) -> list[dict[str, Any]]:
    """Conversations with the assistant's answer, for a supervised warm-up.

    ``wrong_sign_fraction`` > 0 writes flawed data on purpose: that fraction of the subtraction
    problems with a non-zero answer (a seeded choice) is answered with the wrong sign ("-25" for
    "47 - 22"), the kind of systematic error imperfect SFT data carries. A model trained on it
    learns the arithmetic but prefers the wrong sign on subtraction; the RL rows and their reward
    are unaffected.
    """
    if not 0.0 <= wrong_sign_fraction <= 1.0:
        raise ValueError(f"wrong_sign_fraction={wrong_sign_fraction} must lie between 0 and 1")
    rng = random.Random(f"arithmetic-sft-wrong-sign-{seed}")
    rows = []
    for problem in problems:
        answer = problem.answer
        if problem.operator == "-" and answer != 0 and rng.random() < wrong_sign_fraction:
            answer = -answer
        rows.append({"messages": [{"role": "user", "content": problem.question},
                                  {"role": "assistant", "content": str(answer)}]})
    return rows


def write_arithmetic_dataset(out_dir: str | Path, num_train: int = 2000, num_test: int = 200, seed: int = 0,
                             min_digits: int = 1, max_digits: int = 3, operators: tuple[str, ...] = OPERATORS,
                             sft_wrong_sign_fraction: float = 0.0) -> dict[str, str]:
    """``train.parquet``, ``test.parquet`` (RL rows) and ``sft_train.parquet`` under ``out_dir``.

    ``sft_wrong_sign_fraction`` flaws the SFT conversations only (see ``make_sft_rows``).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    problems = {split: generate_problems(count, split, seed, min_digits, max_digits, operators)
                for split, count in (("train", num_train), ("test", num_test))}
    tables = {
        "train": make_rl_rows(problems["train"], "train"),
        "test": make_rl_rows(problems["test"], "test"),
        "sft_train": make_sft_rows(problems["train"], sft_wrong_sign_fraction, seed),
    }
    written = {}
    for name, rows in tables.items():  # each file whole or not at all: an interrupted run leaves no cut-off table
        written[name] = str(out / f"{name}.parquet")
        with replaced_atomically(written[name], durable=False) as partial:
            pq.write_table(pa.Table.from_pylist(rows), partial)
    return written
