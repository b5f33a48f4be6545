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
