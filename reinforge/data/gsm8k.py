"""GSM8K (grade-school math) as RL rows: ``reinforge data gsm8k --src DIR --out DIR``.

The source is openai/grade-school-math's ``train.jsonl`` and ``test.jsonl`` (fields
``question`` and ``answer``; the answer's last line is ``#### N``). Each question becomes one
user message asking for step-by-step reasoning with the final answer after ``####``, which is
the format the ``openai/gsm8k`` scorer checks in strict mode.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reinforge.data.files import read_rows

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
SPLITS = ("train", "test")

_FINAL_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


def extract_final_answer(answer: str) -> str:
    """The number after ``####`` at the end of a GSM8K solution, without thousands separators."""
    match = _FINAL_ANSWER.search(answer.strip())
    if match is None:
        raise ValueError(f"GSM8K answer does not end with '#### <number>': ...{answer[-80:]!r}")
    return match.group(1).replace(",", "")


def make_gsm8k_row(question: str, answer: str, split: str, index: int) -> dict[str, Any]:
    """One row in the RL schema."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_final_answer(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


RowMaker = Callable[[str, str, str, int], dict[str, Any]]
"""make_row(question, answer, split, index) -> one RL row; make_gsm8k_row, or the ReTool recipe's."""


def read_gsm8k_split(path: str | Path, split: str, make_row: RowMaker = make_gsm8k_row) -> list[dict[str, Any]]:
    """The RL rows of one GSM8K JSONL file; a line that is not an object with a ``question`` and an ``answer``
    string is one line naming it (a byte-order mark and CRLF line ends are read as any JSONL file's)."""
    rows = []
    for number, record in enumerate(read_rows(path)):
        where = f"row {number} of {path}"
        if "question" not in record or "answer" not in record:
            raise ValueError(f"{where} has no 'question' and 'answer'; is this GSM8K's JSONL from "
                             "openai/grade-school-math?")
        for key in ("question", "answer"):
            if not isinstance(record[key], str):
                raise ValueError(f"{where} has {key!r} of type {type(record[key]).__name__}; GSM8K rows hold "
                                 "the question and its worked answer as strings")
        try:
            rows.append(make_row(record["question"], record["answer"], split, len(rows)))
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
    if not rows:
        raise ValueError(f"{path} holds no rows; --src must be the folder holding GSM8K's train.jsonl and test.jsonl")
    return rows


def convert_gsm8k(src_dir: str | Path, out_dir: str | Path, make_row: RowMaker = make_gsm8k_row) -> dict[str, Path]:
    """Write ``train.parquet`` and ``test.parquet`` under ``out_dir``; returns the paths by split. Both splits are
    read before either file is written, and each file is written whole or not at all."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src_dir, out_dir = Path(src_dir), Path(out_dir)
    missing = [str(src_dir / f"{split}.jsonl") for split in SPLITS if not (src_dir / f"{split}.jsonl").exists()]
    if missing:
        raise FileNotFoundError(f"GSM8K source files not found: {', '.join(missing)}; --src must be the folder "
                                "holding train.jsonl and test.jsonl from openai/grade-school-math")
    tables = {split: pa.Table.from_pylist(read_gsm8k_split(src_dir / f"{split}.jsonl", split, make_row))
              for split in SPLITS}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, table in tables.items():
        written[split] = out_dir / f"{split}.parquet"
        partial = out_dir / f".{split}.parquet.partial"
        try:
            pq.write_table(table, partial)
            os.replace(partial, written[split])
        finally:
            partial.unlink(missing_ok=True)
    return written
