from pathlib import Path

import pyarrow.parquet as pq
import pytest

from reinforge.config.schema import DataConfig
from reinforge.data.commands import data_main
from reinforge.data.gsm8k import DATA_SOURCE, INSTRUCTION, convert_gsm8k, extract_final_answer
from reinforge.data.rl_dataset import RLDataset

SAMPLE = Path(__file__).parent / "gsm8k"  # the first 20 rows of each GSM8K split (MIT, see LICENSE there)


def test_final_answer_loses_thousands_separators():
    assert extract_final_answer("so 1000 + 234 = 1234\n#### 1,234") == "1234"
    assert extract_final_answer("#### -5") == "-5"
    with pytest.raises(ValueError, match="does not end with '#### <number>'"):
        extract_final_answer("no final answer here")


def test_convert_writes_train_and_test_rows_in_the_rl_schema(tmp_path):
    written = convert_gsm8k(SAMPLE, tmp_path)
    assert written == {"train": tmp_path / "train.parquet", "test": tmp_path / "test.parquet"}
    train = pq.read_table(written["train"]).to_pylist()
    assert len(train) == 20 and pq.read_table(written["test"]).num_rows == 20
    first = train[0]
    assert first["data_source"] == DATA_SOURCE == "openai/gsm8k"
    assert first["ability"] == "math"
    assert first["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert first["prompt"] == [{"role": "user", "content": first["extra_info"]["question"] + " " + INSTRUCTION}]
    assert first["extra_info"]["split"] == "train" and first["extra_info"]["index"] == 0
    assert first["extra_info"]["answer"].endswith("#### 72")
    assert [row["extra_info"]["index"] for row in train] == list(range(20))


def test_converted_files_load_as_an_rl_dataset(tmp_path, tiny_tokenizer):
    convert_gsm8k(SAMPLE, tmp_path)
    dataset = RLDataset(str(tmp_path / "test.parquet"), tiny_tokenizer, DataConfig(max_prompt_length=4096))
    assert len(dataset) == 20 and dataset[0].data_source == "openai/gsm8k"


def test_cli_command_and_missing_source(tmp_path, capsys):
    assert data_main(["gsm8k", "--src", str(SAMPLE), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "train.parquet").exists()
    assert "wrote train rows" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="--src must be the folder holding train.jsonl and test.jsonl"):
        convert_gsm8k(tmp_path / "nowhere", tmp_path / "out")


@pytest.mark.parametrize("train, refusal", [
    ('{"question": "q", "answer": "#### 3"}\n{"question": "x", "ans', r"line 2 of .*train.jsonl is not valid JSON"),
    ('{"question": "q", "answer": null}\n', r"row 0 of .*train.jsonl has 'answer' of type NoneType"),
    ("\n", r"train.jsonl holds no rows"),
])
def test_a_malformed_source_is_one_line_naming_the_line_and_nothing_is_written(tmp_path, train, refusal):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.jsonl").write_text(train)
    (tmp_path / "src" / "test.jsonl").write_bytes((SAMPLE / "test.jsonl").read_bytes())
    with pytest.raises(ValueError, match=refusal):
        convert_gsm8k(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_a_source_with_a_byte_order_mark_and_crlf_line_ends_converts(tmp_path):
    (tmp_path / "src").mkdir()
    for split in ("train", "test"):
        lines = (SAMPLE / f"{split}.jsonl").read_text().splitlines()[:2]
        (tmp_path / "src" / f"{split}.jsonl").write_bytes(("\ufeff" + "\r\n".join(lines) + "\r\n").encode())
    written = convert_gsm8k(tmp_path / "src", tmp_path / "out")
    assert pq.read_table(written["train"]).num_rows == 2 and sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "test.parquet", "train.parquet"]
